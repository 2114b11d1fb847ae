"""megatron-core's datasets: the mmap indexed dataset, GPT/BERT/blended datasets and their builder.

Import the submodules (``megatron.core.datasets.gpt_dataset`` ...) as megatron-core code does.
"""

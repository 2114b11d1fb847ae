"""Megatron-LM's downstream tasks: zero-shot GPT evaluation (WikiText-103 perplexity, LAMBADA accuracy) and BERT
finetuning (GLUE MNLI/QQP, RACE). Run ``python tasks/main.py --task <TASK> <Megatron flags>`` (see docs/tasks.md)."""

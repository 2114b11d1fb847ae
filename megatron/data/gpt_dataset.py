"""Legacy path of the GPT dataset (re-exports of megatron.core.datasets.gpt_dataset)."""
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset  # noqa: F401

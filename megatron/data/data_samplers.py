"""Legacy path of the samplers (re-exports of megatron.training.datasets.data_samplers)."""
from megatron.training.datasets.data_samplers import (  # noqa: F401
    MegatronPretrainingRandomSampler, MegatronPretrainingSampler, RandomSeedDataset, build_pretraining_data_loader)

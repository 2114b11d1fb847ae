"""Legacy import path ``megatron.microbatches`` (re-exports of megatron.training.microbatches)."""
from megatron.training.microbatches import (  # noqa: F401
    ConstantNumMicroBatches,
    NumMicroBatchesCalculator,
    RampupBatchsizeNumMicroBatches,
    build_num_microbatches_calculator,
)

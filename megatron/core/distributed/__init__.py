"""megatron.core.distributed: Megatron's DDP with contiguous gradient buffers, and finalize_model_grads."""
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.param_and_grad_buffer import Bucket, ParamAndGradBuffer, shard_buffer
from megatron.core.distributed.torch_ddp import TorchDistributedDataParallel

__all__ = [
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "finalize_model_grads",
    "ParamAndGradBuffer",
    "Bucket",
    "shard_buffer",
    "TorchDistributedDataParallel",
]

"""megatron.core: the importable library (megatron-core's API). Importing it never touches CUDA."""
from megatron.core import parallel_state, utils
from megatron.core.inference_params import InferenceParams
from megatron.core.model_parallel_config import ModelParallelConfig

mpu = parallel_state

__all__ = ["parallel_state", "tensor_parallel", "utils", "mpu", "InferenceParams", "ModelParallelConfig"]

from megatron.core import tensor_parallel  # noqa: E402  (depends on parallel_state)

"""megatron.core: the importable library (megatron-core's API). Importing it never touches CUDA.

megatron-core's top-level names (``parallel_state`` / ``mpu``, ``tensor_parallel``, ``utils``,
``InferenceParams``, ``ModelParallelConfig``) are loaded on first use, so that code importing only a
torch-free part of the library (the indexed-dataset format and the tokenizers, as ``tools/preprocess_data.py``
does) does not pay for importing torch. ``from megatron.core import parallel_state`` and
``megatron.core.mpu`` work as in megatron-core.
"""
import importlib

_LAZY = {
    "parallel_state": ("megatron.core.parallel_state", None),
    "mpu": ("megatron.core.parallel_state", None),
    "tensor_parallel": ("megatron.core.tensor_parallel", None),
    "utils": ("megatron.core.utils", None),
    "InferenceParams": ("megatron.core.inference_params", "InferenceParams"),
    "ModelParallelConfig": ("megatron.core.model_parallel_config", "ModelParallelConfig"),
}

__all__ = ["parallel_state", "tensor_parallel", "utils", "mpu", "InferenceParams", "ModelParallelConfig"]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'megatron.core' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    value = importlib.import_module(module_name)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value
    return value

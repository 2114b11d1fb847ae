"""megatron-core's older name of :class:`~megatron.core.transformer.torch_norm.WrappedTorchNorm`."""
from megatron.core.transformer.torch_norm import WrappedTorchNorm

WrappedTorchLayerNorm = WrappedTorchNorm

"""megatron.core.fusions.fused_bias_dropout (megatron-core path)."""
from megatron.core.transformer.fusions import bias_dropout_add, get_bias_dropout_add

__all__ = ["get_bias_dropout_add", "bias_dropout_add"]

"""megatron.model.fused_bias_gelu (legacy path)."""
from megatron.core.fusions.fused_bias_gelu import GeLUFunction, bias_gelu, bias_gelu_back, bias_gelu_impl

__all__ = ["bias_gelu", "bias_gelu_back", "GeLUFunction", "bias_gelu_impl"]

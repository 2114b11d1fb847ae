"""megatron.core.fusions.fused_layer_norm (megatron-core path): ``FusedLayerNorm(config, hidden_size, eps)``."""
from megatron.core.transformer.norms import FusedLayerNorm

__all__ = ["FusedLayerNorm"]

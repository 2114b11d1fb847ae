"""megatron.model.fused_layer_norm (legacy path): ``MixedFusedLayerNorm`` is megatron.core's LayerNorm."""
from megatron.core.transformer.norms import LayerNorm, RMSNorm

MixedFusedLayerNorm = LayerNorm

__all__ = ["MixedFusedLayerNorm", "LayerNorm", "RMSNorm"]

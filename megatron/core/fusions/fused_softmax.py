"""megatron.core.fusions.fused_softmax (megatron-core path)."""
from megatron.core.transformer.fusions import FusedScaleMaskSoftmax

__all__ = ["FusedScaleMaskSoftmax"]

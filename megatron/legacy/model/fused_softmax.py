"""megatron.model.fused_softmax (legacy path)."""
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax

__all__ = ["FusedScaleMaskSoftmax"]

"""megatron.model.fused_softmax (legacy path)."""
from megatron.core.transformer.fusions import FusedScaleMaskSoftmax

__all__ = ["FusedScaleMaskSoftmax"]

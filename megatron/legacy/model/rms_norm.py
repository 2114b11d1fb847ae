"""megatron.model.rms_norm (legacy path)."""
from megatron.core.transformer.norms import RMSNorm

__all__ = ["RMSNorm"]

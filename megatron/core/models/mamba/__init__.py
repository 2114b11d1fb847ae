"""megatron.core.models.mamba: the hybrid Mamba language model and its layer specs."""
from megatron.core.models.mamba.mamba_model import MambaModel

__all__ = ["MambaModel"]

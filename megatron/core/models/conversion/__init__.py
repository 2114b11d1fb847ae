"""State-dict conversion: Hugging Face <-> ours (hf), legacy <-> megatron-core key names (keys), TP split/merge (tp)."""
from megatron.core.models.conversion import hf, keys, tp

__all__ = ["hf", "keys", "tp"]

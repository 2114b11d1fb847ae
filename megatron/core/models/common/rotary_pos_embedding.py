"""megatron-core's import path for rotary embeddings (implemented in megatron.core.transformer.rotary)."""
from megatron.core.transformer.rotary import RotaryEmbedding, apply_rotary_pos_emb

__all__ = ["RotaryEmbedding", "apply_rotary_pos_emb"]

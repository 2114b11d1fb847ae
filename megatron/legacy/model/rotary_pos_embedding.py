"""megatron.model.rotary_pos_embedding (legacy path): ``RotaryEmbedding(dim, seq_len_interpolation_factor=None)``."""
from megatron.core.transformer import rotary as _core
from megatron.core.transformer.rotary import apply_rotary_pos_emb


class RotaryEmbedding(_core.RotaryEmbedding):
    def __init__(self, dim, seq_len_interpolation_factor=None, rotary_base=10000):
        super().__init__(dim, 1.0, seq_len_interpolation_factor=seq_len_interpolation_factor, rotary_base=rotary_base)


__all__ = ["RotaryEmbedding", "apply_rotary_pos_emb"]

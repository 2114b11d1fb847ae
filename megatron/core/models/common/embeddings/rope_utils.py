"""megatron-core's path of the rotary helpers (defined in :mod:`megatron.core.transformer.rotary`)."""
from megatron.core.transformer.rotary import apply_rotary_pos_emb  # noqa: F401

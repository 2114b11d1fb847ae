"""megatron-core's path of the rotary embedding (defined in :mod:`megatron.core.transformer.rotary`)."""
from megatron.core.transformer.rotary import RotaryEmbedding, get_pos_emb_on_this_cp_rank  # noqa: F401

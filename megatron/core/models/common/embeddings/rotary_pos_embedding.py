"""megatron-core's path of the rotary embedding (defined in :mod:`megatron.core.transformer.rotary`)."""
from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank  # noqa: F401
from megatron.core.transformer.rotary import MultimodalRotaryEmbedding, RotaryEmbedding  # noqa: F401

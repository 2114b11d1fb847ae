"""megatron-core's path of the YaRN rotary embedding (defined in :mod:`megatron.core.transformer.rotary`)."""
from megatron.core.transformer.rotary import YarnRotaryEmbedding  # noqa: F401

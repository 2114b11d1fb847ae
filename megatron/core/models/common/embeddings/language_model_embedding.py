"""megatron-core's path of :class:`LanguageModelEmbedding` (defined in :mod:`megatron.core.models.common.embedding`)."""
from megatron.core.models.common.embedding import LanguageModelEmbedding  # noqa: F401

"""megatron-core's ``megatron.core.models.common.embeddings`` path (the embeddings live in
:mod:`megatron.core.models.common.embedding` and :mod:`megatron.core.transformer.rotary`)."""
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding  # noqa: F401
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding  # noqa: F401
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding  # noqa: F401

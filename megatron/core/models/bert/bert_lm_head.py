"""megatron-core's path of :class:`BertLMHead` (defined in :mod:`megatron.core.models.bert.bert_model`)."""
from megatron.core.models.bert.bert_model import BertLMHead  # noqa: F401

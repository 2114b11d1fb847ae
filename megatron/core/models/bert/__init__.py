"""megatron.core.models.bert: megatron-core's BertModel."""
from megatron.core.models.bert.bert_model import BertModel

__all__ = ["BertModel"]

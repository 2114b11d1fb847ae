"""Megatron's legacy model API (GPTModel(config, num_tokentypes, ...), BertModel) implemented in megatron.core.

``megatron.legacy.model`` and ``megatron.model`` expose these classes; every model setting is a typed
field of the ``TransformerConfig`` passed in.
"""
from megatron.core.models.legacy.bert_model import BertLMHead, BertModel
from megatron.core.models.legacy.classification import Classification, MultipleChoice
from megatron.core.models.legacy.gpt_model import GPTModel
from megatron.core.models.legacy.t5_model import T5LMHead, T5Model

__all__ = ["GPTModel", "BertModel", "BertLMHead", "T5Model", "T5LMHead", "Classification", "MultipleChoice"]

"""Former home of :mod:`megatron.core.tokenizers.bert_wordpiece` (re-exported)."""
from megatron.core.tokenizers.bert_wordpiece import *  # noqa: F401,F403
from megatron.core.tokenizers.bert_wordpiece import __all__  # noqa: F401

"""Former home of :mod:`megatron.core.tokenizers.sentencepiece_tokenizers` (re-exported)."""
from megatron.core.tokenizers.sentencepiece_tokenizers import *  # noqa: F401,F403
from megatron.core.tokenizers.sentencepiece_tokenizers import __all__  # noqa: F401

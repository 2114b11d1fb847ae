"""Former home of :mod:`megatron.core.tokenizers.tiktoken_tokenizer` (re-exported)."""
from megatron.core.tokenizers.tiktoken_tokenizer import *  # noqa: F401,F403
from megatron.core.tokenizers.tiktoken_tokenizer import __all__  # noqa: F401

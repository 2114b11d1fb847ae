"""Former home of :mod:`megatron.core.tokenizers.build_tokenizer` (re-exported)."""
from megatron.core.tokenizers.build_tokenizer import *  # noqa: F401,F403
from megatron.core.tokenizers.build_tokenizer import __all__  # noqa: F401

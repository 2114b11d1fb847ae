"""Former home of :mod:`megatron.core.tokenizers.vocab_padding` (re-exported)."""
from megatron.core.tokenizers.vocab_padding import *  # noqa: F401,F403
from megatron.core.tokenizers.vocab_padding import __all__  # noqa: F401

"""Former home of :mod:`megatron.core.tokenizers.gpt2_bpe` (re-exported)."""
from megatron.core.tokenizers.gpt2_bpe import *  # noqa: F401,F403
from megatron.core.tokenizers.gpt2_bpe import __all__  # noqa: F401

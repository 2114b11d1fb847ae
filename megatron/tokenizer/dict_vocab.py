"""Former home of :mod:`megatron.core.tokenizers.dict_vocab` (re-exported)."""
from megatron.core.tokenizers.dict_vocab import *  # noqa: F401,F403
from megatron.core.tokenizers.dict_vocab import __all__  # noqa: F401

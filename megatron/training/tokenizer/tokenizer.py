"""Megatron-LM 0.16's ``megatron.training.tokenizer.tokenizer`` (re-exports :mod:`megatron.core.tokenizers.build_tokenizer`)."""
from megatron.core.tokenizers.build_tokenizer import *  # noqa: F401,F403
from megatron.core.tokenizers.build_tokenizer import __all__  # noqa: F401

"""Megatron-LM 0.16's import path of the training tokenizers (``build_tokenizer``, ``_NullTokenizer`` ...); they live
in :mod:`megatron.core.tokenizers`."""
from megatron.core.tokenizers.build_tokenizer import build_tokenizer  # noqa: F401

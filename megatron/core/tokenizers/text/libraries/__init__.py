"""Tokenizer libraries by megatron-core's names."""
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer  # noqa: F401

"""Tokenizers with Megatron's names and properties; ``build_tokenizer(args)`` picks one from the flags."""
from megatron.tokenizer.tokenizer import build_tokenizer  # noqa: F401

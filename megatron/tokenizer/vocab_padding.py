"""Vocabulary padding (the implementation lives in :mod:`megatron.core.vocab_padding`)."""
from megatron.core.vocab_padding import vocab_size_with_padding

__all__ = ["vocab_size_with_padding"]

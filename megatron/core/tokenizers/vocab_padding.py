"""Vocabulary sizes: padding (implemented in :mod:`megatron.core.vocab_padding`) and the unpadded size that
``--vocab-size`` stands for."""
from megatron.core.vocab_padding import resolve_padded_vocab_size, vocab_size_with_padding

__all__ = ["vocab_size_with_padding", "resolve_padded_vocab_size", "null_tokenizer_vocab_size", "unpadded_vocab_size"]


def null_tokenizer_vocab_size(vocab_size: int) -> int:
    """NullTokenizer's vocabulary for ``--vocab-size N``: ids 0..N-1 plus the end-of-document id N, so N + 1.

    This is megatron-core 0.16.1's rule (and Megatron-LM 2023's); Megatron-LM after 0.16.1 uses N with eod N - 1.
    The embedding tables of 0.16.1 torch_dist checkpoints are padded from N + 1.
    """
    return int(vocab_size) + 1


def unpadded_vocab_size(tokenizer_type, vocab_size: int):
    """The vocabulary ``--vocab-size N`` stands for before padding: N + 1 for NullTokenizer, N for TikTokenizer
    or when no tokenizer is named; None for the tokenizers whose files define the vocabulary (Hugging Face,
    SentencePiece, Llama2, BERT, GPT-2), which ignore ``--vocab-size``, as Megatron-LM's do."""
    if tokenizer_type == "NullTokenizer":
        return null_tokenizer_vocab_size(vocab_size)
    if tokenizer_type in (None, "TikTokenizer"):
        return int(vocab_size)
    return None

"""Vocabulary padding, shared by the tokenizer builder and argument validation."""
from __future__ import annotations


def vocab_size_with_padding(orig_vocab_size: int, make_vocab_size_divisible_by: int = 128,
                            tensor_model_parallel_size: int = 1, rank: int = 0, log: bool = True) -> int:
    """Round ``orig_vocab_size`` up to a multiple of ``make_vocab_size_divisible_by * tp``.

    Every TP rank then holds an equal slice of the embedding table and the slices stay aligned for fast
    GEMMs. Prints Megatron's message on rank 0.
    """
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    if multiple <= 0:
        raise ValueError(f"--make-vocab-size-divisible-by x --tensor-model-parallel-size must be > 0, got {multiple}")
    after = ((orig_vocab_size + multiple - 1) // multiple) * multiple
    if log and rank == 0:
        print(" > padded vocab (size: {}) with {} dummy tokens (new size: {})".format(
            orig_vocab_size, after - orig_vocab_size, after), flush=True)
    return after


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

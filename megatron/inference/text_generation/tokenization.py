"""Prompts -> padded token tensor (broadcast from rank 0), generated tokens -> text and per-token segments."""
from __future__ import annotations

from typing import List, Optional

import torch

from megatron.core import device

from .communication import broadcast_int_list, broadcast_tensor


def _tokenizer():
    from megatron.training import get_tokenizer

    return get_tokenizer()


def tokenize_prompts(prompts: Optional[List[str]] = None, tokens_to_generate: int = 0, add_BOS: bool = False,
                     rank: int = 0):
    """On ``rank``: tokenise and pad the prompts with the end-of-document id to the longest prompt plus
    ``tokens_to_generate``; every rank returns ``(tokens [b, max_len] int64, lengths [b] int64)``."""
    sizes, tokens, lengths = None, None, None
    if torch.distributed.get_rank() == rank:
        if prompts is None or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of strings on the rank that drives generation")
        tokens, lengths = _tokenize_and_pad(prompts, tokens_to_generate, add_BOS)
        sizes = [tokens.size(0), tokens.size(1)]
    sizes = broadcast_int_list(2, sizes, rank=rank).tolist()
    tokens = broadcast_tensor(sizes, torch.int64, tokens, rank=rank)
    lengths = broadcast_tensor(sizes[0], torch.int64, lengths, rank=rank)
    return tokens, lengths


def _tokenize_and_pad(prompts, tokens_to_generate, add_BOS):
    tokenizer = _tokenizer()
    if add_BOS:
        prompt_tokens = [[tokenizer.eod] + tokenizer.tokenize(p) for p in prompts]
    else:
        prompt_tokens = [tokenizer.tokenize(p) for p in prompts]
    lengths = [len(t) for t in prompt_tokens]
    if min(lengths) == 0:
        raise ValueError("empty prompts need add_BOS=true (generation needs at least one token to start from)")
    samples_length = max(lengths) + tokens_to_generate
    padded = [t + [tokenizer.eod] * (samples_length - len(t)) for t in prompt_tokens]
    return (torch.tensor(padded, dtype=torch.int64, device=device.current_device()),
            torch.tensor(lengths, dtype=torch.int64, device=device.current_device()))


def detokenize_generations(tokens: torch.Tensor, lengths: torch.Tensor, return_segments: bool):
    """Each row up to its length -> text (and, with ``return_segments``, the text of every token)."""
    tokenizer = _tokenizer()
    texts, segments, token_lists = [], [], []
    for row, length in zip(tokens.cpu().tolist(), lengths.cpu().tolist()):
        row = row[:length]
        token_lists.append(row)
        texts.append(tokenizer.detokenize(row))
        if return_segments:
            segments.append([tokenizer.detokenize([t]) for t in row])
    if return_segments:
        return token_lists, texts, segments
    return token_lists, texts

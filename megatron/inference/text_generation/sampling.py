"""Choosing the next token from the logits: greedy, top-k, top-p (nucleus), temperature."""
from __future__ import annotations

import torch


def modify_logits_for_top_k_filtering(logits: torch.Tensor, top_k: int) -> None:
    """Set every logit below the k-th largest of its row to -inf (in place)."""
    kth_largest = torch.topk(logits, top_k)[0][..., -1, None]
    logits.masked_fill_(logits < kth_largest, float("-inf"))


def modify_logits_for_top_p_filtering(logits: torch.Tensor, top_p: float) -> None:
    """Keep the smallest set of tokens whose probabilities add up to more than ``top_p`` (in place)."""
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    filter_ = cumulative_probs > top_p
    # Shift right so that the token crossing the threshold is kept (the most likely token always is).
    filter_[:, 1:] = filter_[:, :-1].clone()
    filter_[..., 0] = False
    filter_ = filter_.scatter(1, sorted_indices, filter_)
    logits.masked_fill_(filter_, float("-inf"))


def sample(logits: torch.Tensor, top_k: int = 0, top_p: float = 0.0, temperature: float = 1.0,
           vocab_size: int = None) -> torch.Tensor:
    """``logits [b, V]`` -> token ids ``[b]``. ``top_k == 1`` is greedy; top-k and top-p are exclusive.

    ``vocab_size``: ids at or above it (the padding rows of the embedding) are never returned.
    """
    if logits.ndim != 2:
        raise ValueError(f"expected logits of shape [b, vocab], got {tuple(logits.shape)}")
    logits = logits.float()
    if vocab_size and vocab_size < logits.size(1):
        logits = logits[:, :vocab_size]
    if top_k == 1:
        if top_p != 0.0:
            raise ValueError("cannot set both greedy (top_k=1) and top-p samplings")
        return torch.argmax(logits, dim=-1)
    logits = logits.clone()
    if temperature != 1.0:
        logits.div_(temperature)
    if top_k > 1:
        if top_p != 0.0:
            raise ValueError("cannot set both top-k and top-p samplings")
        if top_k > logits.size(1):
            raise ValueError(f"top-k ({top_k}) is larger than the vocabulary ({logits.size(1)})")
        modify_logits_for_top_k_filtering(logits, top_k)
    elif top_p > 0.0:
        if top_p > 1.0:
            raise ValueError(f"top-p ({top_p}) must be in (0, 1]")
        modify_logits_for_top_p_filtering(logits, top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1).view(-1)

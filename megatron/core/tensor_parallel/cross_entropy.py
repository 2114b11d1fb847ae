"""Cross entropy over vocabulary-parallel logits (megatron.core.tensor_parallel.cross_entropy).

Each TP rank holds logits for a contiguous slice of the vocabulary. With ``z`` the full logits of one
token and ``t`` its target::

    m      = max_j z_j                      (all-reduce MAX)
    z_t    = the target logit               (owned by one rank, others contribute 0: all-reduce SUM)
    S      = sum_j exp(z_j - m)             (all-reduce SUM)
    loss   = log S - (z_t - m)

and the gradient with respect to the local logits is ``softmax(z) - onehot(t)`` restricted to the slice.

Label smoothing ``e`` follows Megatron's definition: with ``s = e * V / (V - 1)``,
``loss = (1 - s) * loss - s * mean_j log p_j``, i.e. the ``e`` mass is spread over the ``V - 1``
non-target classes. Megatron computes ``mean_j`` and ``V`` over the local vocabulary slice only, which
makes the smoothed loss depend on the TP size; here the mean runs over the full vocabulary (one extra
all-reduce), so every TP size gives the TP=1 value, which is identical to Megatron's.
"""
from __future__ import annotations

import torch

from megatron.core.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from megatron.core.tensor_parallel.utils import VocabUtility


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0, inplace=False, tp_group=None):
        group = tp_group if tp_group is not None else get_tensor_model_parallel_group()
        world_size = torch.distributed.get_world_size(tp_group) if tp_group is not None \
            else get_tensor_model_parallel_world_size()
        rank = torch.distributed.get_rank(tp_group) if tp_group is not None else get_tensor_model_parallel_rank()

        if label_smoothing > 0 and not 0.0 < label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in (0, 1), got {label_smoothing}")
        logits_max = torch.amax(vocab_parallel_logits, dim=-1)
        if world_size > 1:
            torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=group)
        # One [tokens, V/tp] buffer holds the shifted logits, then (in place) their exp, then the softmax
        # saved for backward: the caller's logits stay intact and no further vocabulary-sized copy is made.
        # In place when the caller owns the logits (the model heads): a fresh vocabulary-sized buffer costs more
        # than the subtraction itself (first-touch page faults of s*b*V/tp floats on every step).
        if inplace:
            logits = vocab_parallel_logits.sub_(logits_max.unsqueeze(dim=-1))
        else:
            logits = vocab_parallel_logits - logits_max.unsqueeze(dim=-1)

        partition_vocab_size = logits.size(-1)
        vocab_start_index, vocab_end_index = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, rank, world_size)
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target.clone() - vocab_start_index
        masked_target[target_mask] = 0

        logits_2d = logits.view(-1, partition_vocab_size)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(start=0, end=logits_2d.size(0), device=logits_2d.device)
        predicted_logits = logits_2d[arange_1d, masked_target_1d].clone().contiguous().view_as(target)
        predicted_logits[target_mask] = 0.0
        if world_size > 1:
            torch.distributed.all_reduce(predicted_logits, op=torch.distributed.ReduceOp.SUM, group=group)
        # log p_j = z_j - m - log S summed over the vocabulary needs the shifted logits: take it before exp_.
        sum_log_probs = logits.sum(dim=-1) if label_smoothing > 0 else None

        exp_logits = logits.exp_()
        sum_exp_logits = exp_logits.sum(dim=-1)
        if world_size > 1:
            torch.distributed.all_reduce(sum_exp_logits, op=torch.distributed.ReduceOp.SUM, group=group)

        loss = torch.log(sum_exp_logits) - predicted_logits

        vocab_size = partition_vocab_size * world_size
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            if world_size > 1:
                torch.distributed.all_reduce(sum_log_probs, op=torch.distributed.ReduceOp.SUM, group=group)
            mean_log_probs = sum_log_probs / vocab_size - torch.log(sum_exp_logits)
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs

        # softmax = exp_logits / S is never formed here: backward scales exp_logits by grad_output / S in one pass.
        ctx.save_for_backward(exp_logits, sum_exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        exp_logits, sum_exp_logits, target_mask, masked_target_1d = ctx.saved_tensors
        label_smoothing, vocab_size = ctx.label_smoothing, ctx.vocab_size

        # d loss / d z_j = g * (softmax_j - (1 - s) [j == t] - s / V) with s the smoothing (0 without): the softmax
        # term is exp_logits * (g / S), written over the saved buffer.
        grad_input = exp_logits.mul_((grad_output / sum_exp_logits).unsqueeze(dim=-1))
        partition_vocab_size = grad_input.size(-1)
        grad_2d = grad_input.view(-1, partition_vocab_size)
        arange_1d = torch.arange(start=0, end=grad_2d.size(0), device=grad_2d.device)
        target_weight = grad_output.reshape(-1) * (1.0 - target_mask.view(-1).to(grad_2d.dtype))
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            grad_2d[arange_1d, masked_target_1d] -= (1.0 - smoothing) * target_weight
            grad_input.sub_((smoothing / vocab_size) * grad_output.unsqueeze(dim=-1))
        else:
            grad_2d[arange_1d, masked_target_1d] -= target_weight
        return grad_input, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, *, inplace=False, tp_group=None):
    """Per-token cross entropy ``[s, b]`` of logits ``[s, b, V/tp]`` against targets ``[s, b]`` (no reduction).

    ``inplace=True`` (an extension; Megatron's signature is the first three arguments) lets the function overwrite
    the logits with its working values instead of allocating a buffer of the same size: for callers that created
    the logits for this loss only and do not read them afterwards, as the GPT and BERT heads do.
    """
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, inplace, tp_group)

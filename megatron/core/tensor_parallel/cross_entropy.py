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


class VocabParallelCrossEntropy:
    """megatron-core's steps of the vocabulary-parallel cross entropy (module docstring), each on this rank's slice
    ``[..., V/tp]``; the caller all-reduces between them (MAX of ``logits_max``, SUM of ``predicted_logits`` and
    ``sum_exp_logits``). The steps work in place on the fp32 logits they are given."""

    @staticmethod
    def calculate_logits_max(vocab_parallel_logits: torch.Tensor):
        """``(logits in fp32 (the same tensor when already fp32), local max over the vocabulary)``."""
        vocab_parallel_logits = vocab_parallel_logits.float()
        return vocab_parallel_logits, vocab_parallel_logits.amax(dim=-1)

    @staticmethod
    def calculate_predicted_logits(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                   logits_max: torch.Tensor, vocab_start_index: int, vocab_end_index: int):
        """Shift the logits by ``logits_max`` and exponentiate them, in place. Returns ``(target_mask`` (True where
        the target is outside ``[vocab_start_index, vocab_end_index)``), ``masked_target_1d`` (local target index,
        0 where masked), ``predicted_logits`` (``z_t - m``, 0 where masked), ``sum_exp_logits`` (local
        ``sum_j exp(z_j - m)``), ``exp_logits`` (the input, now ``exp(z - m)``)``."""
        logits = vocab_parallel_logits.sub_(logits_max.unsqueeze(dim=-1))
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target.clone() - vocab_start_index
        masked_target[target_mask] = 0
        partition_vocab_size = logits.size(-1)
        logits_2d = logits.view(-1, partition_vocab_size)
        masked_target_1d = masked_target.view(-1)
        rows = torch.arange(logits_2d.size(0), device=logits_2d.device)
        predicted_logits = logits_2d[rows, masked_target_1d].clone().contiguous().view_as(target)
        predicted_logits[target_mask] = 0.0
        exp_logits = logits.exp_()
        return target_mask, masked_target_1d, predicted_logits, exp_logits.sum(dim=-1), exp_logits

    @staticmethod
    def calculate_cross_entropy_loss(exp_logits: torch.Tensor, predicted_logits: torch.Tensor,
                                     sum_exp_logits: torch.Tensor):
        """``(softmax, loss)``: ``loss = log S - (z_t - m)`` with the global ``S``; ``exp_logits`` is divided by
        ``S`` in place and returned as the softmax."""
        loss = torch.log(sum_exp_logits) - predicted_logits
        return exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1)), loss

    @staticmethod
    def prepare_gradient_calculation_operands(softmax: torch.Tensor, target_mask: torch.Tensor):
        """``(grad_2d`` (a ``[tokens, V/tp]`` view of the softmax, which becomes the gradient), ``arange_1d``,
        ``softmax_update`` (1 where this rank owns the target, else 0), ``grad_input`` (the softmax itself)``."""
        grad_2d = softmax.view(-1, softmax.size(-1))
        arange_1d = torch.arange(grad_2d.size(0), device=grad_2d.device)
        softmax_update = 1.0 - target_mask.view(-1).float()
        return grad_2d, arange_1d, softmax_update, softmax

    @staticmethod
    def calculate_gradients(grad_2d: torch.Tensor, arange_1d: torch.Tensor, masked_target_1d: torch.Tensor,
                            softmax_update: torch.Tensor, grad_input: torch.Tensor, grad_output: torch.Tensor):
        """``d loss / d z = g * (softmax - onehot(t))``, in place in ``grad_input``."""
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        return grad_input.mul_(grad_output.unsqueeze(dim=-1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0, inplace=False, tp_group=None):
        steps = VocabParallelCrossEntropy
        group = tp_group if tp_group is not None else get_tensor_model_parallel_group()
        world_size = torch.distributed.get_world_size(tp_group) if tp_group is not None \
            else get_tensor_model_parallel_world_size()
        rank = torch.distributed.get_rank(tp_group) if tp_group is not None else get_tensor_model_parallel_rank()

        if label_smoothing > 0 and not 0.0 < label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in (0, 1), got {label_smoothing}")
        # One fp32 [tokens, V/tp] buffer holds the shifted logits, then (in place) their exp, then the softmax saved
        # for backward. In place on the caller's fp32 logits only when it owns them (the model heads): a fresh
        # vocabulary-sized buffer costs more than the subtraction itself.
        logits, logits_max = steps.calculate_logits_max(vocab_parallel_logits)
        if logits is vocab_parallel_logits and not inplace:
            logits = logits.clone()
        if world_size > 1:
            torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=group)
        partition_vocab_size = logits.size(-1)
        vocab_start_index, vocab_end_index = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, rank, world_size)
        # sum_j log p_j needs sum_j (z_j - m) = sum_j z_j - (V/tp) m: taken before the steps overwrite the logits.
        sum_logits = logits.sum(dim=-1) if label_smoothing > 0 else None
        target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits = \
            steps.calculate_predicted_logits(logits, target, logits_max, vocab_start_index, vocab_end_index)
        if world_size > 1:
            torch.distributed.all_reduce(predicted_logits, op=torch.distributed.ReduceOp.SUM, group=group)
            torch.distributed.all_reduce(sum_exp_logits, op=torch.distributed.ReduceOp.SUM, group=group)
        softmax, loss = steps.calculate_cross_entropy_loss(exp_logits, predicted_logits, sum_exp_logits)

        vocab_size = partition_vocab_size * world_size
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            sum_log_probs = sum_logits - partition_vocab_size * logits_max
            if world_size > 1:
                torch.distributed.all_reduce(sum_log_probs, op=torch.distributed.ReduceOp.SUM, group=group)
            mean_log_probs = sum_log_probs / vocab_size - torch.log(sum_exp_logits)
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        label_smoothing, vocab_size = ctx.label_smoothing, ctx.vocab_size
        steps = VocabParallelCrossEntropy
        grad_2d, arange_1d, softmax_update, grad_input = steps.prepare_gradient_calculation_operands(
            softmax, target_mask)
        if label_smoothing > 0:
            # d loss / d z_j = g * (softmax_j - (1 - s) [j == t] - s / V), s the smoothing.
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            grad_2d[arange_1d, masked_target_1d] -= (1.0 - smoothing) * softmax_update
            grad_2d.sub_(smoothing / vocab_size)
            grad_input = grad_input.mul_(grad_output.unsqueeze(dim=-1))
        else:
            grad_input = steps.calculate_gradients(grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input,
                                                   grad_output)
        return grad_input, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, *, inplace=False, tp_group=None):
    """Per-token cross entropy ``[s, b]`` of logits ``[s, b, V/tp]`` against targets ``[s, b]`` (no reduction).

    ``inplace=True`` (an extension; Megatron's signature is the first three arguments) lets the function overwrite
    the logits with its working values instead of allocating a buffer of the same size: for callers that created
    the logits for this loss only and do not read them afterwards, as the GPT and BERT heads do.
    """
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, inplace, tp_group)

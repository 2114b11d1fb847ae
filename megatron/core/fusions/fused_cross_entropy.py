"""Fused vocabulary-parallel cross entropy (``--cross-entropy-loss-fusion``).

The same loss and gradient as :mod:`megatron.core.tensor_parallel.cross_entropy` (see its docstring for
the math), restructured for fewer kernels and collectives:

* the local part of the forward (shift by the max, pick the target logit, exp, row sums) is ONE compiled
  function, and the backward (softmax minus the one-hot, label smoothing, times the incoming gradient)
  another;
* the target logit, the sum of exponentials and (with label smoothing) the sum of logits travel in ONE
  all-reduce over the tensor-parallel group instead of two or three.

Where no compiled kernel can run (see :func:`megatron.core.fusions.fused_kernels.compile_blocker`) the
plain vocab-parallel cross entropy runs instead, and that choice is logged once.
"""
from __future__ import annotations

import torch

from megatron.core.fusions.fused_kernels import FusedOp
from megatron.core.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.utils import VocabUtility
from megatron.core.utils import log_once


def _local_statistics(logits: torch.Tensor, logits_max: torch.Tensor, target: torch.Tensor, vocab_start: int,
                      vocab_end: int):
    """exp(z - m) and the stacked per-token [target logit (0 if not local), sum exp, sum of (z - m)]."""
    shifted = logits - logits_max.unsqueeze(-1)
    not_local = (target < vocab_start) | (target >= vocab_end)
    local_target = torch.where(not_local, torch.zeros_like(target), target - vocab_start)
    predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
    predicted = torch.where(not_local, torch.zeros_like(predicted), predicted)
    exp_logits = torch.exp(shifted)
    stats = torch.stack([predicted, exp_logits.sum(-1), shifted.sum(-1)])
    return exp_logits, stats, local_target, not_local


def _gradient(exp_logits: torch.Tensor, sum_exp: torch.Tensor, local_target: torch.Tensor,
              not_local: torch.Tensor, grad_output: torch.Tensor, smoothing: float, vocab_size: int):
    """d loss / d local logits = softmax - (1 - s) onehot(target) - s / V, times the incoming gradient."""
    softmax = exp_logits / sum_exp.unsqueeze(-1)
    columns = torch.arange(exp_logits.size(-1), device=exp_logits.device)
    is_target = (columns == local_target.unsqueeze(-1)) & ~not_local.unsqueeze(-1)
    grad = softmax - torch.where(is_target, 1.0 - smoothing, 0.0).to(softmax.dtype)
    if smoothing > 0:
        grad = grad - smoothing / vocab_size
    return grad * grad_output.unsqueeze(-1)


LOCAL_STATISTICS = FusedOp("vocab-parallel cross entropy (forward)", _local_statistics)
GRADIENT = FusedOp("vocab-parallel cross entropy (backward)", _gradient)


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0):
        group = get_tensor_model_parallel_group()
        world_size = get_tensor_model_parallel_world_size()
        logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]
        if world_size > 1:
            torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=group)
        partition_vocab_size = vocab_parallel_logits.size(-1)
        vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, get_tensor_model_parallel_rank(), world_size)
        exp_logits, stats, local_target, not_local = LOCAL_STATISTICS(
            vocab_parallel_logits, logits_max, target, vocab_start, vocab_end,
            on_cuda=vocab_parallel_logits.is_cuda)
        if world_size > 1:
            torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.SUM, group=group)
        predicted, sum_exp, sum_shifted = stats.unbind(0)
        loss = torch.log(sum_exp) - predicted
        vocab_size = partition_vocab_size * world_size
        smoothing = 0.0
        if label_smoothing > 0:
            if not 0.0 < label_smoothing < 1.0:
                raise ValueError(f"label_smoothing must be in (0, 1), got {label_smoothing}")
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            mean_log_probs = sum_shifted / vocab_size - torch.log(sum_exp)
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
        ctx.smoothing, ctx.vocab_size = smoothing, vocab_size
        ctx.save_for_backward(exp_logits, sum_exp, local_target, not_local)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        exp_logits, sum_exp, local_target, not_local = ctx.saved_tensors
        grad = GRADIENT(exp_logits, sum_exp, local_target, not_local, grad_output.contiguous(), ctx.smoothing,
                        ctx.vocab_size, on_cuda=exp_logits.is_cuda)
        return grad, None, None


def fused_vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
    """Per-token loss ``[s, b]`` of logits ``[s, b, V/tp]``; compiled where possible, else the plain version."""
    from megatron.core.fusions.fused_kernels import compile_blocker

    reason = compile_blocker(vocab_parallel_logits.is_cuda)
    if reason is None:
        reason = LOCAL_STATISTICS._broken or GRADIENT._broken
    if reason is not None:
        log_once("fused_ce:plain", f"using plain vocab-parallel cross entropy: {reason}")
        return vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing)
    return _FusedVocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing)

"""``--check-for-nan-in-loss-and-grad``: stop the run at the first NaN/Inf in a local loss or gradient.

Each rank looks at its *local* values (the loss before the data-parallel average, the gradients before the
data-parallel reduction), so the report can name the rank where the fault first appeared. The ranks then agree
with one all-reduce over the whole world per iteration (only when the flag is on) and all raise the same
:class:`NumericalFaultError`; no rank is left waiting in a collective, and the entry point prints the message
once (global rank 0) and exits non-zero.

With ``--fp16`` only NaN is fatal: an Inf gradient is a loss-scale overflow, which the dynamic loss scaler
handles by skipping the step (as Megatron, whose check looks for NaN only).
"""
from __future__ import annotations

import torch

from megatron.core import device
from megatron.training.errors import FatalRunError
from megatron.training.fault_injection import fault_requested


class NumericalFaultError(FatalRunError):
    """NaN/Inf in a loss or gradient under --check-for-nan-in-loss-and-grad (same message on every rank)."""


class NumericalGuard:
    """Per-iteration record of this rank's non-finite local loss / gradient, and the world-wide verdict."""

    def __init__(self, check: bool, allow_inf: bool):
        self.check = check
        self.allow_inf = allow_inf
        self.bad_loss = False
        self.bad_grad = False

    def reset(self):
        self.bad_loss = self.bad_grad = False

    def _bad(self, tensors) -> bool:
        tensors = [t for t in tensors if t is not None and t.numel() > 0]
        if not tensors:
            return False
        norms = torch.stack([t.detach().float().norm() for t in tensors])
        return bool(torch.isnan(norms).any()) if self.allow_inf else not bool(torch.isfinite(norms).all())

    def note_loss(self, loss: torch.Tensor):
        if self.check and not self.bad_loss:
            self.bad_loss = self._bad([loss])

    def note_grads(self, model_chunks):
        if self.check and not self.bad_grad:
            self.bad_grad = self._bad([_local_grad(p) for chunk in model_chunks for p in chunk.parameters()])

    def raise_if_any_rank_failed(self, iteration: int):
        """One all-reduce (MIN of the failing ranks) over the world; every rank raises the same error."""
        if not self.check:
            return
        world = torch.distributed.get_world_size()
        rank = torch.distributed.get_rank()
        flags = torch.tensor([rank if self.bad_loss else world, rank if self.bad_grad else world],
                             dtype=torch.int64, device=device.current_device())
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
        loss_rank, grad_rank = (int(v) for v in flags.tolist())
        self.reset()
        if loss_rank == world and grad_rank == world:
            return
        what = "NaN" if self.allow_inf else "NaN or Inf"
        where = (f"the local loss on rank {loss_rank}" if loss_rank < world
                 else f"the local gradient on rank {grad_rank} (before the data-parallel reduction)")
        raise NumericalFaultError(
            f"iteration {iteration}: found {what} in {where} (--check-for-nan-in-loss-and-grad); stopping the run "
            "on every rank. Lower --lr, check the data of this iteration, or resume from the last checkpoint",
            same_on_every_rank=True)


def _local_grad(param):
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def inject_nan_grad(model_chunks, rank: int, iteration: int):
    """Test hook (MEGATRON_FAULT_INJECT=nan_grad:...): poison one local gradient element on this rank."""
    if not fault_requested("nan_grad", rank, iteration):
        return
    for chunk in model_chunks:
        for param in chunk.parameters():
            grad = _local_grad(param)
            if grad is not None and grad.numel() > 0:
                grad.view(-1)[0] = float("nan")
                return


def wrap_forward_step(forward_step_func, guard: NumericalGuard, rank: int, iteration: int):
    """The forward step, with its loss function checked (and, for tests, poisoned) on this rank."""

    def checked_forward_step(data_iterator, model, *rest):
        output_tensor, loss_func = forward_step_func(data_iterator, model, *rest)

        def checked_loss_func(*args, **kwargs):
            # (loss, reported) or today's (loss_sum, num_tokens, reported): the loss is first, the report last.
            result = loss_func(*args, **kwargs)
            loss, reported = result[0], result[-1]
            if fault_requested("nan_loss", rank, iteration):
                loss = loss * float("nan")
                reported = {key: value * float("nan") for key, value in reported.items()}
            guard.note_loss(loss)
            return (loss, *result[1:-1], reported)

        return output_tensor, checked_loss_func

    return checked_forward_step

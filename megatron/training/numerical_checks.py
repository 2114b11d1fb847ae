"""The trainer's side of the rerun state machine: its set-up from the flags, the validation sites, and what a
re-run must restore.

Validation sites (each calls ``validate_result`` of megatron/core/rerun_state_machine.py on this rank's *local*
values, so a report names the rank where a fault first appeared):

* the loss of every micro-batch, before the data-parallel average (the forward step's loss function, wrapped):
  NaN and Inf with ``--check-for-nan-in-loss-and-grad`` (the default; fatal, tolerance 0), spiky with
  ``--check-for-spiky-loss`` (at least 10x the largest of the first 100 losses; non-fatal);
* the L2 norm of each model chunk's local gradients, before the data-parallel reduction (the
  ``finalize_model_grads`` hook): NaN and Inf (fatal, tolerance 1e-3: a backward pass need not be bitwise
  deterministic), large with ``--check-for-large-grads`` (non-fatal).

With ``--fp16`` only the loss is checked, for NaN: an Inf loss, and NaN or Inf gradients, are loss-scale
overflows, which the loss scaler handles by skipping the step. With ``--overlap-grad-reduce`` (or
``--DDP-impl torch``) the reduction already ran during the backward pass, so the gradient check sees reduced
gradients.

A re-run redoes the iteration from the same state: :class:`IterationState` snapshots, at the start of every
iteration, the Python / NumPy / torch / device RNG states, the model-parallel RNG tracker, every model buffer
(FP8 scaling history, router expert bias and token counts) and drops the routers' tracked losses before a re-run;
the data iterators replay the same micro-batches (``RerunDataIterator``).

With ``--rerun-mode disabled`` a fatal rejection stops every rank with one line (:class:`NumericalFaultError`).
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import numpy as np
import torch

from megatron.core import device, tensor_parallel
from megatron.core.rerun_state_machine import (
    LARGE_GRADS_FACTOR,
    SPIKY_LOSS_FACTOR,
    RerunErrorInjector,
    RerunMode,
    get_rerun_state_machine,
    initialize_rerun_state_machine,
    iterations_to_skip_from_tracker,
)
from megatron.training.errors import FatalRunError
from megatron.training.fault_injection import fault_requested

LOSS_NAN = "found NaN in local forward loss calculation"
LOSS_INF = "found Inf in local forward loss calculation"
SPIKY_LOSS = "Spiky loss"
GRAD_NAN = "found NaN in local grad norm before the data-parallel reduction"
GRAD_INF = "found Inf in local grad norm before the data-parallel reduction"
LARGE_GRADS = "found unexpectedly large grads"
GRAD_TOLERANCE = 1e-3


class NumericalFaultError(FatalRunError):
    """A fatal rejected result with --rerun-mode disabled (the same message on every rank)."""


@dataclass(frozen=True)
class ResultChecks:
    nan: bool
    allow_inf: bool
    spiky_loss: bool
    large_grads: bool

    @classmethod
    def from_args(cls, args) -> "ResultChecks":
        return cls(nan=bool(args.check_for_nan_in_loss_and_grad), allow_inf=bool(args.fp16),
                   spiky_loss=bool(args.check_for_spiky_loss), large_grads=bool(args.check_for_large_grads))

    @property
    def any(self) -> bool:
        return self.nan or self.spiky_loss or self.large_grads


def setup_rerun_state_machine(args) -> None:
    """Create the process's rerun state machine from the flags (initialize_megatron) and add the iterations the
    tracker file says to skip to ``args.iterations_to_skip``."""
    checks = ResultChecks.from_args(args)
    initialize_rerun_state_machine(
        mode=RerunMode.from_flag(args.rerun_mode),
        error_injector=RerunErrorInjector(args.error_injection_rate, args.error_injection_type, seed=args.seed),
        result_rejected_tracker_filename=args.result_rejected_tracker_filename,
        checks_requested=checks.any or args.error_injection_rate > 0)
    from_tracker = iterations_to_skip_from_tracker(args.result_rejected_tracker_filename)
    if from_tracker and args.rank == 0:
        print(f"[rerun] {args.result_rejected_tracker_filename}: iterations {from_tracker} gave a bad result that "
              "reproduced twice: they will be skipped", flush=True)
    args.iterations_to_skip = sorted(set(args.iterations_to_skip) | set(from_tracker))


def validate_loss(loss: torch.Tensor, checks: ResultChecks) -> None:
    machine = get_rerun_state_machine()
    if checks.nan:
        machine.validate_result(loss, torch.isnan, LOSS_NAN, tolerance=0.0, fatal=True)
        if not checks.allow_inf:
            machine.validate_result(loss, torch.isinf, LOSS_INF, tolerance=0.0, fatal=True)
    if checks.spiky_loss:
        machine.validate_result(loss, functools.partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR,
                                                        context="loss"),
                                SPIKY_LOSS, tolerance=0.0, fatal=False)


def _local_grad(param):
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def local_grad_norm(chunk) -> torch.Tensor:
    """L2 norm of this rank's gradients of ``chunk`` (FSDP's DTensor gradients: this rank's shards)."""
    grads = [getattr(g, "to_local", lambda: g)() for g in map(_local_grad, chunk.parameters()) if g is not None]
    grads = [g.detach().float() for g in grads if g.numel() > 0]
    if not grads:
        return torch.zeros((), device=device.current_device())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def validate_grads(model_chunks, checks: ResultChecks) -> None:
    machine = get_rerun_state_machine()
    for chunk in model_chunks:
        norm = local_grad_norm(chunk)
        if checks.nan and not checks.allow_inf:  # fp16: the loss scaler skips steps with NaN / Inf gradients
            machine.validate_result(norm, torch.isnan, GRAD_NAN, tolerance=GRAD_TOLERANCE, fatal=True)
            machine.validate_result(norm, torch.isinf, GRAD_INF, tolerance=GRAD_TOLERANCE, fatal=True)
        if checks.large_grads:
            machine.validate_result(norm, functools.partial(machine.is_unexpectedly_large,
                                                            threshold=LARGE_GRADS_FACTOR, context="grads"),
                                    LARGE_GRADS, tolerance=GRAD_TOLERANCE, fatal=False)


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


def wrap_forward_step(forward_step_func, checks: ResultChecks, rank: int, iteration: int):
    """The forward step, with its loss function validated (and, for tests, poisoned) on this rank."""

    def checked_forward_step(data_iterator, model, *rest):
        output_tensor, loss_func = forward_step_func(data_iterator, model, *rest)

        def checked_loss_func(*args, **kwargs):
            # (loss, reported) or today's (loss_sum, num_tokens, reported): the loss is first, the report last.
            result = loss_func(*args, **kwargs)
            loss, reported = result[0], result[-1]
            if fault_requested("nan_loss", rank, iteration):
                loss = loss * float("nan")
                reported = {key: value * float("nan") for key, value in reported.items()}
            validate_loss(loss.detach(), checks)
            return (loss, *result[1:-1], reported)

        return output_tensor, checked_loss_func

    return checked_forward_step


class IterationState:
    """What a re-run of an iteration must find as the first run found it (module docstring)."""

    def __init__(self, model_chunks):
        self.model_chunks = model_chunks

    def save(self):
        buffers = [(b, b.detach().clone()) for chunk in self.model_chunks for b in chunk.buffers()]
        return {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "device": device.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
                "buffers": buffers}

    def restore(self, state) -> None:
        random.setstate(state["random"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        device.set_rng_state(state["device"])
        tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["tracker"]))
        with torch.no_grad():
            for buffer, saved in state["buffers"]:
                buffer.copy_(saved)
        for chunk in self.model_chunks:
            for module in chunk.modules():
                tracked = getattr(module, "tracked_losses", None)
                if isinstance(tracked, dict):
                    tracked.clear()  # the routers' aux-loss sums of the abandoned pass

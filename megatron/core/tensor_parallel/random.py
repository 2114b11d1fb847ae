"""Model-parallel RNG states and activation recompute (megatron.core.tensor_parallel.random).

Dropout inside tensor-parallel regions (e.g. attention probabilities, which are split by head) must differ
across TP ranks, while dropout on replicated activations must be identical across TP ranks. Megatron keeps
two generator states: the default one (seeded identically on every TP rank) and a named
``'model-parallel-rng'`` state seeded with ``seed + 2718 + tp_rank``, entered with
``get_cuda_rng_tracker().fork()``; as in megatron-core the tracker also holds ``'data-parallel-rng'`` (``seed``)
and ``'expert-parallel-rng'`` (``seed + 1024 + 100 * ep_rank + etp_rank``). The names say "cuda" for
compatibility; on a machine without a GPU the states are those of torch's CPU generator (see megatron.core.device).

:class:`CheckpointWithoutOutput` recomputes a function in backward like :func:`checkpoint`, and also frees its
output's storage once the caller has used it (``discard_output_and_register_recompute``).
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import detach_variable

from megatron.core import device
from megatron.core.parallel_state import (get_expert_model_parallel_rank, get_expert_tensor_parallel_rank,
                                          get_tensor_model_parallel_rank)
from megatron.core.tensor_parallel.utils import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks
from megatron.core.utils import safely_set_viewless_tensor_data

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"


def get_expert_parallel_rng_tracker_name() -> str:
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def get_data_parallel_rng_tracker_name() -> str:
    return _DATA_PARALLEL_RNG_TRACKER_NAME


class CudaRNGStatesTracker:
    """Named generator states that can be forked into and out of.

    ``fork(name)`` swaps the device generator's state for the tracked one, runs the block, stores the
    advanced state back under ``name`` and restores the original state, so code outside the block sees
    the default stream unaffected.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = states

    def add(self, name, seed):
        if seed in self.seeds_:
            raise Exception("seed {} already exists".format(seed))
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception("cuda rng state {} already exists".format(name))
        orig_rng_state = device.get_rng_state()
        device.manual_seed(seed)
        self.states_[name] = device.get_rng_state()
        device.set_rng_state(orig_rng_state)

    @contextlib.contextmanager
    def fork(self, name=_MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception("cuda rng state {} is not added".format(name))
        orig_rng_state = device.get_rng_state()
        device.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = device.get_rng_state()
            device.set_rng_state(orig_rng_state)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()
_CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def initialize_rng_tracker(use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                           use_cudagraphable_rng: bool = False, force_reset: bool = False) -> None:
    """(Re)create the tracker: ``force_reset`` gives a new, empty one; otherwise an existing tracker is kept.
    Transformer Engine's and CUDA-graph-safe trackers are GPU bindings: asking for them is an error here."""
    global _CUDA_RNG_STATE_TRACKER, _CUDA_RNG_STATE_TRACKER_INITIALIZED
    if use_te_rng_tracker or use_cudagraphable_rng:
        raise NotImplementedError("Transformer Engine's / CUDA-graph-safe RNG trackers need a GPU build; use the "
                                  "default tracker")
    if force_reset:
        _CUDA_RNG_STATE_TRACKER, _CUDA_RNG_STATE_TRACKER_INITIALIZED = None, False
    if _CUDA_RNG_STATE_TRACKER_INITIALIZED:
        return
    _CUDA_RNG_STATE_TRACKER = _InferenceRNGStatesTracker() if inference_rng_tracker else CudaRNGStatesTracker()
    _CUDA_RNG_STATE_TRACKER_INITIALIZED = True


class _InferenceRNGStatesTracker(CudaRNGStatesTracker):
    """Inference: no tracked states; ``fork`` draws from the default generator."""

    def add(self, name, seed):
        pass

    def set_states(self, states):
        pass

    def fork(self, name=_MODEL_PARALLEL_RNG_TRACKER_NAME):
        return contextlib.nullcontext()


def get_cuda_rng_tracker(use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                         use_cudagraphable_rng: bool = False) -> CudaRNGStatesTracker:
    initialize_rng_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    return _CUDA_RNG_STATE_TRACKER


def get_all_rng_states() -> dict:
    """The tracker's states by name (the live dict)."""
    if not _CUDA_RNG_STATE_TRACKER_INITIALIZED:
        raise RuntimeError("the RNG tracker is not initialized")
    return _CUDA_RNG_STATE_TRACKER.states_


def model_parallel_cuda_manual_seed(seed: int, te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                                    use_cudagraphable_rng: bool = False, tp_rank=None, ep_rank=None, etp_rank=None,
                                    force_reset_rng: bool = False) -> None:
    """Seed the default generator with ``seed`` and the tracker with ``'data-parallel-rng'`` (``seed``),
    ``'model-parallel-rng'`` (``seed + 2718 + tp_rank``) and ``'expert-parallel-rng'`` (``seed + 1024 +
    100 * ep_rank + etp_rank``); the ranks default to parallel_state's.

    Call after model-parallel groups exist. Tensor-parallel regions then draw different random numbers on
    each TP rank, while everything else stays identical across the TP group.
    """
    tp_rank = get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    ep_rank = (get_expert_model_parallel_rank() or 0) if ep_rank is None else ep_rank
    etp_rank = (get_expert_tensor_parallel_rank() or 0) if etp_rank is None else etp_rank
    initialize_rng_tracker(te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset=force_reset_rng)
    tracker = _CUDA_RNG_STATE_TRACKER
    tracker.reset()
    device.manual_seed(seed)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


_IS_CHECKPOINTING = False


def is_checkpointing() -> bool:
    """True inside the forward of an activation-recompute region (first run or recompute)."""
    return _IS_CHECKPOINTING


@contextlib.contextmanager
def _checkpointing():
    global _IS_CHECKPOINTING
    previous, _IS_CHECKPOINTING = _IS_CHECKPOINTING, True
    try:
        yield
    finally:
        _IS_CHECKPOINTING = previous


def _all_rng_states():
    return torch.get_rng_state(), device.get_rng_state(), get_cuda_rng_tracker().get_states()


def _set_all_rng_states(cpu_state, device_state, tracker_states) -> None:
    torch.set_rng_state(cpu_state)
    device.set_rng_state(device_state)
    get_cuda_rng_tracker().set_states(tracker_states)


class CheckpointFunction(torch.autograd.Function):
    """Run ``run_function`` without keeping activations; recompute them in backward with the same RNG.

    The CPU, device and tracker RNG states at forward time are saved and restored around the recompute,
    so dropout masks are identical in both passes and the gradients equal those of a normal run. With
    ``distribute_saved_activations`` the first input is stored as this TP rank's 1-D slice and gathered
    again before recomputing, dividing its memory by the TP size.
    """

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *args):
        ctx.run_function = run_function
        ctx.distribute_saved_activations = distribute_saved_activations
        ctx.fwd_cpu_rng_state = torch.get_rng_state()
        ctx.fwd_device_rng_state = device.get_rng_state()
        ctx.fwd_tracker_states = get_cuda_rng_tracker().get_states()

        with torch.no_grad(), _checkpointing():
            outputs = run_function(*args)

        if distribute_saved_activations:
            ctx.input_0_shape = args[0].data.shape
            safely_set_viewless_tensor_data(args[0], split_tensor_into_1d_equal_chunks(args[0].data, new_buffer=True))

        # Only tensors can go through save_for_backward; remember where the others were.
        ctx.tensor_indices = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.non_tensor_args = {i: a for i, a in enumerate(args) if not torch.is_tensor(a)}
        ctx.num_args = len(args)
        ctx.save_for_backward(*[args[i] for i in ctx.tensor_indices])
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("Checkpointing is not compatible with .grad(), please use .backward() if possible")
        saved = ctx.saved_tensors
        if ctx.distribute_saved_activations and ctx.tensor_indices and ctx.tensor_indices[0] == 0:
            safely_set_viewless_tensor_data(saved[0], gather_split_1d_tensor(saved[0].data).view(ctx.input_0_shape))

        bwd_cpu_rng_state = torch.get_rng_state()
        bwd_device_rng_state = device.get_rng_state()
        bwd_tracker_states = get_cuda_rng_tracker().get_states()

        torch.set_rng_state(ctx.fwd_cpu_rng_state)
        device.set_rng_state(ctx.fwd_device_rng_state)
        get_cuda_rng_tracker().set_states(ctx.fwd_tracker_states)

        detached = detach_variable(tuple(saved))
        args = [None] * ctx.num_args
        for slot, tensor in zip(ctx.tensor_indices, detached):
            args[slot] = tensor
        for slot, value in ctx.non_tensor_args.items():
            args[slot] = value
        try:
            with torch.enable_grad(), _checkpointing():
                outputs = ctx.run_function(*args)
        finally:
            torch.set_rng_state(bwd_cpu_rng_state)
            device.set_rng_state(bwd_device_rng_state)
            get_cuda_rng_tracker().set_states(bwd_tracker_states)

        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = [None] * ctx.num_args
        for slot, tensor in zip(ctx.tensor_indices, detached):
            grads[slot] = tensor.grad
        return (None, None) + tuple(grads)


def checkpoint(function, distribute_saved_activations, *args):
    """Activation recompute of ``function(*args)`` that restores every RNG state (see CheckpointFunction)."""
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)


class CheckpointWithoutOutputFunction(torch.autograd.Function):
    """The autograd node of :class:`CheckpointWithoutOutput`: runs the function without a graph, keeps its inputs;
    backward propagates through the recomputed outputs (``ctx.outputs``, set by the recompute hook)."""

    @staticmethod
    def forward(ctx, run_function, owner, *args):
        with torch.no_grad(), _checkpointing():
            outputs = run_function(*args)
        ctx.save_for_backward(*detach_variable(args))
        owner.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        inputs, outputs = ctx.inputs, ctx.outputs
        if outputs is None:
            raise RuntimeError("CheckpointWithoutOutput: the output was not recomputed before its backward (call "
                               "discard_output_and_register_recompute with a tensor whose gradient comes first)")
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ctx.inputs = ctx.outputs = None
        return (None, None) + tuple(t.grad if torch.is_tensor(t) else None for t in inputs)


class CheckpointWithoutOutput:
    """Recompute ``run_function`` in backward and free its output in between (megatron-core's).

    ``out = ckpt.checkpoint(fn, *inputs)`` runs ``fn`` without keeping its graph; once the caller has consumed
    ``out`` (say ``y = layer(out)``), ``ckpt.discard_output_and_register_recompute(y)`` frees ``out``'s storage
    and registers the recompute as a gradient hook of ``y``: when ``y``'s gradient is computed, ``fn`` runs again
    under the forward's RNG states and ``out`` gets its values back (same tensor object), before any backward
    node that saved ``out`` needs them. Inputs must be tensors. ``fp8`` is accepted for megatron-core's
    signature (FP8 recompute contexts are Transformer Engine's)."""

    def __init__(self, fp8=False):
        self.fp8 = bool(fp8)
        self.run_function = None
        self.rng_states = None
        self.ctx = None
        self.outputs = None

    def checkpoint(self, run_function, *args):
        self.run_function = run_function
        self.rng_states = _all_rng_states()
        outputs = CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        self.outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        return outputs

    def _recompute(self, _grad):
        if self.ctx is None:  # already recomputed
            return
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("Checkpointing is not compatible with .grad(), please use .backward() if possible")
        current = _all_rng_states()
        _set_all_rng_states(*self.rng_states)
        try:
            inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in self.ctx.saved_tensors)
            with torch.enable_grad(), _checkpointing():
                outputs = self.run_function(*inputs)
        finally:
            _set_all_rng_states(*current)
        outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        with torch.no_grad():  # give the discarded tensors their storage and values back (same metadata)
            for kept, fresh in zip(self.outputs, outputs):
                kept.untyped_storage().resize_(fresh.untyped_storage().size())
                kept.untyped_storage().copy_(fresh.untyped_storage())
        self.ctx.outputs, self.ctx.inputs = outputs, inputs
        self.run_function = self.rng_states = self.outputs = self.ctx = None

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the output's storage (its shape stays) and recompute it when ``hook_tensor``'s gradient is
        computed."""
        for output in self.outputs:
            output.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)

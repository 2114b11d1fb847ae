"""Model-parallel RNG states and activation recompute (megatron.core.tensor_parallel.random).

Dropout inside tensor-parallel regions (e.g. attention probabilities, which are split by head) must differ
across TP ranks, while dropout on replicated activations must be identical across TP ranks. Megatron keeps
two generator states: the default one (seeded identically on every TP rank) and a named
``'model-parallel-rng'`` state seeded with ``seed + 2718 + tp_rank``, entered with
``get_cuda_rng_tracker().fork()``. The names say "cuda" for compatibility; on a machine without a GPU the
states are those of torch's CPU generator (see megatron.core.device).
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import detach_variable

from megatron.core import device
from megatron.core.parallel_state import get_tensor_model_parallel_rank
from megatron.core.tensor_parallel.utils import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks
from megatron.core.utils import safely_set_viewless_tensor_data

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


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


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _CUDA_RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator with ``seed`` and the tracked TP generator with ``seed + 2718 + tp_rank``.

    Call after model-parallel groups exist. Tensor-parallel regions then draw different random numbers on
    each TP rank, while everything else stays identical across the TP group.
    """
    offset = seed + 2718
    tensor_model_parallel_seed = offset + get_tensor_model_parallel_rank()
    data_parallel_seed = seed
    _CUDA_RNG_STATE_TRACKER.reset()
    device.manual_seed(data_parallel_seed)
    _CUDA_RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_model_parallel_seed)


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

        with torch.no_grad():
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
            with torch.enable_grad():
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

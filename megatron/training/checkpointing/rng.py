"""A rank's RNG states in a checkpoint (both formats store the same object, Megatron's).

``get_rng_state`` returns a list with one dict per data-parallel rank when DP ranks were initialised differently
(``--data-parallel-random-init``), else a list of one dict::

    {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
     "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": <accelerator generator state>,
     "rng_tracker_states": <states of the tensor-parallel RNG tracker>}
"""
from __future__ import annotations

import random

import numpy as np
import torch

from megatron.core import device, parallel_state, tensor_parallel
from megatron.training.checkpointing.protocol import CheckpointError


def get_rng_state(data_parallel_random_init=False):
    """This rank's RNG states (a list over the DP group when DP ranks were initialised differently)."""
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": device.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if data_parallel_random_init and torch.distributed.is_initialized():
        states = [None] * parallel_state.get_data_parallel_world_size()
        torch.distributed.all_gather_object(states, state, group=parallel_state.get_data_parallel_group())
        return states
    return [state]


def set_rng_state(rng_states, data_parallel_random_init, checkpoint_name):
    """Restore this rank's entry of ``rng_states`` (as :func:`get_rng_state` returned it)."""
    if data_parallel_random_init:
        dp_rank = parallel_state.get_data_parallel_rank()
        if dp_rank >= len(rng_states):
            raise CheckpointError(f"{checkpoint_name} holds RNG states for {len(rng_states)} data-parallel ranks "
                                  f"but this run has data-parallel rank {dp_rank}; pass --no-load-rng")
        state = rng_states[dp_rank]
    else:
        state = rng_states[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    device.set_rng_state(state["cuda_rng_state"])
    if not state["rng_tracker_states"]:
        raise CheckpointError(f"the rng_tracker_states of {checkpoint_name} is empty; pass --no-load-rng")
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])

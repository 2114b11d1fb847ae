"""Saving and loading checkpoints in Megatron-LM's ``torch`` layout (megatron.training.checkpointing).

::

    <save>/latest_checkpointed_iteration.txt          "<iteration>" or "release"
    <save>/iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt
    <save>/iter_0000100/mp_rank_TT[_PPP]/distrib_optim.pt   (--use-distributed-optimizer)

The ``_PPP`` suffix appears iff the pipeline size is > 1. Only data-parallel rank 0 of each (TP, PP)
position writes ``model_optim_rng.pt``; global rank 0 updates the tracker after every rank has finished.
Every file is written to a temporary name and renamed into place, so an interrupted save never damages the
previous checkpoint or leaves a half-written file under the final name.
"""
from __future__ import annotations

import os
import random
import sys

import numpy as np
import torch

from megatron.core import device, parallel_state, tensor_parallel
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0, unwrap_model

CHECKPOINT_VERSION = 3.0
_CHECKED_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "add_position_embedding",
                 "max_position_embeddings", "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not match the run; the message names the file."""


def get_checkpoint_tracker_filename(checkpoints_path):
    return os.path.join(checkpoints_path, "latest_checkpointed_iteration.txt")


def get_checkpoint_name(checkpoints_path, iteration, release=False, pipeline_parallel=None, tensor_rank=None,
                        pipeline_rank=None, basename="model_optim_rng.pt"):
    """Path of one rank's checkpoint file."""
    directory = "release" if release else "iter_{:07d}".format(iteration)
    if pipeline_parallel is None:
        pipeline_parallel = parallel_state.get_pipeline_model_parallel_world_size() > 1
    if tensor_rank is None:
        tensor_rank = parallel_state.get_tensor_model_parallel_rank()
    if pipeline_rank is None:
        pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    if pipeline_parallel:
        rank_dir = "mp_rank_{:02d}_{:03d}".format(tensor_rank, pipeline_rank)
    else:
        rank_dir = "mp_rank_{:02d}".format(tensor_rank)
    return os.path.join(checkpoints_path, directory, rank_dir, basename)


def get_distributed_optimizer_checkpoint_name(model_checkpoint_name):
    return os.path.join(os.path.dirname(model_checkpoint_name), "distrib_optim.pt")


def _atomic_torch_save(obj, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp.{}".format(os.getpid())
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_write_text(path, text):
    tmp = path + ".tmp.{}".format(os.getpid())
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metadata(tracker_filename):
    """(iteration, release) from the tracker file; every rank agrees on the maximum."""
    with open(tracker_filename) as f:
        text = f.read().strip()
    release = text == "release"
    if release:
        iteration = 0
    else:
        try:
            iteration = int(text)
        except ValueError:
            raise CheckpointError(f"metadata file {tracker_filename} must hold an iteration number or 'release', "
                                  f"found {text!r}") from None
    if torch.distributed.is_initialized():
        iters = torch.tensor([iteration], dtype=torch.long, device=device.current_device())
        torch.distributed.all_reduce(iters, op=torch.distributed.ReduceOp.MAX)
        max_iter = int(iters.item())
        if max_iter != iteration:
            print("WARNING: on rank {} found iteration {} in the metadata while max iteration across the ranks "
                  "is {}, replacing it with max iteration.".format(torch.distributed.get_rank(), iteration, max_iter),
                  flush=True)
            iteration = max_iter
    return iteration, release


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


def _set_rng_state(rng_states, data_parallel_random_init):
    state = rng_states[parallel_state.get_data_parallel_rank()] if data_parallel_random_init else rng_states[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    device.set_rng_state(state["cuda_rng_state"])
    if not state["rng_tracker_states"]:
        raise CheckpointError("the checkpoint's rng_tracker_states is empty")
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _model_state(chunk):
    if hasattr(chunk, "state_dict_for_save_checkpoint"):
        return chunk.state_dict_for_save_checkpoint()
    return chunk.state_dict()


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far=0):
    """Write this rank's part of checkpoint ``iteration`` under ``--save`` and update the tracker."""
    args = get_args()
    if args.ckpt_format == "torch_dist":
        from megatron.training import dist_checkpointing
        return dist_checkpointing.save(iteration, model, optimizer, opt_param_scheduler,
                                       num_floating_point_operations_so_far)
    model = unwrap_model(model)
    print_rank_0("saving checkpoint at iteration {:7d} to {}".format(iteration, args.save))
    rng_state = None if args.no_save_rng else get_rng_state(args.data_parallel_random_init)
    checkpoint_name = get_checkpoint_name(args.save, iteration)

    if args.use_distributed_optimizer and not args.no_save_optim and optimizer is not None:
        # Collective over the DP group: every DP rank contributes its shard, DP rank 0 writes the file.
        state = optimizer.get_parameter_state()
        if parallel_state.get_data_parallel_rank() == 0:
            _atomic_torch_save(state, get_distributed_optimizer_checkpoint_name(checkpoint_name))

    if parallel_state.get_data_parallel_rank() == 0:
        state_dict = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                      "num_floating_point_operations_so_far": num_floating_point_operations_so_far}
        if len(model) == 1:
            state_dict["model"] = _model_state(model[0])
        else:
            for i, chunk in enumerate(model):
                parallel_state.set_virtual_pipeline_model_parallel_rank(i)
                state_dict["model%d" % i] = _model_state(chunk)
            parallel_state.set_virtual_pipeline_model_parallel_rank(0)
        if not args.no_save_optim:
            if optimizer is not None:
                state_dict["optimizer"] = optimizer.state_dict()
            if opt_param_scheduler is not None:
                state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
        if rng_state is not None:
            state_dict["rng_state"] = rng_state
        _atomic_torch_save(state_dict, checkpoint_name)

    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        _atomic_write_text(get_checkpoint_tracker_filename(args.save), str(iteration))
    print_rank_0("  successfully saved checkpoint at iteration {:7d} to {}".format(iteration, args.save))
    torch.distributed.barrier()


def _missing_rank_file_error(checkpoint_name, load_dir, iteration, release):
    iter_dir = os.path.dirname(os.path.dirname(checkpoint_name))
    present = sorted(os.listdir(iter_dir)) if os.path.isdir(iter_dir) else []
    what = "release" if release else f"iteration {iteration}"
    return CheckpointError(
        f"checkpoint file {checkpoint_name} does not exist ({what} of {load_dir}); the iteration directory holds "
        f"{present or 'nothing'}: the checkpoint was probably saved with a different --tensor-model-parallel-size "
        f"/ --pipeline-model-parallel-size, which this loader cannot reshard"
    )


def check_checkpoint_args(checkpoint_args):
    """The model shape must match the checkpoint's (Megatron's check), with a message naming the flag."""
    args = get_args()
    for name in _CHECKED_ARGS:
        if name in ("max_position_embeddings", "make_vocab_size_divisible_by", "padded_vocab_size",
                    "tokenizer_type") and not getattr(args, "vocab_file", None):
            continue
        ckpt_value, value = getattr(checkpoint_args, name, None), getattr(args, name, None)
        if ckpt_value is not None and ckpt_value != value:
            raise CheckpointError(f"--{name.replace('_', '-')} is {value} but the checkpoint was trained with "
                                  f"{ckpt_value}")


def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg="load", strict=True):
    """Load ``--load`` into model, optimizer, scheduler and RNG; return the iteration to resume from."""
    args = get_args()
    if args.ckpt_format == "torch_dist":
        from megatron.training import dist_checkpointing
        return dist_checkpointing.load(model, optimizer, opt_param_scheduler, load_arg, strict)
    load_dir = getattr(args, load_arg)
    model = unwrap_model(model)
    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        if args.exit_on_missing_checkpoint:
            print_rank_0(">> '--exit-on-missing-checkpoint' set ... exiting. <<")
            sys.exit()
        print_rank_0("WARNING: could not find the metadata file {} ".format(tracker))
        print_rank_0("    will not load any checkpoints and will start from random")
        return 0

    iteration, release = read_metadata(tracker)
    checkpoint_name = get_checkpoint_name(load_dir, iteration, release)
    if not os.path.isfile(checkpoint_name):
        raise _missing_rank_file_error(checkpoint_name, load_dir, iteration, release)
    print_rank_0(" loading checkpoint from {} at iteration {}".format(load_dir, iteration))
    try:
        state_dict = torch.load(checkpoint_name, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - corrupt or truncated file: say which
        raise CheckpointError(f"could not read checkpoint file {checkpoint_name}: {e}") from e

    finetune = args.finetune or release
    if "args" in state_dict and not finetune:
        check_checkpoint_args(state_dict["args"])
        args.consumed_train_samples = getattr(state_dict["args"], "consumed_train_samples", 0)
        args.consumed_valid_samples = getattr(state_dict["args"], "consumed_valid_samples", 0)
    if finetune:
        iteration = 0
    else:
        iteration = state_dict.get("iteration", state_dict.get("total_iters", 0))

    if len(model) == 1:
        model[0].load_state_dict(state_dict["model"], strict=strict)
    else:
        for i, chunk in enumerate(model):
            parallel_state.set_virtual_pipeline_model_parallel_rank(i)
            chunk.load_state_dict(state_dict["model%d" % i], strict=strict)
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)

    if not finetune and not args.no_load_optim:
        if optimizer is not None and "optimizer" in state_dict:
            optimizer.load_state_dict(state_dict["optimizer"])
        if args.use_distributed_optimizer and optimizer is not None:
            optim_name = get_distributed_optimizer_checkpoint_name(checkpoint_name)
            if not os.path.isfile(optim_name):
                raise CheckpointError(f"distributed optimizer state {optim_name} is missing; pass --no-load-optim "
                                      "to start the optimizer from scratch")
            state = torch.load(optim_name, map_location="cpu", weights_only=False) \
                if parallel_state.get_data_parallel_rank() == 0 else None
            optimizer.load_parameter_state(state)
        if opt_param_scheduler is not None and "opt_param_scheduler" in state_dict:
            opt_param_scheduler.load_state_dict(state_dict["opt_param_scheduler"])
    elif optimizer is not None and (args.fp16 or args.bf16):
        optimizer.reload_model_params()

    if not finetune and not args.no_load_rng and "rng_state" in state_dict:
        _set_rng_state(state_dict["rng_state"], args.data_parallel_random_init)

    torch.distributed.barrier()
    print_rank_0("  successfully loaded checkpoint from {} at iteration {}".format(load_dir, iteration))
    return iteration

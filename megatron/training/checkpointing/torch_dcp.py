"""``--ckpt-format torch_dcp``: the plain PyTorch Distributed Checkpoint of an FSDP2 model (``--use-torch-fsdp2``,
TP = PP = 1, as Megatron asserts).

One DCP state dict, flattened by DCP's default planner, in ``<save>/iter_XXXXXXX/`` (``.metadata`` and
``__<rank>_0.distcp`` files; no ``common.pt``, no ``metadata.json``)::

    model.<name>                                  the model's sharded state dict (DTensors: the fp32 main weights)
    optimizer.state.<name>.<exp_avg|exp_avg_sq|step>
    optimizer.param_groups.<i>.<lr|betas|...>     torch.distributed.checkpoint.state_dict's optimizer state dict
    args, iteration, checkpoint_version (3.0), opt_param_scheduler, num_floating_point_operations_so_far
    rng_state.(<pp>, <tp>)                        Megatron's list of RNG state dicts

DCP reshards on load, so a checkpoint loads with any data-parallel size. Saves follow the staged protocol of
megatron.training.checkpointing.protocol (a killed save never replaces the checkpoint the tracker names).
"""
from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from megatron.core import parallel_state
from megatron.training.checkpointing import protocol
from megatron.training.checkpointing.protocol import CheckpointError
from megatron.training.checkpointing.rng import get_rng_state, set_rng_state
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0

CHECKPOINT_VERSION = 3.0


def rng_key() -> str:
    """Megatron's key of a (pipeline, tensor) rank's RNG states in the fsdp_dtensor and torch_dcp formats."""
    return "({}, {})".format(parallel_state.get_pipeline_model_parallel_rank(),
                             parallel_state.get_tensor_model_parallel_rank())


def _chunk(model):
    if len(model) != 1 or not getattr(model[0], "uses_fully_shard", False):
        raise CheckpointError("--ckpt-format torch_dcp stores the model of --use-torch-fsdp2 (one FSDP2-wrapped "
                              "model chunk); use --ckpt-format torch_dist")
    return model[0]


def _state(chunk, optimizer, args, iteration, scheduler, flops, load_optim):
    from megatron.training.checkpointing.dist_state import safe_args

    state = {"model": {k: v for k, v in chunk.state_dict().items() if v is not None},
             "args": safe_args(args), "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
             "num_floating_point_operations_so_far": float(flops), "rng_state": {rng_key(): get_rng_state(False)}}
    if optimizer is not None and load_optim:
        state["optimizer"] = get_optimizer_state_dict(chunk.module, optimizer.optimizer)
        if scheduler is not None:
            state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def save(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far=0):
    """Collective: write checkpoint ``iteration`` under ``--save`` in the torch_dcp format."""
    args = get_args()
    chunk = _chunk(model)
    print_rank_0("saving checkpoint at iteration {:7d} to {} in torch_dcp format".format(iteration, args.save))
    state = _state(chunk, optimizer, args, iteration, opt_param_scheduler, num_floating_point_operations_so_far,
                   load_optim=not args.no_save_optim)
    if args.no_save_rng:
        del state["rng_state"]
    protocol.write_staged(args.save, iteration, lambda staging: dcp.save(
        state, storage_writer=dcp.FileSystemWriter(staging, thread_count=1)))
    print_rank_0("  successfully saved checkpoint at iteration {:7d} to {}".format(iteration, args.save))


def locate_dcp(args, load_arg, optimizer):
    """(directory, its stored DCP keys, finetune, load the optimizer) of the checkpoint ``--load`` (``load_arg``)
    names, or None when there is none (Megatron then trains from scratch)."""
    load_dir = getattr(args, load_arg)
    if not protocol.checkpoint_exists(load_dir) and getattr(args, "ckpt_step", None) is None:
        print_rank_0(f"WARNING: no checkpoint in {load_dir} ({protocol.TRACKER_BASENAME} missing): training from "
                     "random initialization")
        return None
    _, release, directory = protocol.locate(load_dir, getattr(args, "ckpt_step", None))
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise CheckpointError(f"{directory} is not a DCP checkpoint (no .metadata): pass the --ckpt-format it was "
                              "saved in")
    finetune = bool(args.finetune) or release
    stored = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    return directory, stored, finetune, optimizer is not None and not finetune and not args.no_load_optim


def load(model, optimizer, opt_param_scheduler, load_arg="load", strict=True):
    """Collective: load the torch_dcp checkpoint the tracker of ``--load`` names; return its iteration."""
    args = get_args()
    load_dir = getattr(args, load_arg)
    found = locate_dcp(args, load_arg, optimizer)
    if found is None:
        return 0
    directory, stored, finetune, load_optim = found
    chunk = _chunk(model)
    state = _state(chunk, optimizer, args, 0, opt_param_scheduler, 0, load_optim)
    if f"rng_state.{rng_key()}" not in stored or finetune or args.no_load_rng:
        state.pop("rng_state")
    if load_optim and not any(k.startswith("optimizer.") for k in stored):
        raise CheckpointError(f"{directory} was saved without optimizer state (--no-save-optim): pass "
                              "--no-load-optim or --finetune")
    print_rank_0(f" loading checkpoint from {load_dir} at {os.path.basename(directory)} (torch_dcp)")
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    except Exception as e:  # noqa: BLE001 - DCP reports a missing or mismatching key per rank: one line
        raise CheckpointError(f"torch_dcp checkpoint {directory} does not match this model: "
                              f"{' '.join(str(e).split())[:400]}") from e
    if load_optim:
        set_optimizer_state_dict(chunk.module, optimizer.optimizer, state["optimizer"])
        steps = [v["step"] for v in optimizer.optimizer.state.values() if "step" in v]
        optimizer._inner_steps = int(max(float(s) for s in steps)) if steps else 0
        if opt_param_scheduler is not None and "opt_param_scheduler" in state:
            opt_param_scheduler.load_state_dict(state["opt_param_scheduler"])
    if "rng_state" in state:
        set_rng_state(state["rng_state"][rng_key()], False, directory)
    return finish_load(args, state, finetune, load_dir)


def finish_load(args, loaded: dict, finetune: bool, load_dir) -> int:
    """After a DCP load: the run's counters from the checkpoint's (none when fine-tuning), a barrier, the log line;
    returns the iteration to resume from."""
    args.num_floating_point_operations_so_far = 0 if finetune else loaded.get("num_floating_point_operations_so_far", 0)
    iteration = 0 if finetune else int(loaded["iteration"])
    if not finetune and loaded.get("args") is not None:
        args.consumed_train_samples = getattr(loaded["args"], "consumed_train_samples", 0)
        args.consumed_valid_samples = getattr(loaded["args"], "consumed_valid_samples", 0)
    torch.distributed.barrier()
    print_rank_0(f"  successfully loaded checkpoint from {load_dir} at iteration {iteration}")
    return iteration

"""Megatron-LM's ``torch`` checkpoint layout: one file per model-parallel rank.

::

    <save>/latest_checkpointed_iteration.txt          "<iteration>" or "release"
    <save>/iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt
    <save>/iter_0000100/mp_rank_TT[_PPP]/distrib_optim.pt   (--use-distributed-optimizer)

The ``_PPP`` suffix appears iff the pipeline size is > 1. Only data-parallel rank 0 of each (TP, PP)
position writes ``model_optim_rng.pt`` (a ``torch.save`` dict: ``args``, ``checkpoint_version`` 3.0,
``iteration``, ``model`` or ``model0``, ``model1``, ... per virtual pipeline chunk, ``optimizer``,
``opt_param_scheduler``, ``rng_state``, ``num_floating_point_operations_so_far``); with the distributed optimizer
every data-parallel rank contributes its shard of the optimizer state and data-parallel rank 0 writes
``distrib_optim.pt``.

Crash safety: every rank writes its files into a staging directory ``<save>/iter_0000100.incomplete``
(each file to a temporary name, fsync'ed, then renamed). After a barrier, global rank 0 renames the staging
directory to ``iter_0000100`` and only then rewrites the tracker (temporary name, fsync, rename). A process
killed at any point therefore leaves the tracker pointing at the previous, complete checkpoint; re-saving
an iteration that already exists moves the old copy aside (``.old``) until the new one is in place, and the
loader falls back to it if a crash came in between (the steps, and the agreement of all ranks on each, are
megatron.training.checkpointing.protocol's).

A checkpoint in this layout only loads with the tensor/pipeline sizes it was saved with (checked against its
``mp_rank_*`` directories before reading).
"""
from __future__ import annotations

import os
import re
import shutil
import sys

import torch

from megatron.core import parallel_state
from megatron.training.checkpointing import protocol
from megatron.training.checkpointing.protocol import (STAGING_SUFFIX, CheckpointError, agree_on_save_step,
                                                      atomic_torch_save, barrier, check_checkpoint_args,
                                                      iteration_dirname, locate, run_step)
from megatron.training.checkpointing.rerun_state import KEY as RERUN_KEY
from megatron.training.checkpointing.rerun_state import restore_rerun_state
from megatron.training.checkpointing.rng import get_rng_state, set_rng_state
from megatron.training.global_vars import get_args
from megatron.training.utils import is_rank_0, print_rank_0, unwrap_model

CHECKPOINT_VERSION = 3.0
MODEL_BASENAME = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


# ------------------------------------------------------------------------------------------- names

def _rank_dirname(tensor_rank, pipeline_rank, pipeline_parallel, expert_rank=None):
    name = "mp_rank_{:02d}_{:03d}".format(tensor_rank, pipeline_rank) if pipeline_parallel \
        else "mp_rank_{:02d}".format(tensor_rank)
    if expert_rank is not None:  # Megatron's suffix with expert parallelism (EP > 1)
        name += "_{:03d}".format(expert_rank)
    return name


def _expert_rank():
    """This rank's expert-parallel rank when EP > 1 (checkpoint files then differ per EP rank), else None."""
    try:
        if (parallel_state.get_expert_model_parallel_world_size() or 1) > 1:
            return parallel_state.get_expert_model_parallel_rank()
    except AssertionError:
        pass
    return None


def _writes_model_files() -> bool:
    """Data-parallel rank 0 writes its TP x PP files; with EP > 1 every EP rank's copy (expert-DP rank 0)."""
    if _expert_rank() is not None:
        return parallel_state.get_expert_data_parallel_rank() == 0
    return parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0


def get_checkpoint_name(checkpoints_path, iteration, release=False, pipeline_parallel=None, tensor_rank=None,
                        pipeline_rank=None, basename=MODEL_BASENAME, expert_rank=None):
    """Path of one rank's checkpoint file (``expert_rank``: this rank's, when EP > 1 and not given)."""
    if tensor_rank is None and expert_rank is None:
        expert_rank = _expert_rank()
    if pipeline_parallel is None:
        pipeline_parallel = parallel_state.get_pipeline_model_parallel_world_size() > 1
    if tensor_rank is None:
        tensor_rank = parallel_state.get_tensor_model_parallel_rank()
    if pipeline_rank is None:
        pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    return os.path.join(checkpoints_path, iteration_dirname(iteration, release),
                        _rank_dirname(tensor_rank, pipeline_rank, pipeline_parallel, expert_rank), basename)


def get_distributed_optimizer_checkpoint_name(model_checkpoint_name):
    return os.path.join(os.path.dirname(model_checkpoint_name), "distrib_optim.pt")


def find_checkpoint_rank_0(checkpoints_path, iteration, release=False):
    """The rank-0 file of a checkpoint, with or without the pipeline suffix; None if neither exists."""
    for pipeline_parallel in (False, True):
        name = get_checkpoint_name(checkpoints_path, iteration, release, pipeline_parallel, 0, 0)
        if os.path.isfile(name):
            return name
    return None


# --------------------------------------------------------------------------------------------- save

def _model_state(chunk):
    if hasattr(chunk, "state_dict_for_save_checkpoint"):
        return chunk.state_dict_for_save_checkpoint()
    return chunk.state_dict()


def save(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far=0, common=None):
    """Collective: write checkpoint ``iteration`` under ``--save`` in the torch format and update the tracker once
    every rank's files are on disk. ``common``: more entries for every rank file (the rerun state machine's)."""
    args = get_args()
    model = unwrap_model(model)
    print_rank_0("saving checkpoint at iteration {:7d} to {}".format(iteration, args.save))
    rng_state = None if args.no_save_rng else get_rng_state(args.data_parallel_random_init)

    final = os.path.join(args.save, iteration_dirname(iteration))
    staging = final + STAGING_SUFFIX

    def remove_staging():
        shutil.rmtree(staging, ignore_errors=True)

    error = run_step(lambda: protocol.prepare_save_dir(args.save, iteration)) if is_rank_0() else None
    agree_on_save_step(error, args.save, iteration, on_failure=remove_staging)
    checkpoint_name = get_checkpoint_name(args.save, iteration)
    staged_name = os.path.join(staging, os.path.relpath(checkpoint_name, os.path.join(
        args.save, iteration_dirname(iteration))))

    state = None
    if args.use_distributed_optimizer and not args.no_save_optim and optimizer is not None:
        # Collective over the DP group: every DP rank contributes its shard, DP rank 0 writes the file.
        state = optimizer.get_parameter_state()
    error = None
    if _writes_model_files():
        error = run_step(lambda: _write_rank_files(args, iteration, model, optimizer, opt_param_scheduler,
                                                   rng_state, num_floating_point_operations_so_far, staged_name,
                                                   state, common))
    # Every rank has fsync'ed and renamed its files (or failed) once this returns.
    agree_on_save_step(error, args.save, iteration, on_failure=remove_staging)
    error = None
    if is_rank_0():
        protocol.save_stage("all-files-written", staging)
        error = run_step(lambda: protocol.publish(args.save, final, staging, iteration))
    agree_on_save_step(error, args.save, iteration, on_failure=remove_staging)
    print_rank_0("  successfully saved checkpoint at iteration {:7d} to {}".format(iteration, args.save))


def _write_rank_files(args, iteration, model, optimizer, opt_param_scheduler, rng_state,
                      num_floating_point_operations_so_far, staged_name, optim_state, common=None):
    """Data-parallel rank 0 of each (TP, PP) position: write its files into the staging directory."""
    if optim_state is not None:
        atomic_torch_save(optim_state, get_distributed_optimizer_checkpoint_name(staged_name))
    state_dict = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
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
    state_dict["num_floating_point_operations_so_far"] = float(num_floating_point_operations_so_far)
    state_dict.update({k: v for k, v in (common or {}).items() if v is not None})
    atomic_torch_save(state_dict, staged_name)



# --------------------------------------------------------------------------------------------- load

def saved_layout(iter_dir):
    """(tensor, pipeline) model parallel sizes a torch-format checkpoint was saved with, from its rank
    directories; None when the directory holds none."""
    # With expert parallelism (EP > 1) Megatron appends the EP rank: mp_rank_TT_EEE or mp_rank_TT_PPP_EEE, so a
    # two-number name is read as (TP, EP) when this run has EP > 1 and no pipeline.
    expert_suffix = _expert_rank() is not None
    pipeline = expert_suffix and parallel_state.get_pipeline_model_parallel_world_size() > 1
    tp, pp, found = 0, 0, False
    for name in os.listdir(iter_dir):
        m = _RANK_DIR.match(name)
        if m:
            found = True
            tp = max(tp, int(m.group(1)) + 1)
            second_is_pp = m.group(2) is not None and (m.group(3) is not None or not expert_suffix or pipeline)
            pp = max(pp, int(m.group(2)) + 1 if second_is_pp else 1)
    return (tp, pp) if found else None


def _check_layout(iter_dir, checkpoint_name):
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    saved = saved_layout(iter_dir)
    if saved is None:
        raise CheckpointError(f"checkpoint file {checkpoint_name} does not exist: {iter_dir} holds no mp_rank_* "
                              f"directory (is it a --ckpt-format torch checkpoint?)")
    if saved != (tp, pp):
        raise CheckpointError(
            f"checkpoint {iter_dir} was saved with tensor/pipeline model parallel sizes (TP={saved[0]}, "
            f"PP={saved[1]}) but this run uses (TP={tp}, PP={pp}), so its mp_rank_*/{MODEL_BASENAME} files do not "
            f"match this run's ranks. A --ckpt-format torch checkpoint only loads "
            f"with the layout it was saved with: convert it with tools/checkpoint/convert.py "
            f"--target-tensor-parallel-size {tp} --target-pipeline-parallel-size {pp}, or save with --ckpt-format "
            f"torch_dist, which reshards on load", same_on_every_rank=True)
    if not os.path.isfile(checkpoint_name):
        raise CheckpointError(f"checkpoint file {checkpoint_name} is missing (the save that wrote {iter_dir} "
                              f"did not complete, or the file was removed)")


def read_checkpoint_file(checkpoint_name):
    try:
        return torch.load(checkpoint_name, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - corrupt or truncated file: say which
        raise CheckpointError(f"could not read checkpoint file {checkpoint_name} (corrupt or truncated?): "
                              f"{type(e).__name__}: {e}") from e


def _load_model(model, state_dict, checkpoint_name, strict):
    keys = ["model"] if len(model) == 1 else ["model%d" % i for i in range(len(model))]
    missing = [k for k in keys if k not in state_dict]
    if missing:
        raise CheckpointError(f"{checkpoint_name} has no {missing} entry (it holds {sorted(state_dict)}): it was saved "
                              f"with a different --num-layers-per-virtual-pipeline-stage")
    for i, (chunk, key) in enumerate(zip(model, keys)):
        if len(model) > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(i)
        try:
            chunk.load_state_dict(state_dict[key], strict=strict)
        except RuntimeError as e:
            raise CheckpointError(f"the model in {checkpoint_name} ['{key}'] does not fit this model: {e}") from e
    if len(model) > 1:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)


def load(model, optimizer, opt_param_scheduler, load_arg="load", strict=True):
    """Load a torch-format ``--load`` (or ``--pretrained-checkpoint`` when ``--load`` has none) into model,
    optimizer, scheduler and RNG; set ``args.num_floating_point_operations_so_far``; return the iteration."""
    args = get_args()
    load_dir = getattr(args, load_arg)
    model = unwrap_model(model)
    finetune = bool(args.finetune)
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if not protocol.checkpoint_exists(load_dir) and pretrained is not None \
            and getattr(args, "ckpt_step", None) is None:
        print_rank_0(f" no checkpoint in --load {load_dir}: loading --pretrained-checkpoint {pretrained} "
                     "(as with --finetune)")
        load_dir, finetune = pretrained, True
        if not protocol.checkpoint_exists(load_dir):
            raise CheckpointError(f"--pretrained-checkpoint {load_dir} holds no checkpoint "
                                  f"({protocol.get_checkpoint_tracker_filename(load_dir)} does not exist)")
    if load_dir is None or (not protocol.checkpoint_exists(load_dir) and getattr(args, "ckpt_step", None) is None):
        if args.exit_on_missing_checkpoint:
            print_rank_0(">> '--exit-on-missing-checkpoint' set ... exiting. <<")
            barrier()
            sys.exit()
        print_rank_0("WARNING: could not find the metadata file {} ".format(
            protocol.get_checkpoint_tracker_filename(load_dir) if load_dir else None))
        print_rank_0("    will not load any checkpoints and will start from random")
        return 0

    ckpt_step = args.ckpt_step if load_dir == getattr(args, load_arg) else None  # not for --pretrained-checkpoint
    iteration, release, iter_dir = locate(load_dir, ckpt_step)
    rank_file = get_checkpoint_name(load_dir, iteration, release)
    checkpoint_name = os.path.join(iter_dir, os.path.basename(os.path.dirname(rank_file)), MODEL_BASENAME)
    _check_layout(iter_dir, checkpoint_name)
    print_rank_0(" loading checkpoint from {} at iteration {}".format(load_dir, iteration))
    state_dict = read_checkpoint_file(checkpoint_name)

    finetune = finetune or release
    if "args" in state_dict and not finetune:
        check_checkpoint_args(state_dict["args"], iter_dir)
        args.consumed_train_samples = getattr(state_dict["args"], "consumed_train_samples", 0)
        args.consumed_valid_samples = getattr(state_dict["args"], "consumed_valid_samples", 0)
    if finetune:
        iteration = 0
        args.num_floating_point_operations_so_far = 0
    else:
        iteration = state_dict.get("iteration", state_dict.get("total_iters", 0))
        args.num_floating_point_operations_so_far = state_dict.get("num_floating_point_operations_so_far", 0)

    _load_model(model, state_dict, checkpoint_name, strict)

    if not finetune and not args.no_load_optim:
        if optimizer is not None:
            if "optimizer" not in state_dict:
                raise CheckpointError(f"{checkpoint_name} holds no optimizer state (saved with --no-save-optim?); "
                                      "pass --no-load-optim or --finetune")
            optimizer.load_state_dict(state_dict["optimizer"])
        if args.use_distributed_optimizer and optimizer is not None:
            optim_name = get_distributed_optimizer_checkpoint_name(checkpoint_name)
            if not os.path.isfile(optim_name):
                raise CheckpointError(f"distributed optimizer state {optim_name} is missing; pass --no-load-optim "
                                      "to start the optimizer from scratch")
            state = read_checkpoint_file(optim_name) if optimizer.is_parameter_state_root() else None
            optimizer.load_parameter_state(state)
        scheduler_state = state_dict.get("opt_param_scheduler", state_dict.get("lr_scheduler"))
        if opt_param_scheduler is not None and scheduler_state is not None:
            opt_param_scheduler.load_state_dict(scheduler_state)
    elif optimizer is not None and (args.fp16 or args.bf16):
        optimizer.reload_model_params()  # the fp32 main copies must follow the loaded weights

    if not finetune and not args.no_load_rng:
        if "rng_state" not in state_dict:
            raise CheckpointError(f"{checkpoint_name} holds no RNG state (saved with --no-save-rng?); pass "
                                  "--no-load-rng or --finetune")
        set_rng_state(state_dict["rng_state"], args.data_parallel_random_init, checkpoint_name)
    if not finetune:
        restore_rerun_state(state_dict.get(RERUN_KEY), checkpoint_name)

    barrier()
    print_rank_0("  successfully loaded checkpoint from {} at iteration {}".format(load_dir, iteration))
    return iteration

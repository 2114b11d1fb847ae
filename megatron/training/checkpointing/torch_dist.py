"""``--ckpt-format torch_dist``: Megatron-LM's distributed checkpoint (PyTorch DCP), reshardable on load.

::

    <save>/latest_checkpointed_iteration.txt
    <save>/iter_0000100/common.pt            rank 0: args, checkpoint_version 3.0, iteration, opt_param_scheduler,
                                             num_floating_point_operations_so_far, content_metadata, optimizer
                                             hyper-parameters
    <save>/iter_0000100/.metadata            DCP: every tensor's global shape and stored chunks
    <save>/iter_0000100/__<rank>_0.distcp    DCP data
    <save>/iter_0000100/metadata.json        {"sharded_backend": "torch_dist", ...}: written last = complete

Model tensors use Megatron-LM's keys and layer stacking (megatron.training.checkpointing.dist_keys). Optimizer
state, per model tensor with the same sharding: ``optimizer.state.{exp_avg,exp_avg_sq}.<key>`` plus the fp32 master
copy ``optimizer.state.fp32_param.<key>`` (mixed precision) for the plain optimizer; the distributed optimizer uses
Megatron's ``fully_reshardable`` form ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`` (each parameter's
pieces gathered over the data-parallel group); both are built in megatron.training.checkpointing.dist_state. RNG
states are the objects ``rng_state/shard_{pp}.{tp}_{PP}.{TP}`` (a list of one dict with Megatron's keys), restored
only when TP and PP are unchanged. ``args`` in common.pt holds only values Megatron's ``weights_only`` loader
accepts. Saves are staged in ``iter_0000100.incomplete`` and published by renames exactly as in the torch format
(megatron.training.checkpointing.protocol), so a killed or failed save never touches the checkpoint the tracker
names. ``--async-save`` writes in a background thread on a separate gloo group; the save is finished before the
next save, a load, or the end of ``pretrain``. ``--dist-ckpt-strictness`` and the checks of the shard files before
a read are megatron.training.checkpointing.dist_strictness's.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import sys
import threading
from typing import Dict, List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.sharded_io import (LocalShard, ShardingError, load_full_state_dict,
                                                         load_sharded, save_sharded)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.training.checkpointing import dist_keys, protocol
from megatron.training.checkpointing.dist_state import (CHECKPOINT_VERSION, METADATA, DistCheckpointError,
                                                        apply_loaded_model, load_optimizer_state, model_entries,
                                                        model_layout, model_sharded_state, optimizer_common,
                                                        optimizer_request, optimizer_tensors, read_common, safe_args,
                                                        tp_size_rank)
from megatron.training.checkpointing.dist_strictness import check_request, read_metadata_checked
from megatron.training.checkpointing.protocol import agree_on_save_step, check_checkpoint_args, run_step
from megatron.training.checkpointing.rerun_state import KEY as RERUN_KEY
from megatron.training.checkpointing.rerun_state import restore_rerun_state
from megatron.training.checkpointing.rng import get_rng_state, set_rng_state
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0, unwrap_model

__all__ = ["CHECKPOINT_VERSION", "METADATA", "DistCheckpointError", "apply_loaded_model", "checkpoint_dir",
           "finalize_async_save", "load", "load_full_checkpoint", "load_sharded_checked", "model_entries",
           "model_layout", "model_sharded_state", "read_common", "safe_args", "save"]


def checkpoint_dir(path, iteration):
    return os.path.join(path, protocol.iteration_dirname(iteration))


# ------------------------------------------------------------------------------------------------ save
_pending: Optional[threading.Thread] = None
_pending_error: List[BaseException] = []
_async_group = None


def finalize_async_save():
    """Wait for a background save to finish (no-op when none is running); re-raise its error."""
    global _pending
    if _pending is not None:
        _pending.join()
        _pending = None
        if _pending_error:
            error = _pending_error.pop()
            # Every rank's thread raised the same agreed error (a full disk on one rank): an orderly stop.
            raise DistCheckpointError(f"the asynchronous checkpoint save failed: {error}",
                                      same_on_every_rank=getattr(error, "same_on_every_rank", False)) from error


def _write(sharded, common_bytes, directory, save_dir, iteration, group):
    """Every rank: write into ``<directory>.incomplete``; global rank 0 then renames it to ``directory`` and only
    then rewrites the tracker (the staged, crash-safe protocol of megatron.training.checkpointing.protocol). After
    each step the ranks agree on success, so a rank that fails (a full disk) makes every rank raise the same error
    instead of hanging."""
    rank0 = torch.distributed.get_rank() == 0
    staging = directory + protocol.STAGING_SUFFIX

    def remove_staging():
        shutil.rmtree(staging, ignore_errors=True)

    def agree(error):
        agree_on_save_step(error, save_dir, iteration, group=group, on_failure=remove_staging)

    def prepare():
        protocol.prepare_save_dir(save_dir, iteration)
        protocol.atomic_write_bytes(os.path.join(staging, "common.pt"), common_bytes)

    agree(run_step(prepare) if rank0 else None)
    # DCP gathers every rank's write result, so a failed write raises on every rank; agree() rewords it.
    agree(run_step(lambda: save_sharded(sharded, staging, process_group=group)))
    error = None
    if rank0:
        def publish():
            protocol.atomic_write_bytes(os.path.join(staging, "metadata.json"), json.dumps(METADATA).encode())
            protocol.save_stage("all-files-written", staging)
            protocol.publish(save_dir, directory, staging, iteration)
        error = run_step(publish)
    agree(error)


def _rng_key():
    return dist_keys.rng_key(parallel_state.get_pipeline_model_parallel_rank(),
                             parallel_state.get_tensor_model_parallel_rank(),
                             parallel_state.get_pipeline_model_parallel_world_size(),
                             parallel_state.get_tensor_model_parallel_world_size())


def save(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far=0, extra_common=None):
    """Collective: write checkpoint ``iteration`` under ``--save`` in the torch_dist format. ``extra_common``: more
    entries for ``common.pt`` (the rerun state machine's)."""
    global _pending, _async_group
    args = get_args()
    finalize_async_save()
    model = unwrap_model(model)
    print_rank_0("saving checkpoint at iteration {:7d} to {} in torch_dist format".format(iteration, args.save))
    sharded = model_sharded_state(model, args)
    content = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    common = {"args": safe_args(args), "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
              "num_floating_point_operations_so_far": float(num_floating_point_operations_so_far)}
    if not args.no_save_optim:
        if optimizer is not None:
            entries = model_entries(model, args)
            tp, tp_rank = tp_size_rank()
            for chunk, chunk_entries in zip(model, entries):
                num_layers, gated, _ = model_layout(chunk, args)
                for kind, tensors in optimizer_tensors(optimizer, chunk_entries).items():
                    for e, tensor in tensors:
                        pieces = dist_keys.shards(e, num_layers, tp, tp_rank, gated, tensor)
                        sharded.setdefault(f"optimizer.state.{kind}.{e.key}", []).extend(pieces)
            common["optimizer"] = optimizer_common(optimizer)
            if isinstance(optimizer, DistributedOptimizer):
                content.update(distrib_optim_sharding_type="fully_reshardable",
                               distrib_optim_fully_reshardable_mem_efficient=False)
        if opt_param_scheduler is not None:
            common["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    common["content_metadata"] = content
    common.update({k: v for k, v in (extra_common or {}).items() if v is not None})
    if not args.no_save_rng and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0:
        sharded[_rng_key()] = [get_rng_state(False)]  # Megatron's object payload: the list of local objects
    buffer = io.BytesIO()
    torch.save(common, buffer)  # pickled now: args (consumed samples ...) keep changing while an async save runs
    directory = checkpoint_dir(args.save, iteration)

    if getattr(args, "async_save", False):
        if _async_group is None:
            _async_group = torch.distributed.new_group(backend="gloo")  # collectives off the training groups

        def snap(v):  # training updates the parameters in place while the thread writes
            if isinstance(v, LocalShard):
                return LocalShard(v.data.clone(), v.global_shape, v.global_offset)
            if isinstance(v, list) and v and isinstance(v[0], LocalShard):
                return [snap(x) for x in v]
            return v
        snapshot = {k: snap(v) for k, v in sharded.items()}

        def run():
            try:
                _write(snapshot, buffer.getvalue(), directory, args.save, iteration, _async_group)
            except BaseException as e:  # noqa: BLE001 - reported by finalize_async_save
                _pending_error.append(e)

        _pending = threading.Thread(target=run, name=f"async-save-{iteration}", daemon=False)
        _pending.start()
        print_rank_0("  scheduled asynchronous save of iteration {:7d} to {}".format(iteration, args.save))
        return
    _write(sharded, buffer.getvalue(), directory, args.save, iteration, None)
    print_rank_0("  successfully saved checkpoint at iteration {:7d} to {}".format(iteration, args.save))


# ------------------------------------------------------------------------------------------------ load
def _read_tracker(load_dir, args):
    step = getattr(args, "ckpt_step", None)
    if step is not None:
        return int(step)
    tracker = protocol.get_checkpoint_tracker_filename(load_dir)
    with open(tracker) as f:
        text = f.read().strip()
    if text == "release":
        return "release"
    try:
        return int(text)
    except ValueError:
        raise DistCheckpointError(f"{tracker} must hold an iteration number or 'release', found "
                                  f"{text!r}") from None


def load_sharded_checked(request, directory, strictness="assume_ok_unexpected", shape_mismatch=()):
    """Collective: read ``request`` from ``directory`` after the strictness checks; one-line errors that name the
    directory and the key."""
    stored = read_metadata_checked(directory, DistCheckpointError)
    for k in [k for k in request if "._extra_state/" in k and k not in stored]:
        del request[k]  # an empty object (no FP8 metadata) that an older writer left out
    # Norms a megatron-core local spec stored under its module names (q_layernorm ...) are read from there.
    aliases = {k: dist_keys.stored_alias(k, stored) for k in request if k not in stored}
    aliases = {mine: theirs for mine, theirs in aliases.items() if theirs is not None}
    for mine, theirs in aliases.items():
        request[theirs] = request.pop(mine)
    check_request(request, stored, directory, strictness, DistCheckpointError)
    try:
        load_sharded(request, directory, allow_shape_mismatch=shape_mismatch)
    except ShardingError as e:
        raise DistCheckpointError(f"torch_dist checkpoint {directory}: {e}") from e
    for mine, theirs in aliases.items():
        request[mine] = request.pop(theirs)
    return request


def load(model, optimizer, opt_param_scheduler, load_arg="load", strict=True):
    """Collective: load a torch_dist checkpoint (ours or Megatron-LM's) saved with any TP/PP/DP layout; return the
    iteration."""
    args = get_args()
    finalize_async_save()
    load_dir = getattr(args, load_arg)
    model = unwrap_model(model)
    tracker = protocol.get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker) and getattr(args, "ckpt_step", None) is None:
        if args.exit_on_missing_checkpoint:
            print_rank_0(">> '--exit-on-missing-checkpoint' set ... exiting. <<")
            sys.exit()
        print_rank_0("WARNING: could not find the metadata file {} ".format(tracker))
        print_rank_0("    will not load any checkpoints and will start from random")
        return 0
    iteration = _read_tracker(load_dir, args)
    release = iteration == "release"
    directory = os.path.join(load_dir, "release") if release else checkpoint_dir(load_dir, iteration)
    if not os.path.isdir(directory) and os.path.isdir(directory + protocol.ASIDE_SUFFIX):
        directory += ".old"  # a re-save of this iteration was interrupted between its two renames
    if not os.path.isfile(os.path.join(directory, "metadata.json")):
        legacy = os.path.isdir(directory) and any(n.startswith("mp_rank_") for n in os.listdir(directory))
        raise DistCheckpointError(
            f"{directory} is not a complete torch_dist checkpoint (no metadata.json)"
            + ("; it holds mp_rank_* directories: load it with --ckpt-format torch" if legacy else ""))
    print_rank_0(" loading checkpoint from {} at iteration {} (torch_dist)".format(load_dir, iteration))
    common = read_common(directory)
    stored = read_metadata_checked(directory, DistCheckpointError)
    if any(k.startswith("model.") for k in stored) and not any(k.startswith(("embedding.", "decoder.", "encoder."))
                                                              for k in stored):
        raise DistCheckpointError(f"{directory} uses the pre-Megatron key layout of older versions of this library "
                                  "(model.<name> keys), which is no longer read: re-create it with --ckpt-format torch")
    finetune = bool(args.finetune) or release
    load_optim = optimizer is not None and not finetune and not args.no_load_optim
    ckpt_args = common.get("args")
    tp, pp = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size()
    saved_tp_pp = (getattr(ckpt_args, "tensor_model_parallel_size", 1), getattr(ckpt_args, "pipeline_model_parallel_size", 1))
    if not finetune and ckpt_args is not None:
        # torch_dist reshards on load and absorbs vocabulary padding, so the padded vocabulary may differ.
        check_checkpoint_args(ckpt_args, directory, skip=("padded_vocab_size",))
    strictness = getattr(args, "dist_ckpt_strictness", "assume_ok_unexpected")
    request = model_sharded_state(model, args, for_load=True)
    absent_fp8 = [k for k in request if ".fp8_meta." in k and k not in stored]
    if absent_fp8:  # a checkpoint saved without FP8: the FP8 layers start their scaling state afresh
        print_rank_0(f"  the checkpoint holds no FP8 scaling state ({len(absent_fp8)} keys): scales start at 1")
        for k in absent_fp8:
            del request[k]
    entries = model_entries(model, args)
    main_kind = None
    if load_optim:
        if "optimizer" not in common:
            raise DistCheckpointError(f"{directory} was saved without optimizer state (--no-save-optim): pass "
                                      "--no-load-optim or --finetune")
        optim_request, main_kind, _ = optimizer_request(optimizer, model, entries, args, stored, directory)
        request.update(optim_request)
    rng = _rng_key()
    load_rng = not finetune and not args.no_load_rng and saved_tp_pp == (tp, pp) \
        and not getattr(ckpt_args, "no_save_rng", False)
    if load_rng:
        if rng not in stored:
            raise DistCheckpointError(f"torch_dist checkpoint {directory} holds no RNG state {rng!r}: pass "
                                      "--no-load-rng")
        request[rng] = None
    elif not finetune and not args.no_load_rng:
        print_rank_0(f"  the checkpoint was saved with (TP, PP) = {saved_tp_pp}, this run uses {(tp, pp)}: RNG "
                     "state will be ignored")
    mismatch = [k for k in request if k.endswith(dist_keys.VOCAB_KEYS)]  # vocab padding depends on TP
    load_sharded_checked(request, directory, strictness, mismatch)
    apply_loaded_model(model, request, args, strict=strict)

    args.num_floating_point_operations_so_far = 0 if finetune else common.get("num_floating_point_operations_so_far", 0)
    if not finetune:
        iteration = common.get("iteration", iteration)
        if ckpt_args is not None:
            args.consumed_train_samples = getattr(ckpt_args, "consumed_train_samples", 0)
            args.consumed_valid_samples = getattr(ckpt_args, "consumed_valid_samples", 0)
    else:
        iteration = 0
    if load_optim:
        load_optimizer_state(optimizer, model, entries, request, common["optimizer"], main_kind, args)
        if opt_param_scheduler is not None and "opt_param_scheduler" in common:
            opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    elif optimizer is not None:
        optimizer.reload_model_params()
    if load_rng:
        set_rng_state(request[rng][0], False, directory)
    if not finetune:
        restore_rerun_state(common.get(RERUN_KEY), directory)
    torch.distributed.barrier()
    print_rank_0("  successfully loaded checkpoint from {} at iteration {}".format(load_dir, iteration))
    return iteration


def load_full_checkpoint(directory: str) -> Dict[str, object]:
    """Offline, in one process: ``{'model': {key: full tensor}, 'optimizer_state': {kind: {key: tensor}},
    'rng_state': {key: [state]}, **common.pt}`` of one ``iter_XXXXXXX`` directory, with Megatron's on-disk keys
    (layer tensors stacked ``[L, ...]``; ``_extra_state`` objects left out)."""
    common = read_common(directory)
    read_metadata_checked(directory, DistCheckpointError)
    flat = load_full_state_dict(directory)
    out = dict(common)
    out["model"], out["optimizer_state"], out["rng_state"] = {}, {}, {}
    for key, value in flat.items():
        if key.startswith("optimizer.state."):
            kind, name = key[len("optimizer.state."):].split(".", 1)
            out["optimizer_state"].setdefault(kind, {})[name] = value
        elif key.startswith("rng_state/"):
            out["rng_state"][key] = value
        elif "/shard_" not in key and torch.is_tensor(value):
            out["model"][key] = value
    return out

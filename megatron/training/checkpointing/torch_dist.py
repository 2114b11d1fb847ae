"""``--ckpt-format torch_dist``: Megatron-LM's distributed checkpoint (PyTorch DCP), reshardable on load.

::

    <save>/latest_checkpointed_iteration.txt
    <save>/iter_0000100/common.pt            rank 0: args, checkpoint_version 3.0, iteration, opt_param_scheduler,
                                             num_floating_point_operations_so_far, content_metadata, optimizer
                                             hyper-parameters
    <save>/iter_0000100/.metadata            DCP: every tensor's global shape and stored chunks
    <save>/iter_0000100/__<rank>_0.distcp    DCP data
    <save>/iter_0000100/metadata.json        {"sharded_backend": "torch_dist", ...}: written last = complete

Built on megatron.core.dist_checkpointing: the model tensors are what each module declares
(``model.sharded_state_dict()``: Megatron-LM's keys, layer stacking, TP / expert sharding, replicas), the
optimizer state has the same sharding under ``optimizer.state.{exp_avg,exp_avg_sq}.<key>`` plus the fp32 master copy
``optimizer.state.fp32_param.<key>`` (mixed precision) for the plain optimizer; the distributed optimizer uses
Megatron's ``fully_reshardable`` form ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`` (each parameter's pieces
gathered over the data-parallel group); both are built in megatron.training.checkpointing.dist_state. RNG states
are the objects ``rng_state/shard_{pp}.{tp}_{PP}.{TP}`` (a list of one dict with Megatron's keys), restored only when
TP and PP are unchanged. ``args`` in common.pt holds only values Megatron's ``weights_only`` loader accepts. The
format takes explicit inputs (:func:`save_to` / :func:`load_from`: directory, :class:`TrainState`, options);
:func:`save` / :func:`load` read them from the global args for the training loop. Saves are staged in
``iter_0000100.incomplete`` and published by renames exactly as in the torch format
(megatron.training.checkpointing.protocol), so a killed or failed save never touches the checkpoint the tracker
names. ``--async-save`` writes in the background (megatron.core's ``AsyncCallsQueue``) on a separate gloo group;
the save is finished before the next save, a load, or the end of ``pretrain``. ``--dist-ckpt-strictness`` and the
checks of the shard files before a read are megatron.training.checkpointing.dist_strictness's.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import sys
from typing import Dict, Optional

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, apply_factory_merges
from megatron.core.dist_checkpointing.sharded_io import ShardingError, load_full_state_dict, load_sharded, save_sharded
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess, save_preprocess
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from megatron.core.dist_checkpointing.strategies.common import common_bytes
from megatron.core.dist_checkpointing.strategies.torch import StorageRequest, async_process_group, to_storage
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.training.checkpointing import dist_fsdp, protocol
from megatron.training.checkpointing.dist_state import (CHECKPOINT_VERSION, METADATA, DistCheckpointError,
                                                        _drop_unread, apply_loaded_model, load_optimizer_state,
                                                        model_params, model_sharded_state, model_sharded_state_dicts,
                                                        optimizer_common, optimizer_load_kinds,
                                                        optimizer_request_tensors, optimizer_sharded_state,
                                                        optimizer_tensors, param_of_paths, read_common, safe_args)
from megatron.training.checkpointing.dist_strictness import check_request, read_metadata_checked
from megatron.training.checkpointing.protocol import agree_on_save_step, check_checkpoint_args, run_step
from megatron.training.checkpointing.rerun_state import KEY as RERUN_KEY
from megatron.training.checkpointing.rerun_state import restore_rerun_state
from megatron.training.checkpointing.rng import get_rng_state, set_rng_state
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0, unwrap_model

__all__ = ["CHECKPOINT_VERSION", "METADATA", "DistCheckpointError", "apply_loaded_model", "checkpoint_dir",
           "finalize_async_save", "load", "load_full_checkpoint", "load_sharded_checked", "model_sharded_state",
           "read_common", "safe_args", "save"]


def checkpoint_dir(path, iteration):
    return os.path.join(path, protocol.iteration_dirname(iteration))


def _unwrapped(model):
    """The model chunks whose ``sharded_state_dict`` describes the checkpoint: the modules inside the DDP / mixed
    precision wrappers; an FSDP2-sharded chunk keeps its wrapper, which cuts the declared tensors to this rank's
    shards (megatron.training.checkpointing.dist_fsdp)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [chunk if getattr(chunk, "uses_fully_shard", False) else unwrap_model(chunk) for chunk in chunks]


# ------------------------------------------------------------------------------------------------ inputs
@dataclasses.dataclass
class TrainState:
    """The training progress a checkpoint records (``args`` fields of the same names in the training loop)."""

    iteration: int = 0
    consumed_train_samples: Optional[int] = 0
    consumed_valid_samples: Optional[int] = 0
    num_floating_point_operations_so_far: float = 0.0


@dataclasses.dataclass
class SaveOptions:
    """How to save: ``args`` is the namespace stored in ``common.pt`` (made weights_only-safe), the flags say what
    is saved and whether the write runs in the background."""

    args: object = None
    save_optim: bool = True
    save_rng: bool = True
    async_save: bool = False
    extra_common: Optional[dict] = None  # more entries for common.pt (the rerun state machine's); None values skipped


@dataclasses.dataclass
class LoadOptions:
    """How to load: ``finetune`` restarts the iteration count and skips optimizer and RNG state; ``strictness``
    is ``--dist-ckpt-strictness``; ``ckpt_step`` picks an iteration instead of the tracker's."""

    load_optim: bool = True
    load_rng: bool = True
    finetune: bool = False
    strictness: str = "assume_ok_unexpected"
    ckpt_step: Optional[int] = None
    exit_on_missing_checkpoint: bool = False
    strict: bool = True


# ------------------------------------------------------------------------------------------------ save
_ASYNC_SAVES = AsyncCallsQueue()  # this process's background saves, finalized in order


def finalize_async_save():
    """Wait for the background saves to finish (no-op when none is running); re-raise a failure."""
    try:
        _ASYNC_SAVES.maybe_finalize_async_calls(blocking=True)
    except BaseException as error:  # noqa: BLE001 - reported as one checkpoint error
        # Every rank's thread raised the same agreed error (a full disk on one rank): an orderly stop.
        raise DistCheckpointError(f"the asynchronous checkpoint save failed: {error}",
                                  same_on_every_rank=getattr(error, "same_on_every_rank", False)) from error


def _write(storage, common, directory, save_dir, iteration, group):
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
        protocol.atomic_write_bytes(os.path.join(staging, "common.pt"), common)

    agree(run_step(prepare) if rank0 else None)
    # DCP gathers every rank's write result, so a failed write raises on every rank; agree() rewords it.
    agree(run_step(lambda: save_sharded(storage, staging, process_group=group)))
    error = None
    if rank0:
        def publish():
            protocol.atomic_write_bytes(os.path.join(staging, "metadata.json"), json.dumps(METADATA).encode())
            protocol.save_stage("all-files-written", staging)
            protocol.publish(save_dir, directory, staging, iteration)
        error = run_step(publish)
    agree(error)


def _rng_object(data=None) -> ShardedObject:
    """Megatron-LM's ``rng_state`` object: one piece per (PP, TP) rank, replicated over DP."""
    return ShardedObject("rng_state", data,
                         (parallel_state.get_pipeline_model_parallel_world_size(),
                          parallel_state.get_tensor_model_parallel_world_size()),
                         (parallel_state.get_pipeline_model_parallel_rank(),
                          parallel_state.get_tensor_model_parallel_rank()),
                         replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))


def build_save_state(train_state: TrainState, model, optimizer, opt_param_scheduler, options: SaveOptions):
    """The state dict a torch_dist save writes: the common values, the model chunks' ``sharded_state_dict``, the
    optimizer state with the model's sharding, the RNG object."""
    state = {"args": safe_args(options.args) if options.args is not None else None,
             "checkpoint_version": CHECKPOINT_VERSION, "iteration": train_state.iteration,
             "num_floating_point_operations_so_far": float(train_state.num_floating_point_operations_so_far)}
    content = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    model_sd = model_sharded_state_dicts(model)
    if options.save_optim:
        if optimizer is not None and dist_fsdp.is_fully_sharded(model):
            state["optimizer_state"] = dist_fsdp.optimizer_sharded_state(
                model, optimizer, dist_fsdp.save_kinds(model, optimizer))
            state["optimizer"] = optimizer_common(optimizer)
        elif optimizer is not None:
            tensors = optimizer_tensors(optimizer, model_params(model_sd))
            state["optimizer_state"] = optimizer_sharded_state(model_sd, tensors)
            state["optimizer"] = optimizer_common(optimizer)
            if isinstance(optimizer, DistributedOptimizer):
                content.update(distrib_optim_sharding_type="fully_reshardable",
                               distrib_optim_fully_reshardable_mem_efficient=False)
        if opt_param_scheduler is not None:
            state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    state["content_metadata"] = content
    state.update({k: v for k, v in (options.extra_common or {}).items() if v is not None})
    state.update(model_sd)
    if options.save_rng:
        state["rng_state"] = _rng_object(get_rng_state(False))
    return state


def save_to(save_dir, train_state: TrainState, model, optimizer, opt_param_scheduler, options: SaveOptions):
    """Collective: write checkpoint ``train_state.iteration`` under ``save_dir`` in the torch_dist format; with
    ``options.async_save`` the write runs in the background (:func:`finalize_async_save` waits for it)."""
    finalize_async_save()
    model = _unwrapped(model)
    iteration = train_state.iteration
    print_rank_0("saving checkpoint at iteration {:7d} to {} in torch_dist format".format(iteration, save_dir))
    state = build_save_state(train_state, model, optimizer, opt_param_scheduler, options)
    sharded, common = save_preprocess(state, validate_access_integrity=True)
    storage = to_storage(sharded, snapshot=options.async_save)  # training updates the parameters in place
    directory = checkpoint_dir(save_dir, iteration)
    if options.async_save:
        # The common part is pickled now: args (consumed samples ...) keep changing while the write runs.
        _ASYNC_SAVES.schedule_async_request(AsyncRequest(
            _write, (storage, common_bytes(common), directory, save_dir, iteration, async_process_group()), []))
        print_rank_0("  scheduled asynchronous save of iteration {:7d} to {}".format(iteration, save_dir))
        return
    _write(storage, common_bytes(common), directory, save_dir, iteration, None)
    print_rank_0("  successfully saved checkpoint at iteration {:7d} to {}".format(iteration, save_dir))


def save(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far=0, extra_common=None):
    """Collective: write checkpoint ``iteration`` under ``--save`` (the global args give the inputs of
    :func:`save_to`). ``extra_common``: more entries for ``common.pt`` (the rerun state machine's)."""
    args = get_args()
    state = TrainState(iteration, getattr(args, "consumed_train_samples", 0),
                       getattr(args, "consumed_valid_samples", 0), num_floating_point_operations_so_far)
    options = SaveOptions(args=args, save_optim=not args.no_save_optim, save_rng=not args.no_save_rng,
                          async_save=bool(getattr(args, "async_save", False)), extra_common=extra_common)
    save_to(args.save, state, model, optimizer, opt_param_scheduler, options)


# ------------------------------------------------------------------------------------------------ load
def _read_tracker(load_dir, ckpt_step):
    if ckpt_step is not None:
        return int(ckpt_step)
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


def _norm_aliases():
    """(Transformer Engine's fused name, megatron-core's local-spec module name) of the same norm tensor: the
    layer specs' key maps (LOCAL_NORM_KEYS_MAP, MLA_NORM_KEYS_MAP) read backwards."""
    from megatron.core.transformer.transformer_layer import LOCAL_NORM_KEYS_MAP, MLA_NORM_KEYS_MAP

    return tuple((f"{fused}{kind}", f"{module}{kind}") for module, fused in {**LOCAL_NORM_KEYS_MAP,
                                                                           **MLA_NORM_KEYS_MAP}.items()
                 for kind in ("weight", "bias"))


def stored_alias(key: str, stored) -> Optional[str]:
    """The key under which ``stored`` (a checkpoint's keys) holds ``key``'s tensor when it was written with the other
    of Transformer Engine's fused norm names and megatron-core's local-spec module names; None when it has neither."""
    for fused, module in _norm_aliases():
        for mine, theirs in ((fused, module), (module, fused)):
            if mine in key:
                other = key.replace(mine, theirs)
                if other in stored:
                    return other
    return None


def load_sharded_checked(request, directory, strictness="assume_ok_unexpected", shape_mismatch=()):
    """Collective: read the storage-level ``request`` from ``directory`` after the strictness checks; one-line
    errors that name the directory and the key."""
    stored = read_metadata_checked(directory, DistCheckpointError)
    for k in [k for k in request if "._extra_state/" in k and k not in stored]:
        del request[k]  # an empty object (no FP8 metadata) that an older writer left out
    # Norms a megatron-core local spec stored under its module names (q_layernorm ...) are read from there.
    aliases = {k: stored_alias(k, stored) for k in request if k not in stored}
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


def read_state(state, directory, strictness, stored) -> Dict[str, object]:
    """Collective: ``state`` (a sharded state dict to load) read from ``directory``: every leaf replaced by its
    value, factories merged; leaves the strictness rule dropped (and FP8 scaling state absent from a checkpoint
    saved without FP8) are left out."""
    sharded, _, factories = load_preprocess(state)
    request = StorageRequest(sharded)
    absent_fp8 = [k for k in request.items if ".fp8_meta." in k and k not in stored]
    if absent_fp8:  # a checkpoint saved without FP8: the FP8 layers start their scaling state afresh
        print_rank_0(f"  the checkpoint holds no FP8 scaling state ({len(absent_fp8)} keys): scales start at 1")
        for key in absent_fp8:
            del request.items[key]
    load_sharded_checked(request.items, directory, strictness, request.shape_mismatch_keys())
    filled = request.fill(sharded)
    _drop_unread(filled, factories)
    return apply_factory_merges(filled, factories)


def load_from(load_dir, model, optimizer, opt_param_scheduler, options: LoadOptions):
    """Collective: load the torch_dist checkpoint of ``load_dir`` (ours or Megatron-LM's, any TP/PP/DP layout)
    into the model, optimizer, scheduler and RNG. Returns ``(train_state, checkpoint args)`` — when finetuning
    (or from a release checkpoint) a zero train state whose consumed samples are None (not restored) —, or None
    without a checkpoint (training starts from scratch)."""
    finalize_async_save()
    model = _unwrapped(model)
    tracker = protocol.get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker) and options.ckpt_step is None:
        if options.exit_on_missing_checkpoint:
            print_rank_0(">> '--exit-on-missing-checkpoint' set ... exiting. <<")
            sys.exit()
        print_rank_0("WARNING: could not find the metadata file {} ".format(tracker))
        print_rank_0("    will not load any checkpoints and will start from random")
        return None
    iteration = _read_tracker(load_dir, options.ckpt_step)
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
    finetune = options.finetune or release
    load_optim = optimizer is not None and not finetune and options.load_optim
    ckpt_args = common.get("args")
    tp, pp = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size()
    saved_tp_pp = (getattr(ckpt_args, "tensor_model_parallel_size", 1), getattr(ckpt_args, "pipeline_model_parallel_size", 1))
    if not finetune and ckpt_args is not None:
        # torch_dist reshards on load and absorbs vocabulary padding, so the padded vocabulary may differ.
        check_checkpoint_args(ckpt_args, directory, skip=("padded_vocab_size",))
    model_sd = model_sharded_state_dicts(model)
    state = dict(model_sd)
    main_kind = None
    fully_sharded = dist_fsdp.is_fully_sharded(model)
    if load_optim:
        if "optimizer" not in common:
            raise DistCheckpointError(f"{directory} was saved without optimizer state (--no-save-optim): pass "
                                      "--no-load-optim or --finetune")
        if fully_sharded:
            kinds = dist_fsdp.load_kinds(optimizer, stored)
            state["optimizer_state"] = dist_fsdp.optimizer_sharded_state(model, optimizer, kinds, for_load=True)
        else:
            kinds, main_kind = optimizer_load_kinds(optimizer, stored, directory)
            state["optimizer_state"] = optimizer_sharded_state(
                model_sd, optimizer_request_tensors(optimizer, model_params(model_sd), kinds))
    params_by_path = param_of_paths(model_sd)
    rng = _rng_object()
    load_rng = not finetune and options.load_rng and saved_tp_pp == (tp, pp) \
        and not getattr(ckpt_args, "no_save_rng", False)
    if load_rng:
        if rng.unique_key not in stored:
            raise DistCheckpointError(f"torch_dist checkpoint {directory} holds no RNG state {rng.unique_key!r}: "
                                      "pass --no-load-rng")
        state["rng_state"] = rng
    elif not finetune and options.load_rng:
        print_rank_0(f"  the checkpoint was saved with (TP, PP) = {saved_tp_pp}, this run uses {(tp, pp)}: RNG "
                     "state will be ignored")
    loaded = read_state(state, directory, options.strictness, stored)
    for i, chunk in enumerate(model):
        chunk.load_state_dict(loaded.get("model" if len(model) == 1 else f"model{i}", {}), strict=options.strict)

    train_state = TrainState(0, None, None, 0.0)
    if not finetune:
        train_state.iteration = common.get("iteration", iteration)
        train_state.num_floating_point_operations_so_far = common.get("num_floating_point_operations_so_far", 0)
        if ckpt_args is not None:
            train_state.consumed_train_samples = getattr(ckpt_args, "consumed_train_samples", 0)
            train_state.consumed_valid_samples = getattr(ckpt_args, "consumed_valid_samples", 0)
    if load_optim and fully_sharded:
        dist_fsdp.load_optimizer_state(model, optimizer, loaded.get("optimizer_state", {}), common["optimizer"], kinds)
    elif load_optim:
        load_optimizer_state(optimizer, loaded.get("optimizer_state", {}), params_by_path, common["optimizer"],
                             main_kind)
        if opt_param_scheduler is not None and "opt_param_scheduler" in common:
            opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    elif optimizer is not None:
        optimizer.reload_model_params()
    if load_rng:
        set_rng_state(loaded["rng_state"], False, directory)
    if not finetune:
        restore_rerun_state(common.get(RERUN_KEY), directory)
    torch.distributed.barrier()
    print_rank_0("  successfully loaded checkpoint from {} at iteration {}".format(load_dir, train_state.iteration))
    return train_state, ckpt_args


def load(model, optimizer, opt_param_scheduler, load_arg="load", strict=True):
    """Collective: load ``--load`` (the global args give the inputs of :func:`load_from`); sets
    ``args.num_floating_point_operations_so_far`` and, unless finetuning, the consumed samples; returns the
    iteration."""
    args = get_args()
    options = LoadOptions(load_optim=not args.no_load_optim, load_rng=not args.no_load_rng,
                          finetune=bool(args.finetune), strictness=getattr(args, "dist_ckpt_strictness",
                                                                           "assume_ok_unexpected"),
                          ckpt_step=getattr(args, "ckpt_step", None),
                          exit_on_missing_checkpoint=bool(args.exit_on_missing_checkpoint), strict=strict)
    loaded = load_from(getattr(args, load_arg), model, optimizer, opt_param_scheduler, options)
    if loaded is None:
        return 0
    train_state = loaded[0]
    args.num_floating_point_operations_so_far = train_state.num_floating_point_operations_so_far
    if train_state.consumed_train_samples is not None:
        args.consumed_train_samples = train_state.consumed_train_samples
        args.consumed_valid_samples = train_state.consumed_valid_samples
    return train_state.iteration


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

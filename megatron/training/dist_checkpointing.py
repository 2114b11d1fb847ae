"""``--ckpt-format torch_dist``: one PyTorch Distributed Checkpoint directory per iteration, reshardable on load.

::

    <save>/latest_checkpointed_iteration.txt
    <save>/iter_0000100/common.pt            rank 0: args, iteration, scheduler, optimizer hyper-parameters, ...
    <save>/iter_0000100/.metadata            DCP: every tensor's global shape and stored chunks
    <save>/iter_0000100/__<rank>_0.distcp    DCP data
    <save>/iter_0000100/metadata.json        {"sharded_backend": "torch_dist", ...}: written last = complete

Every model tensor is stored under its *global* name (layer numbers counted over the whole model, not the
pipeline stage) with its global shape; this rank's tensor-parallel piece is a chunk at an offset (column-parallel
tensors along dim 0, row-parallel along dim 1; a swiglu ``dense_h_to_4h`` is stored as ``[2, ffn, h]`` so that each
rank's ``[gate_shard; up_shard]`` is one rectangular chunk). The optimizer state is stored the same way, per
parameter: ``optimizer.fp32_param.<name>``, ``optimizer.exp_avg.<name>``, ``optimizer.exp_avg_sq.<name>`` (the
distributed optimizer first gathers each parameter's pieces over the data-parallel group). Loading with another
TP/PP/DP layout reads the overlapping parts of the stored chunks. RNG states are per (PP, TP) position and only
restored when the layout is the same. Saves are staged in ``iter_0000100.incomplete`` and published by renames
exactly as in the torch format (see megatron.training.checkpointing), so a killed or failed save never touches
the checkpoint the tracker names. ``--async-save`` writes in a background thread on a separate gloo group;
the save is finished before the next save, a load, or the end of ``pretrain``.
"""
from __future__ import annotations

import io
import json
import os
import re
import sys
import threading
from typing import Dict, List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.sharded_io import (LocalShard, ShardingError, load_full_state_dict,
                                                         load_sharded, save_sharded, stored_shapes)
from megatron.core.models.conversion.tp import tp_partition_dim
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from megatron.training.errors import FatalRunError
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0, unwrap_model

CHECKPOINT_VERSION = 3.0
METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
            "common_backend": "torch", "common_backend_version": 1}
_LAYER = re.compile(r"^(.*?layers\.)(\d+)(\..*)$")
_GATED_SUFFIXES = ("dense_h_to_4h.weight", "dense_h_to_4h.bias", "linear_fc1.weight", "linear_fc1.bias")
_VOCAB_SUFFIXES = ("word_embeddings.weight", "output_layer.weight")


class DistCheckpointError(FatalRunError):
    """A torch_dist checkpoint that cannot be used; the message names the directory or entry."""


# ------------------------------------------------------------------------------------------------ naming
def _tracker(path):
    return os.path.join(path, "latest_checkpointed_iteration.txt")


def checkpoint_dir(path, iteration):
    return os.path.join(path, "iter_{:07d}".format(iteration))


def _layer_offset(num_layers: int) -> int:
    """Global number of this stage's (and virtual chunk's) first layer; layers are split evenly."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is None:
        return rank * (num_layers // pp)
    virtual_rank = parallel_state.get_virtual_pipeline_model_parallel_rank()
    return virtual_rank * (num_layers // vpp) + rank * (num_layers // pp // vpp)


def _global_name(name: str, offset: int, args) -> str:
    if name == "word_embeddings.weight":  # legacy model: the last stage's tied copy of the input embedding
        return "language_model.embedding.word_embeddings.weight"
    if name == "output_layer.weight" and getattr(args, "use_mcore_models", False) \
            and not args.untie_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"  # megatron-core: the tied output layer is the embedding
    m = _LAYER.match(name)
    return f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}" if m else name


def _shard(key: str, tensor: torch.Tensor, param, gated: bool) -> LocalShard:
    """This rank's tensor as a chunk of the global tensor (see the module docstring)."""
    if param is not None:
        dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
    else:
        dim = tp_partition_dim(key)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if dim is None or tp == 1 and not (gated and key.endswith(_GATED_SUFFIXES)):
        return LocalShard(tensor, tuple(tensor.shape), (0,) * tensor.dim())
    rank = parallel_state.get_tensor_model_parallel_rank()
    if gated and key.endswith(_GATED_SUFFIXES):
        half = tensor.shape[0] // 2
        data = tensor.reshape(2, half, *tensor.shape[1:])
        return LocalShard(data, (2, half * tp, *tensor.shape[1:]), (0, rank * half) + (0,) * (tensor.dim() - 1))
    shape, offset = list(tensor.shape), [0] * tensor.dim()
    offset[dim] = rank * shape[dim]
    shape[dim] *= tp
    return LocalShard(tensor, tuple(shape), tuple(offset))


def _model_entries(model, args):
    """[(chunk index, local name, global name, tensor, param or None)] for every tensor of every chunk."""
    entries = []
    for i, chunk in enumerate(model):
        if len(model) > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(i)
        offset = _layer_offset(args.num_layers)
        state = chunk.state_dict()  # flat names (the torch format's nested layout is a view of the same tensors)
        params = dict(chunk.named_parameters())
        for name, value in state.items():
            if value is None:
                continue
            if not torch.is_tensor(value):
                raise DistCheckpointError(f"model entry {name!r} is a {type(value).__name__}, not a tensor: the "
                                          "torch_dist format stores only tensors in the model state")
            entries.append((i, name, _global_name(name, offset, args), value, params.get(name)))
    if len(model) > 1:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return entries


# ------------------------------------------------------------------------------------------------ optimizer
def _state_keys(torch_optimizer) -> List[str]:
    name = type(torch_optimizer).__name__
    if "Adam" in name:
        return ["exp_avg", "exp_avg_sq"]
    if "SGD" in name:
        return ["momentum_buffer"]
    raise DistCheckpointError(f"--ckpt-format torch_dist does not know the state of the {name} optimizer")


def _main_params(optimizer):
    """{model param: (main tensor the torch optimizer updates, (start, end) in param.view(-1) or None)}."""
    if isinstance(optimizer, DistributedOptimizer):
        out = {}
        for param, (g, o) in optimizer.model_param_group_index_map.items():
            r = optimizer.param_ranges[param]
            out[param] = (optimizer.optimizer.param_groups[g]["params"][o], (r.param_start, r.param_end))
        return out
    if isinstance(optimizer, Float16OptimizerWithFloat16Params):
        out = {}
        for model_group, main_group in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups):
            out.update({p: (m, None) for p, m in zip(model_group, main_group)})
        for group in optimizer.fp32_from_fp32_groups:
            out.update({p: (p, None) for p in group})
        return out
    if type(optimizer).__name__ == "FP32Optimizer":
        return {p: (p, None) for group in optimizer.optimizer.param_groups for p in group["params"]}
    raise DistCheckpointError(f"--ckpt-format torch_dist cannot save a {type(optimizer).__name__}")


def _optimizer_tensors(optimizer, entries) -> Dict[str, Dict[str, torch.Tensor]]:
    """{kind: {global name: fp32 tensor of the param's local (TP) shape}} with kind fp32_param or a state key.

    The distributed optimizer holds only a range of each parameter: the ranges of all DP ranks are summed (they
    are disjoint) with one all-reduce per kind.
    """
    mains = _main_params(optimizer)
    kinds = ["fp32_param"] + _state_keys(optimizer.optimizer)
    sharded = isinstance(optimizer, DistributedOptimizer)
    # The same list on every DP rank (the all-reduce below needs it): with the distributed optimizer a rank may
    # own no piece of some parameter, and contributes zeros for it.
    params = [(gname, p) for _, _, gname, _, p in entries
              if p is not None and (p in mains or sharded and p.requires_grad)]
    out = {kind: {} for kind in kinds}
    for kind in kinds:
        pieces = []
        for gname, p in params:
            main, rng = mains.get(p, (None, None))
            if main is None:
                src = None
            else:
                src = main if kind == "fp32_param" else optimizer.optimizer.state.get(main, {}).get(kind)
            full = torch.zeros(p.numel(), dtype=torch.float32)
            if src is not None:
                lo, hi = rng if rng is not None else (0, p.numel())
                full[lo:hi] = src.detach().float().view(-1)
            pieces.append(full)
        if sharded and pieces:
            flat = torch.cat(pieces)
            torch.distributed.all_reduce(flat, group=parallel_state.get_data_parallel_group())
            pieces = list(torch.split(flat, [p.numel() for _, p in params]))
        for (gname, p), full in zip(params, pieces):
            out[kind][gname] = full.view(p.shape)
    return out


def _optimizer_common(optimizer):
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.optimizer.param_groups]
    scaler = getattr(optimizer, "grad_scaler", None)
    return {"param_groups": groups, "step": int(getattr(optimizer, "_inner_steps", 0)),
            "grad_scaler": scaler.state_dict() if scaler is not None else None}


def _load_optimizer(optimizer, entries, loaded, common, gated):
    saved_groups = common["param_groups"]
    if len(saved_groups) != len(optimizer.optimizer.param_groups):
        raise DistCheckpointError(f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one has "
                                  f"{len(optimizer.optimizer.param_groups)}: pass --no-load-optim")
    for group, saved in zip(optimizer.optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    step = common["step"]
    optimizer._inner_steps = step
    scaler = getattr(optimizer, "grad_scaler", None)
    if scaler is not None and common.get("grad_scaler") is not None:
        scaler.load_state_dict(common["grad_scaler"])
    mains = _main_params(optimizer)
    kinds = ["fp32_param"] + _state_keys(optimizer.optimizer)
    adam = "Adam" in type(optimizer.optimizer).__name__
    with torch.no_grad():
        for _, _, gname, _, p in entries:
            if p is None or p not in mains:
                continue
            main, rng = mains[p]
            lo, hi = rng if rng is not None else (0, p.numel())
            state = optimizer.optimizer.state[main]
            for kind in kinds:
                value = loaded[f"optimizer.{kind}.{gname}"].data.reshape(-1)[lo:hi].view(main.shape)
                if kind == "fp32_param":
                    main.copy_(value.to(main.dtype))
                else:
                    state[kind] = value.to(main.dtype).clone()
            if adam:
                state["step"] = torch.tensor(float(step), dtype=torch.float32)
        if isinstance(optimizer, DistributedOptimizer):
            optimizer._copy_main_params_to_model_params()  # all-gathers the shards into the model params


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


def _atomic_write(path, data: bytes):
    from megatron.training.checkpointing import _atomic_write as atomic_write
    atomic_write(path, "wb", lambda f: f.write(data), "file")


def _write(sharded, common_bytes, directory, save_dir, iteration, group):
    """Every rank: write into ``<directory>.incomplete``; global rank 0 then renames it to ``directory`` and only
    then rewrites the tracker (the torch format's staged, crash-safe protocol). After each step the ranks agree
    on success, so a rank that fails (a full disk) makes every rank raise the same error instead of hanging."""
    from megatron.training import checkpointing as ckpt
    rank0 = torch.distributed.get_rank() == 0
    staging = directory + ckpt.STAGING_SUFFIX

    def remove_staging():
        import shutil
        shutil.rmtree(staging, ignore_errors=True)

    def agree(error):
        ckpt.agree_on_save_step(error, save_dir, iteration, group=group, on_failure=remove_staging)

    def prepare():
        ckpt._prepare_save_dir(save_dir, iteration)
        _atomic_write(os.path.join(staging, "common.pt"), common_bytes)

    agree(ckpt._run_step(prepare) if rank0 else None)
    # DCP gathers every rank's write result, so a failed write raises on every rank; agree() rewords it.
    agree(ckpt._run_step(lambda: save_sharded(sharded, staging, process_group=group)))
    error = None
    if rank0:
        def publish():
            _atomic_write(os.path.join(staging, "metadata.json"), json.dumps(METADATA).encode())
            ckpt._save_stage("all-files-written", staging)
            ckpt._publish(save_dir, directory, staging, iteration)
        error = ckpt._run_step(publish)
    agree(error)


def save(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far=0):
    """Collective: write checkpoint ``iteration`` under ``--save`` in the torch_dist format."""
    global _pending, _async_group
    args = get_args()
    finalize_async_save()
    model = unwrap_model(model)
    print_rank_0("saving checkpoint at iteration {:7d} to {} in torch_dist format".format(iteration, args.save))
    entries = _model_entries(model, args)
    gated = bool(getattr(args, "swiglu", False))
    sharded = {"model." + g: _shard(g, t.detach(), p, gated) for _, _, g, t, p in entries}
    common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
              "num_floating_point_operations_so_far": num_floating_point_operations_so_far,
              "gated_keys": sorted(k for k in sharded if k.endswith(_GATED_SUFFIXES) and gated),
              "saved_layout": {"tp": parallel_state.get_tensor_model_parallel_world_size(),
                               "pp": parallel_state.get_pipeline_model_parallel_world_size(),
                               "dp": parallel_state.get_data_parallel_world_size()}}
    if not args.no_save_optim:
        if optimizer is not None:
            param_of = {g: p for _, _, g, _, p in entries if p is not None}
            for kind, tensors in _optimizer_tensors(optimizer, entries).items():
                for gname, tensor in tensors.items():
                    sharded[f"optimizer.{kind}.{gname}"] = _shard(gname, tensor, param_of[gname], gated)
            common["optimizer"] = _optimizer_common(optimizer)
            common["gated_keys"] += [f"optimizer.{kind}.{g[len('model.'):]}" for g in list(common["gated_keys"])
                                     for kind in ["fp32_param"] + _state_keys(optimizer.optimizer)
                                     if g.startswith("model.")]
        if opt_param_scheduler is not None:
            common["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if not args.no_save_rng and parallel_state.get_data_parallel_rank() == 0:
        from megatron.training.checkpointing import get_rng_state
        key = "rng_state.pp{:03d}.tp{:02d}".format(parallel_state.get_pipeline_model_parallel_rank(),
                                                   parallel_state.get_tensor_model_parallel_rank())
        sharded[key] = get_rng_state(False)
    buffer = io.BytesIO()
    torch.save(common, buffer)  # pickled now: args (consumed samples ...) keep changing while an async save runs
    directory = checkpoint_dir(args.save, iteration)

    if getattr(args, "async_save", False):
        if _async_group is None:
            _async_group = torch.distributed.new_group(backend="gloo")  # collectives off the training groups
        # Snapshot the tensors: training updates the parameters in place while the thread writes.
        snapshot = {k: LocalShard(v.data.clone(), v.global_shape, v.global_offset) if isinstance(v, LocalShard) else v
                    for k, v in sharded.items()}

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
    with open(_tracker(load_dir)) as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise DistCheckpointError(f"{_tracker(load_dir)} must hold an iteration number, found {text!r} (release "
                                  "checkpoints are only supported in the torch format)") from None


def load(model, optimizer, opt_param_scheduler, load_arg="load", strict=True):
    """Collective: load a torch_dist checkpoint saved with any TP/PP/DP layout; return the iteration."""
    args = get_args()
    finalize_async_save()
    load_dir = getattr(args, load_arg)
    model = unwrap_model(model)
    if not os.path.isfile(_tracker(load_dir)) and getattr(args, "ckpt_step", None) is None:
        if args.exit_on_missing_checkpoint:
            print_rank_0(">> '--exit-on-missing-checkpoint' set ... exiting. <<")
            sys.exit()
        print_rank_0("WARNING: could not find the metadata file {} ".format(_tracker(load_dir)))
        print_rank_0("    will not load any checkpoints and will start from random")
        return 0
    iteration = _read_tracker(load_dir, args)
    directory = checkpoint_dir(load_dir, iteration)
    if not os.path.isdir(directory) and os.path.isdir(directory + ".old"):
        directory += ".old"  # a re-save of this iteration was interrupted between its two renames
    if not os.path.isfile(os.path.join(directory, "metadata.json")):
        legacy = os.path.isdir(directory) and any(n.startswith("mp_rank_") for n in os.listdir(directory))
        raise DistCheckpointError(
            f"{directory} is not a complete torch_dist checkpoint (no metadata.json)"
            + ("; it holds mp_rank_* directories: load it with --ckpt-format torch" if legacy else ""))
    print_rank_0(" loading checkpoint from {} at iteration {} (torch_dist)".format(load_dir, iteration))
    common = torch.load(os.path.join(directory, "common.pt"), map_location="cpu", weights_only=False)
    stored = stored_shapes(directory)
    finetune = args.finetune
    load_optim = optimizer is not None and not finetune and not args.no_load_optim
    gated = bool(getattr(args, "swiglu", False))

    if not finetune and common.get("args") is not None:
        from megatron.training.checkpointing import check_checkpoint_args

        saved = common.get("saved_layout", {})
        resharded = (saved.get("tp"), saved.get("pp")) != (parallel_state.get_tensor_model_parallel_world_size(),
                                                            parallel_state.get_pipeline_model_parallel_world_size())
        # The padded vocabulary depends on the TP size, and torch_dist reshards it on load.
        check_checkpoint_args(common["args"], directory, skip=("padded_vocab_size",) if resharded else ())
    entries = _model_entries(model, args)
    request = {}
    for _, _, gname, tensor, param in entries:
        shard = _shard(gname, tensor, param, gated)
        request["model." + gname] = LocalShard(torch.zeros_like(shard.data), shard.global_shape, shard.global_offset)
    if load_optim:
        if "optimizer" not in common:
            raise DistCheckpointError(f"{directory} was saved without optimizer state (--no-save-optim): pass "
                                      "--no-load-optim or --finetune")
        for _, _, gname, tensor, param in entries:
            if param is None or not param.requires_grad:
                continue
            shard = _shard(gname, tensor, param, gated)
            for kind in ["fp32_param"] + _state_keys(optimizer.optimizer):
                request[f"optimizer.{kind}.{gname}"] = LocalShard(
                    torch.zeros(shard.data.shape, dtype=torch.float32), shard.global_shape, shard.global_offset)
    rng_key = "rng_state.pp{:03d}.tp{:02d}".format(parallel_state.get_pipeline_model_parallel_rank(),
                                                   parallel_state.get_tensor_model_parallel_rank())
    same_layout = common.get("saved_layout", {}).get("tp") == parallel_state.get_tensor_model_parallel_world_size() \
        and common.get("saved_layout", {}).get("pp") == parallel_state.get_pipeline_model_parallel_world_size()
    load_rng = not finetune and not args.no_load_rng and rng_key in stored and same_layout
    if load_rng:
        request[rng_key] = None
    elif not finetune and not args.no_load_rng:
        print_rank_0("  the checkpoint was saved with another TP/PP layout: RNG states are not restored")
    mismatch = [k for k in request if k.endswith(_VOCAB_SUFFIXES)]  # vocab padding depends on TP
    try:
        load_sharded(request, directory, allow_shape_mismatch=mismatch)
    except ShardingError as e:
        raise DistCheckpointError(f"{directory}: {e}") from e

    for i, chunk in enumerate(model):
        local = {name: request["model." + g].data.reshape(t.shape) for c, name, g, t, _ in entries if c == i}
        if len(model) > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(i)
        chunk.load_state_dict(local, strict=strict)
    if len(model) > 1:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)

    ckpt_args = common.get("args")
    args.num_floating_point_operations_so_far = 0 if finetune else common.get("num_floating_point_operations_so_far", 0)
    if not finetune:
        iteration = common["iteration"]
        if ckpt_args is not None:
            args.consumed_train_samples = getattr(ckpt_args, "consumed_train_samples", 0)
            args.consumed_valid_samples = getattr(ckpt_args, "consumed_valid_samples", 0)
    else:
        iteration = 0
    if load_optim:
        _load_optimizer(optimizer, entries, request, common["optimizer"], gated)
        if opt_param_scheduler is not None and "opt_param_scheduler" in common:
            opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    elif optimizer is not None:
        optimizer.reload_model_params()
    if load_rng:
        from megatron.training.checkpointing import _set_rng_state
        _set_rng_state(request[rng_key], False, directory)
    torch.distributed.barrier()
    print_rank_0("  successfully loaded checkpoint from {} at iteration {}".format(load_dir, iteration))
    return iteration


def load_full_checkpoint(directory: str) -> Dict[str, object]:
    """Offline, in one process: ``{'model': {name: full tensor}, 'optimizer': {kind: {name: tensor}}, 'rng_state':
    {key: state}, **common.pt}`` of one ``iter_XXXXXXX`` directory (swiglu tensors back in ``[gate; up]`` form)."""
    common = torch.load(os.path.join(directory, "common.pt"), map_location="cpu", weights_only=False)
    flat = load_full_state_dict(directory)
    gated = set(common.get("gated_keys", []))
    out = dict(common)
    out["model"], out["optimizer_state"], out["rng_state"] = {}, {}, {}
    for key, value in flat.items():
        if key in gated:
            value = value.reshape(-1, *value.shape[2:])
        if key.startswith("model."):
            out["model"][key[len("model."):]] = value
        elif key.startswith("optimizer."):
            kind, name = key[len("optimizer."):].split(".", 1)
            out["optimizer_state"].setdefault(kind, {})[name] = value
        else:
            out["rng_state"][key] = value
    return out

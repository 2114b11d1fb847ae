"""``--ckpt-format torch_dist``: Megatron-LM's distributed checkpoint (PyTorch DCP), reshardable on load.

::

    <save>/latest_checkpointed_iteration.txt
    <save>/iter_0000100/common.pt            rank 0: args, checkpoint_version 3.0, iteration, opt_param_scheduler,
                                             num_floating_point_operations_so_far, content_metadata, optimizer
                                             hyper-parameters
    <save>/iter_0000100/.metadata            DCP: every tensor's global shape and stored chunks
    <save>/iter_0000100/__<rank>_0.distcp    DCP data
    <save>/iter_0000100/metadata.json        {"sharded_backend": "torch_dist", ...}: written last = complete

Model tensors use Megatron-LM's keys and layer stacking (megatron.training.dist_keys). Optimizer state, per model
tensor with the same sharding: ``optimizer.state.{exp_avg,exp_avg_sq}.<key>`` plus the fp32 master copy
``optimizer.state.fp32_param.<key>`` (mixed precision) for the plain optimizer; the distributed optimizer uses
Megatron's ``fully_reshardable`` form ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`` (each parameter's
pieces gathered over the data-parallel group). RNG states are the objects ``rng_state/shard_{pp}.{tp}_{PP}.{TP}``
(a list of one dict with Megatron's keys), restored only when TP and PP are unchanged. ``args`` in common.pt holds
only values Megatron's ``weights_only`` loader accepts. Saves are staged in ``iter_0000100.incomplete`` and
published by renames exactly as in the torch format (see megatron.training.checkpointing), so a killed or failed
save never touches the checkpoint the tracker names. ``--async-save`` writes in a background thread on a separate
gloo group; the save is finished before the next save, a load, or the end of ``pretrain``.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import sys
import threading
from typing import Dict, List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.sharded_io import (LocalShard, ShardingError, load_full_state_dict,
                                                         load_sharded, save_sharded)
from megatron.core.models.conversion.keys import legacy_to_mcore_key
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from megatron.training import dist_keys
from megatron.training.dist_strictness import check_request, read_metadata_checked
from megatron.training.errors import FatalRunError
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0, unwrap_model

CHECKPOINT_VERSION = 3.0
METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
            "common_backend": "torch", "common_backend_version": 1}
_SAFE_SCALARS = (type(None), bool, int, float, str, torch.dtype)


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


def _is_mcore(chunk) -> bool:
    return type(chunk).__module__.startswith("megatron.core.")


def model_layout(chunk, args=None):
    """(num_layers, gated, tied output layer) of a model chunk (from its config; the args for legacy models)."""
    config = getattr(chunk, "config", None)
    num_layers = getattr(config, "num_layers", None) or getattr(args, "num_layers")
    gated = bool(getattr(config, "gated_linear_unit", False) or getattr(args, "swiglu", False))
    if hasattr(chunk, "share_embeddings_and_output_weights"):
        tied = bool(chunk.share_embeddings_and_output_weights)
    else:
        tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    return num_layers, gated, tied


def model_entries(model, args=None) -> List[List[dist_keys.Entry]]:
    """Per model chunk, every tensor of its state dict with its Megatron on-disk key."""
    out = []
    for i, chunk in enumerate(model):
        if len(model) > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(i)
        num_layers, _, tied = model_layout(chunk, args)
        offset = _layer_offset(num_layers)
        params = dict(chunk.named_parameters())
        mcore = _is_mcore(chunk)
        entries = []
        for name, value in chunk.state_dict().items():
            if value is None or name.endswith("_extra_state"):
                continue
            if not torch.is_tensor(value):
                raise DistCheckpointError(f"model entry {name!r} is a {type(value).__name__}, not a tensor: the "
                                          "torch_dist format stores only tensors in the model state")
            key, layer = dist_keys.disk_key(name if mcore else legacy_to_mcore_key(name), offset, tied)
            param = params.get(name)
            tp_dim = param.partition_dim if param is not None and getattr(param, "tensor_model_parallel", False) \
                else None
            entries.append(dist_keys.Entry(name, key, layer, value, param, tp_dim))
        out.append(entries)
    if len(model) > 1:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return out


def _tp():
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def model_sharded_state(model, args=None, for_load=False) -> Dict[str, object]:
    """The model part of the sharded state dict (tensors + ``_extra_state`` objects); for loading, fresh zero
    buffers of the same shards."""
    tp, tp_rank = _tp()
    out: Dict[str, object] = {}
    for chunk, entries in zip(model, model_entries(model, args)):
        num_layers, gated, _ = model_layout(chunk, args)
        layers = set()
        for e in entries:
            pieces = dist_keys.shards(e, num_layers, tp, tp_rank, gated)
            if for_load:
                pieces = [LocalShard(torch.zeros_like(p.data), p.global_shape, p.global_offset) for p in pieces]
            out.setdefault(e.key, []).extend(pieces)  # stacked keys collect one chunk per layer
            if e.layer is not None:
                layers.add((e.key.split(".layers.")[0] + ".layers", e.layer))
        # Megatron expects one (empty) _extra_state object per linear layer; written by TP/DP rank 0.
        if for_load or (tp_rank == 0 and parallel_state.get_data_parallel_rank() == 0):
            keys = {e.key for e in entries}
            for block, layer in sorted(layers):
                for linear in dist_keys.LINEARS:
                    if f"{block}.{linear}.weight" in keys:
                        out[dist_keys.extra_state_key(block, linear, layer, num_layers)] = [None]
    return out


def apply_loaded_model(model, loaded, args=None, strict=True):
    """Copy the tensors read into ``loaded`` (from :func:`model_sharded_state` ``for_load``) into the model."""
    tp, tp_rank = _tp()
    for i, (chunk, entries) in enumerate(zip(model, model_entries(model, args))):
        num_layers, gated, _ = model_layout(chunk, args)
        state = {e.local_name: _take(loaded, e.key, e, num_layers, tp, tp_rank, gated).reshape(e.tensor.shape)
                 for e in entries if e.key in loaded}
        if len(model) > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(i)
        chunk.load_state_dict(state, strict=strict)
    if len(model) > 1:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)


def _take(loaded, key, entry, num_layers, tp, tp_rank, gated) -> torch.Tensor:
    """``entry``'s local tensor from the shards read under ``key`` (matched by their global offsets)."""
    got = loaded[key] if isinstance(loaded[key], list) else [loaded[key]]
    by_offset = {tuple(sh.global_offset): sh for sh in got}
    wanted = dist_keys.shards(entry, num_layers, tp, tp_rank, gated)
    return dist_keys.merge_loaded(entry, [by_offset[tuple(w.global_offset)] for w in wanted])


def safe_args(args) -> argparse.Namespace:
    """A copy of ``args`` with only values Megatron's ``torch.load(weights_only=True)`` accepts (None, bool, int,
    float, str, torch.dtype and lists/tuples/dicts of them); anything else (functions, classes) is left out."""
    def ok(v):
        if isinstance(v, _SAFE_SCALARS):
            return True
        if isinstance(v, (list, tuple)):
            return all(ok(x) for x in v)
        if isinstance(v, dict):
            return all(isinstance(k, str) and ok(x) for k, x in v.items())
        return False
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if ok(v)})


class _Placeholder:
    """Stands for a class pickled by another program (e.g. megatron-core's enums in its args) that this package
    does not define; keeps the pickled state for inspection."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


class _TolerantUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (_Placeholder,), {"__module__": "megatron_checkpoint." + module})


class _TolerantPickle:
    Unpickler = _TolerantUnpickler
    load = staticmethod(pickle.load)
    __name__ = "pickle"


def read_common(directory):
    """common.pt of a torch_dist checkpoint (ours or Megatron-LM's: unknown classes become placeholders)."""
    path = os.path.join(directory, "common.pt")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_TolerantPickle)
    except Exception as e:  # noqa: BLE001 - corrupt or truncated file: say which
        raise DistCheckpointError(f"could not read {path} (corrupt or truncated?): {type(e).__name__}: {e}") from e


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


def _main_kind(optimizer) -> Optional[str]:
    """Megatron's name of the fp32 master copy: ``param`` (distributed optimizer), ``fp32_param`` (mixed
    precision), None (fp32 training: the model weights are the master copy)."""
    if isinstance(optimizer, DistributedOptimizer):
        return "param"
    if isinstance(optimizer, Float16OptimizerWithFloat16Params):
        return "fp32_param"
    return None


def _optimizer_kinds(optimizer) -> List[str]:
    main = _main_kind(optimizer)
    return ([main] if main else []) + _state_keys(optimizer.optimizer)


def _optimizer_tensors(optimizer, entries) -> Dict[str, list]:
    """{kind: [(entry, fp32 tensor of the param's local (TP) shape)]}.

    The distributed optimizer holds only a range of each parameter: the ranges of all DP ranks are summed (they
    are disjoint) with one all-reduce per kind.
    """
    mains = _main_params(optimizer)
    sharded = isinstance(optimizer, DistributedOptimizer)
    # The same list on every DP rank (the all-reduce below needs it): with the distributed optimizer a rank may
    # own no piece of some parameter, and contributes zeros for it.
    params = [e for e in entries if e.param is not None and (e.param in mains or sharded and e.param.requires_grad)]
    out = {}
    for kind in _optimizer_kinds(optimizer):
        pieces = []
        for e in params:
            main, rng = mains.get(e.param, (None, None))
            if main is None:
                src = None
            else:
                src = main if kind == _main_kind(optimizer) else optimizer.optimizer.state.get(main, {}).get(kind)
            full = torch.zeros(e.param.numel(), dtype=torch.float32)
            if src is not None:
                lo, hi = rng if rng is not None else (0, e.param.numel())
                full[lo:hi] = src.detach().float().view(-1)
            pieces.append(full)
        if sharded and pieces:
            flat = torch.cat(pieces)
            torch.distributed.all_reduce(flat, group=parallel_state.get_data_parallel_group())
            pieces = list(torch.split(flat, [e.param.numel() for e in params]))
        out[kind] = [(e, full.view(e.param.shape)) for e, full in zip(params, pieces)]
    return out


def _optimizer_common(optimizer):
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.optimizer.param_groups]
    scaler = getattr(optimizer, "grad_scaler", None)
    common = {"optimizer": {"param_groups": groups, "state": {"common_step": int(getattr(optimizer, "_inner_steps",
                                                                                         0))}},
              "grad_scaler": scaler.state_dict() if scaler is not None else None}
    if isinstance(optimizer, DistributedOptimizer):
        common["param_state_sharding_type"] = "fully_reshardable"
    return common


def _optimizer_request(optimizer, model, entries, args, stored, directory):
    """{key: zero shards} of the optimizer state this rank needs; one clear error for formats we cannot read."""
    if any(k.startswith("optimizer.distributed.") for k in stored):
        raise DistCheckpointError(
            f"{directory} holds the distributed optimizer in Megatron's dp_reshardable layout (keys "
            "optimizer.distributed.*), which this loader does not read: pass --no-load-optim (the optimizer "
            "starts fresh, the weights load), or re-save it in Megatron with --dist-ckpt-optim-fully-reshardable")
    main = _main_kind(optimizer)
    kinds = _state_keys(optimizer.optimizer)
    if main is not None:
        # A checkpoint of the other optimizer flavour names the master copy differently; fall back to the weights.
        alt = [m for m in ("param", "fp32_param") if any(k.startswith(f"optimizer.state.{m}.") for k in stored)]
        main = alt[0] if alt else None
        kinds = ([main] if main else []) + kinds
    tp, tp_rank = _tp()
    request = {}
    for chunk, chunk_entries in zip(model, entries):
        num_layers, gated, _ = model_layout(chunk, args)
        for e in chunk_entries:
            if e.param is None or not e.param.requires_grad:
                continue
            for kind in kinds:
                pieces = [LocalShard(torch.zeros(p.data.shape, dtype=torch.float32), p.global_shape, p.global_offset)
                          for p in dist_keys.shards(e, num_layers, tp, tp_rank, gated)]
                request.setdefault(f"optimizer.state.{kind}.{e.key}", []).extend(pieces)
    return request, main, kinds


def _load_optimizer(optimizer, model, entries, loaded, common, main_kind, args):
    saved_groups = common["optimizer"]["param_groups"]
    if len(saved_groups) != len(optimizer.optimizer.param_groups):
        raise DistCheckpointError(f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one has "
                                  f"{len(optimizer.optimizer.param_groups)}: pass --no-load-optim")
    for group, saved in zip(optimizer.optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    step = int(common["optimizer"].get("state", {}).get("common_step", 0) or 0)
    optimizer._inner_steps = step
    scaler = getattr(optimizer, "grad_scaler", None)
    if scaler is not None and common.get("grad_scaler") is not None:
        scaler.load_state_dict(common["grad_scaler"])
    mains = _main_params(optimizer)
    own_main = _main_kind(optimizer)
    adam = "Adam" in type(optimizer.optimizer).__name__
    tp, tp_rank = _tp()
    with torch.no_grad():
        for e, (num_layers, gated, _) in [(e, model_layout(chunk, args)) for chunk, es in zip(model, entries)
                                          for e in es]:
            if e.param is None or e.param not in mains:
                continue
            main, rng = mains[e.param]
            lo, hi = rng if rng is not None else (0, e.param.numel())
            state = optimizer.optimizer.state[main]

            def value(kind):
                full = _take(loaded, f"optimizer.state.{kind}.{e.key}", e, num_layers, tp, tp_rank, gated)
                return full.reshape(-1)[lo:hi].view(main.shape)

            if own_main is not None:
                source = value(main_kind) if main_kind else e.param.detach().reshape(-1)[lo:hi].view(main.shape)
                main.copy_(source.to(main.dtype))
            for kind in _state_keys(optimizer.optimizer):
                state[kind] = value(kind).to(main.dtype).clone()
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


def _rng_key():
    return dist_keys.rng_key(parallel_state.get_pipeline_model_parallel_rank(),
                             parallel_state.get_tensor_model_parallel_rank(),
                             parallel_state.get_pipeline_model_parallel_world_size(),
                             parallel_state.get_tensor_model_parallel_world_size())


def save(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far=0):
    """Collective: write checkpoint ``iteration`` under ``--save`` in the torch_dist format."""
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
            tp, tp_rank = _tp()
            for chunk, chunk_entries in zip(model, entries):
                num_layers, gated, _ = model_layout(chunk, args)
                for kind, tensors in _optimizer_tensors(optimizer, chunk_entries).items():
                    for e, tensor in tensors:
                        pieces = dist_keys.shards(e, num_layers, tp, tp_rank, gated, tensor)
                        sharded.setdefault(f"optimizer.state.{kind}.{e.key}", []).extend(pieces)
            common["optimizer"] = _optimizer_common(optimizer)
            if isinstance(optimizer, DistributedOptimizer):
                content.update(distrib_optim_sharding_type="fully_reshardable",
                               distrib_optim_fully_reshardable_mem_efficient=False)
        if opt_param_scheduler is not None:
            common["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    common["content_metadata"] = content
    if not args.no_save_rng and parallel_state.get_data_parallel_rank() == 0:
        from megatron.training.checkpointing import get_rng_state
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
    with open(_tracker(load_dir)) as f:
        text = f.read().strip()
    if text == "release":
        return "release"
    try:
        return int(text)
    except ValueError:
        raise DistCheckpointError(f"{_tracker(load_dir)} must hold an iteration number or 'release', found "
                                  f"{text!r}") from None


def load_sharded_checked(request, directory, strictness="assume_ok_unexpected", shape_mismatch=()):
    """Collective: read ``request`` from ``directory`` after the strictness checks; one-line errors that name the
    directory and the key."""
    stored = read_metadata_checked(directory, DistCheckpointError)
    check_request(request, stored, directory, strictness, DistCheckpointError)
    try:
        load_sharded(request, directory, allow_shape_mismatch=shape_mismatch)
    except ShardingError as e:
        raise DistCheckpointError(f"torch_dist checkpoint {directory}: {e}") from e
    return request


def load(model, optimizer, opt_param_scheduler, load_arg="load", strict=True):
    """Collective: load a torch_dist checkpoint (ours or Megatron-LM's) saved with any TP/PP/DP layout; return the
    iteration."""
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
    release = iteration == "release"
    directory = os.path.join(load_dir, "release") if release else checkpoint_dir(load_dir, iteration)
    if not os.path.isdir(directory) and os.path.isdir(directory + ".old"):
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
        from megatron.training.checkpointing import check_checkpoint_args
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
        optim_request, main_kind, _ = _optimizer_request(optimizer, model, entries, args, stored, directory)
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
        _load_optimizer(optimizer, model, entries, request, common["optimizer"], main_kind, args)
        if opt_param_scheduler is not None and "opt_param_scheduler" in common:
            opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    elif optimizer is not None:
        optimizer.reload_model_params()
    if load_rng:
        from megatron.training.checkpointing import _set_rng_state
        _set_rng_state(request[rng][0], False, directory)
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

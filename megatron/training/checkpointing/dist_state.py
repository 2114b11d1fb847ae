"""The ``torch_dist`` state of a model and its optimizer: Megatron-LM's keys, sharding and common state.

Model tensors: every tensor of each model chunk's state dict under its Megatron on-disk key
(megatron.training.checkpointing.dist_keys), as this rank's shards of the global (layer-stacked, TP-merged) tensor;
plus one empty ``_extra_state`` object (payload ``[None]``) per linear layer, written by TP/DP rank 0.

Optimizer state, per model tensor with the same sharding: ``optimizer.state.{exp_avg,exp_avg_sq}.<key>`` (Adam;
``momentum_buffer`` for SGD) plus the fp32 master copy ``optimizer.state.fp32_param.<key>`` (mixed precision) for
the plain optimizer; the distributed optimizer uses Megatron's ``fully_reshardable`` form
``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``: each parameter's pieces are gathered over the data-parallel
group (the ranges of all DP ranks are disjoint and summed by one all-reduce per kind). Without a master copy (fp32
training) the model weights are the master copy. The common state (``common.pt`` ``optimizer``) holds the param
groups without their params, ``state.common_step`` and the grad scaler.

``args`` in common.pt holds only values Megatron's ``weights_only`` loader accepts (:func:`safe_args`);
:func:`read_common` reads Megatron-LM's common.pt too (classes this package does not define become placeholders).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
from typing import Dict, List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.sharded_io import LocalShard
from megatron.core.models.conversion.keys import legacy_to_mcore_key
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params
from megatron.training.checkpointing import dist_hybrid, dist_keys
from megatron.training.errors import FatalRunError

CHECKPOINT_VERSION = 3.0
METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
            "common_backend": "torch", "common_backend_version": 1}
_SAFE_SCALARS = (type(None), bool, int, float, str, torch.dtype)


class DistCheckpointError(FatalRunError):
    """A torch_dist checkpoint that cannot be used; the message names the directory or entry."""


# ------------------------------------------------------------------------------------------------ model
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


def _t5_blocks(chunk):
    """{'encoder'|'decoder': (first global layer, layer count)} of a T5 chunk's stacks (legacy or megatron-core);
    None for other models."""
    if type(chunk).__name__ != "T5Model":
        return None
    holder = getattr(chunk, "language_model", chunk)
    blocks = {}
    for name in ("encoder", "decoder"):
        block = getattr(holder, name, None)
        if block is not None:
            blocks[name] = (block.layers[0].layer_number - 1, block.config.num_layers)
    return blocks


def _with_t5_aliases(entries):
    """One entry per on-disk key, plus megatron-core's alias keys (``position_embeddings.weight``,
    ``output_layer.bias``: the same tensor, sharding and parameter as the key they repeat)."""
    seen, out = set(), []
    for e in entries:
        if (e.key, e.layer) not in seen:
            seen.add((e.key, e.layer))
            out.append(e)
    by_key = {e.key: e for e in out}
    for alias, target in dist_keys.T5_ALIAS_KEYS.items():
        if alias not in by_key and target in by_key:
            out.append(dataclasses.replace(by_key[target], key=alias))
    return out


def model_entries(model, args=None) -> List[List[dist_keys.Entry]]:
    """Per model chunk, every tensor of its state dict with its Megatron on-disk key."""
    out = []
    for i, chunk in enumerate(model):
        if len(model) > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(i)
        num_layers, _, tied = model_layout(chunk, args)
        if dist_hybrid.is_hybrid(chunk):  # per-layer keys, never stacked
            out.append(dist_hybrid.hybrid_entries(
                chunk, tied, lambda name, value, param: _expert_entries(chunk, name, value, param, 0,
                                                                        dist_keys.DEFAULT_LAYOUT)))
            continue
        offset = _layer_offset(num_layers)
        t5_blocks = _t5_blocks(chunk)
        params = dict(chunk.named_parameters())
        mcore = _is_mcore(chunk)
        layout = dist_keys.layout_of(chunk.config) if mcore and hasattr(chunk, "config") else dist_keys.DEFAULT_LAYOUT
        entries = []
        for name, value in chunk.state_dict().items():
            if value is None or name.endswith("_extra_state"):
                continue
            if not torch.is_tensor(value):
                raise DistCheckpointError(f"model entry {name!r} is a {type(value).__name__}, not a tensor: the "
                                          "torch_dist format stores only tensors in the model state")
            if t5_blocks is None:
                key, layer = dist_keys.disk_key(name if mcore else legacy_to_mcore_key(name), offset, tied, layout)
                entry_layers = None
            else:
                core_name = name if mcore else legacy_to_mcore_key(name, "t5")
                if mcore and core_name.startswith(dist_keys.T5_ALIASES):
                    continue  # megatron-core's second module names; their keys are added by _with_t5_aliases
                block_offset, entry_layers = t5_blocks.get(core_name.split(".", 1)[0], (0, None))
                key, layer = dist_keys.disk_key(core_name, block_offset, tied)
            param = params.get(name)
            experts = _expert_entries(chunk, name, value, param, offset, layout) if mcore else None
            if experts is not None:
                entries.extend(experts)
                continue
            tp_dim = param.partition_dim if param is not None and getattr(param, "tensor_model_parallel", False) \
                else None
            entries.append(dist_keys.Entry(name, key, layer, value, param, tp_dim, num_layers=entry_layers))
        if t5_blocks is not None:
            entries = _with_t5_aliases(entries)
        out.append(entries)
    if len(model) > 1:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return out


def _expert_entries(chunk, name, value, param, offset, layout):
    config = getattr(chunk, "config", None)
    num_experts = getattr(config, "num_moe_experts", None)
    if not num_experts or ".mlp.experts." not in name:
        return None
    ep = parallel_state.get_expert_model_parallel_world_size() or 1
    etp = (parallel_state.get_expert_tensor_parallel_world_size() or 1,
           parallel_state.get_expert_tensor_parallel_rank() or 0)
    return dist_keys.expert_entries(name, value, param, offset, parallel_state.get_expert_model_parallel_rank() or 0,
                                    num_experts // ep, num_experts, etp, layout)


def assemble(entries, fetch) -> Dict[str, torch.Tensor]:
    """{local name: tensor} from per-entry loaded tensors (``fetch(entry)``); the per-expert entries of a grouped
    weight are written into their views of one parameter-shaped tensor."""
    out = {}
    for e in entries:
        piece = fetch(e)
        if piece is None:
            continue
        if e.view is None:
            out[e.local_name] = piece.reshape(e.tensor.shape)
        else:
            full = out.setdefault(e.local_name, torch.empty(e.param.shape, dtype=piece.dtype))
            e.view(full).copy_(piece.reshape(e.tensor.shape))
    return out


def tp_size_rank():
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def model_sharded_state(model, args=None, for_load=False) -> Dict[str, object]:
    """The model part of the sharded state dict (tensors + ``_extra_state`` objects); for loading, fresh zero
    buffers of the same shards."""
    tp, tp_rank = tp_size_rank()
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
                layers.add((e.key.split(".layers.")[0] + ".layers", e.layer, e.num_layers or num_layers))
        # Megatron expects one (empty) _extra_state object per linear layer; written by TP/DP rank 0.
        if dist_hybrid.is_hybrid(chunk):
            if for_load or (tp_rank == 0 and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0):
                num_experts = getattr(chunk.config, "num_moe_experts", None) or 0
                out.update({k: [None] for k in dist_hybrid.extra_state_keys({e.key for e in entries}, num_experts)})
            continue
        expert_dp_rank = parallel_state.get_expert_data_parallel_rank() if any(
            e.expert is not None for e in entries) else 0
        for e in entries:
            if e.expert is None or e.key.endswith(".bias") or (not for_load and (e.etp[1] != 0 or expert_dp_rank)):
                continue
            if e.layer is None:  # an unstacked layer's (heterogeneous stack, MTP depth) experts
                out[dist_keys.unstacked_extra_state_key(e.key, e.expert, e.num_experts)] = [None]
                continue
            block, linear = e.key.split(".layers.")[0] + ".layers", e.key.split(".layers.")[1].rsplit(".", 1)[0]
            out[dist_keys.expert_extra_state_key(block, linear, e.layer, e.expert, num_layers, e.num_experts)] = [None]
        if for_load or (tp_rank == 0 and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0):
            keys = {e.key for e in entries if e.expert is None}
            for e in entries:
                extra = dist_keys.unstacked_extra_state_key(e.key) if e.expert is None and e.layer is None else None
                if extra is not None:
                    out[extra] = [None]
            for block, layer, block_layers in sorted(layers):
                for linear in dist_keys.LINEARS:
                    if f"{block}.{linear}.weight" in keys:
                        out[dist_keys.extra_state_key(block, linear, layer, block_layers)] = [None]
            if "lm_head.output_layer.bias" in keys:  # a T5 LM head (megatron-core writes its _extra_state too)
                for key in dist_keys.t5_head_extra_state_keys():
                    out[key] = [None]
    return out


def apply_loaded_model(model, loaded, args=None, strict=True):
    """Copy the tensors read into ``loaded`` (from :func:`model_sharded_state` ``for_load``) into the model."""
    tp, tp_rank = tp_size_rank()
    for i, (chunk, entries) in enumerate(zip(model, model_entries(model, args))):
        num_layers, gated, _ = model_layout(chunk, args)
        state = assemble(entries, lambda e: take_loaded(loaded, e.key, e, num_layers, tp, tp_rank, gated)
                         if e.key in loaded else None)
        if len(model) > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(i)
        chunk.load_state_dict(state, strict=strict)
    if len(model) > 1:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)


def take_loaded(loaded, key, entry, num_layers, tp, tp_rank, gated) -> torch.Tensor:
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
    if isinstance(optimizer, FP32Optimizer):
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


def optimizer_tensors(optimizer, entries) -> Dict[str, list]:
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
            # Expert parameters are sharded over the expert data-parallel group, the rest over DP.
            for expert in (False, True):
                index = [i for i, e in enumerate(params) if (not getattr(e.param, "allreduce", True)) == expert]
                if not index:
                    continue
                group = (parallel_state.get_expert_data_parallel_group() if expert
                         else parallel_state.get_data_parallel_group(with_context_parallel=True))
                flat = torch.cat([pieces[i] for i in index])
                torch.distributed.all_reduce(flat, group=group)
                for i, part in zip(index, torch.split(flat, [params[i].param.numel() for i in index])):
                    pieces[i] = part
        out[kind] = [(e, full.view(e.param.shape)) for e, full in zip(params, pieces)]
    return out


def optimizer_common(optimizer):
    """The optimizer's non-tensor state in common.pt, shaped as Megatron's class of the same kind writes it: the
    plain fp32 optimizer (``FP32Optimizer``) stores the torch optimizer's dict itself, ``{'state': {'common_step'},
    'param_groups'}``; the mixed-precision and distributed optimizers nest it, ``{'optimizer': {...}, 'grad_scaler'}``
    (plus ``param_state_sharding_type`` for the distributed one)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.optimizer.param_groups]
    inner = {"param_groups": groups, "state": {"common_step": int(getattr(optimizer, "_inner_steps", 0))}}
    if isinstance(optimizer, FP32Optimizer):
        return inner
    scaler = getattr(optimizer, "grad_scaler", None)
    common = {"optimizer": inner, "grad_scaler": scaler.state_dict() if scaler is not None else None}
    if isinstance(optimizer, DistributedOptimizer):
        common["param_state_sharding_type"] = "fully_reshardable"
    return common


def optimizer_request(optimizer, model, entries, args, stored, directory):
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
    tp, tp_rank = tp_size_rank()
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


def load_optimizer_state(optimizer, model, entries, loaded, common, main_kind, args):
    inner = common["optimizer"] if "optimizer" in common else common  # nested (mixed precision, DO) or FP32Optimizer's
    saved_groups = inner["param_groups"]
    if len(saved_groups) != len(optimizer.optimizer.param_groups):
        raise DistCheckpointError(f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one has "
                                  f"{len(optimizer.optimizer.param_groups)}: pass --no-load-optim")
    for group, saved in zip(optimizer.optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    step = int(inner.get("state", {}).get("common_step", 0) or 0)
    optimizer._inner_steps = step
    scaler = getattr(optimizer, "grad_scaler", None)
    if scaler is not None and common.get("grad_scaler") is not None:
        scaler.load_state_dict(common["grad_scaler"])
    mains = _main_params(optimizer)
    own_main = _main_kind(optimizer)
    adam = "Adam" in type(optimizer.optimizer).__name__
    tp, tp_rank = tp_size_rank()
    by_param = {}  # the entries of each parameter (several for a grouped expert weight), with their layout
    for chunk, es in zip(model, entries):
        layout = model_layout(chunk, args)
        for e in es:
            if e.param is not None and e.param in mains:
                by_param.setdefault(e.param, (layout, []))[1].append(e)
    with torch.no_grad():
        for param, ((num_layers, gated, _), es) in by_param.items():
            e = es[0]
            main, rng = mains[e.param]
            lo, hi = rng if rng is not None else (0, e.param.numel())
            state = optimizer.optimizer.state[main]

            def value(kind):
                full = assemble(es, lambda x: take_loaded(loaded, f"optimizer.state.{kind}.{x.key}", x, num_layers, tp,
                                                          tp_rank, gated))[e.local_name]
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


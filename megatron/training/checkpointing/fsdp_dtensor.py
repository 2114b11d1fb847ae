"""``--ckpt-format fsdp_dtensor``: Megatron-FSDP's checkpoint (``--use-megatron-fsdp``), written with PyTorch DCP.

Keys and the placement of every rank's block are megatron.core.transformer.fsdp_dtensor_checkpoint's (module
names, ``model.module.`` prefix, gated fc1 split into ``_w`` / ``_v``, global expert indices, no ``_extra_state``);
the model tensors are the fp32 main weights. Besides them (objects, pickled by DCP)::

    optimizer.state.module.module.module.<name>.<exp_avg|exp_avg_sq|momentum_buffer>    tensors
    optimizer.param_to_group_meta.module.module.module.<name>   {"group_index", "wd_mult", "lr_mult", ...}
    optimizer.param_groups          the param groups' hyper-parameters and step (no params)
    optimizer.grad_scaler           fp16 only
    content_metadata                {"distrib_optim_sharding_type": "fsdp_dtensor"}
    rng_state                       {"(pp_rank, tp_rank)": Megatron's list of RNG state dicts}
    args, iteration, checkpoint_version (3.0), opt_param_scheduler, num_floating_point_operations_so_far

No ``common.pt`` and no ``metadata.json``. DCP reshards on load: a checkpoint written with one strategy, DP or TP
size loads with another. Loading is strict: a model tensor missing from the checkpoint is an error naming it,
unless ``--no-strict-fsdp-dtensor-load``, which loads what is there and reports the rest per
``--dist-ckpt-strictness``. The RNG state of this rank's ``(pp, tp)`` is restored; without it the first entry, with
a warning (Megatron's fallback).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.sharded_io import LocalShard, ShardingError, load_sharded, save_sharded
from megatron.core.distributed.finalize_model_grads import unwrap_model_chunk
from megatron.core.distributed.fsdp.sharded_state import block_rows
from megatron.core.transformer.fsdp_dtensor_checkpoint import (MODEL_PREFIX, OPTIMIZER_STATE_PREFIX,
                                                               PARAM_GROUP_META_PREFIX, global_expert_name,
                                                               is_grouped_expert_weight, pieces)
from megatron.training.checkpointing import protocol
from megatron.training.checkpointing.protocol import CheckpointError
from megatron.training.checkpointing.rng import get_rng_state, set_rng_state
from megatron.training.checkpointing.torch_dcp import CHECKPOINT_VERSION, finish_load, locate_dcp, rng_key
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0

CONTENT_METADATA = {"distrib_optim_sharding_type": "fsdp_dtensor"}


@dataclass
class ParamBlock:
    """This rank's rows ``[start, stop)`` (``block``) of the TP-local parameter ``param`` named ``name`` on disk."""

    name: str
    param: torch.nn.Parameter
    block: torch.Tensor
    rows: Tuple[int, int]
    local_shape: Tuple[int, ...]
    tp_dim: Optional[int]
    tp: Tuple[int, int]
    experts: Optional[Tuple[int, int]] = None  # grouped experts: (global index of the first local one, how many)

    def pieces(self, gated: bool):
        return pieces(self.name, self.local_shape, self.rows, self.tp_dim, self.tp, gated, self.experts)

    def stored_names(self) -> List[str]:
        """The parameter's names on disk (unsplit): one per expert for grouped expert weights."""
        if not is_grouped_expert_weight(self.name):
            return [self.name]
        prefix, fc = self.name[:-len("weight1")], "linear_fc1" if self.name.endswith("weight1") else "linear_fc2"
        first, n = self.experts
        return [f"{prefix}{fc}.weight{first + j}" for j in range(n)]


def _tp_of(param) -> Tuple[Optional[int], Tuple[int, int]]:
    tp_dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
    if getattr(param, "is_expert", False):
        return tp_dim, (parallel_state.get_expert_tensor_parallel_world_size() or 1,
                        parallel_state.get_expert_tensor_parallel_rank() or 0)
    return tp_dim, (parallel_state.get_tensor_model_parallel_world_size(),
                    parallel_state.get_tensor_model_parallel_rank())


def _rows_of(tensor) -> Tuple[int, int]:
    """The rows of a DTensor's global (here: TP-local) tensor that this rank holds (FSDP2: torch.chunk blocks)."""
    if not hasattr(tensor, "to_local"):
        return 0, tensor.shape[0]
    return block_rows(tensor)


def param_blocks(chunk) -> List[ParamBlock]:
    """Every parameter of a model chunk (FSDP2 DTensor blocks, or whole TP-local tensors of the bucketed
    strategies) with its fsdp_dtensor name."""
    if getattr(chunk, "uses_fully_shard", False):
        named = chunk.sharded_parameters()
    else:
        named = list(unwrap_model_chunk(chunk).named_parameters())
    ep_rank = parallel_state.get_expert_model_parallel_rank() or 0
    config = getattr(unwrap_model_chunk(chunk), "config", None)
    out = []
    for name, param in named:
        experts = None
        if getattr(param, "is_expert", False) and config is not None:
            num_local = config.num_moe_experts // (parallel_state.get_expert_model_parallel_world_size() or 1)
            name = global_expert_name(name, ep_rank, num_local)
            experts = (ep_rank * num_local, num_local)
        tp_dim, tp = _tp_of(param)
        block = param.to_local() if hasattr(param, "to_local") else param
        out.append(ParamBlock(name, param, block.detach(), _rows_of(param), tuple(param.shape), tp_dim, tp, experts))
    return out


def _shards(pb: ParamBlock, tensor: torch.Tensor, prefix: str, suffix: str, gated: bool) -> Dict[str, LocalShard]:
    return {prefix + p.name + suffix: LocalShard(p.take(tensor), p.global_shape, p.global_offset)
            for p in pb.pieces(gated)}


def _gated(chunk) -> bool:
    return bool(getattr(getattr(unwrap_model_chunk(chunk), "config", None), "gated_linear_unit", False))


# ------------------------------------------------------------------------------------------ optimizer state
def _state_keys(torch_optimizer) -> List[str]:
    name = type(torch_optimizer).__name__
    return ["exp_avg", "exp_avg_sq"] if "Adam" in name else ["momentum_buffer"]


def _group_meta(optimizer) -> Dict[int, dict]:
    """{id(param): its param group's metadata} (``group_index`` and the multipliers the scheduler uses)."""
    meta = {}
    for index, group in enumerate(optimizer.optimizer.param_groups):
        info = {"group_index": index, **{k: group[k] for k in ("wd_mult", "lr_mult", "is_decoupled_lr") if k in group}}
        for p in group["params"]:
            meta[id(p)] = info
    return meta


def _bucketed_tensors(optimizer, blocks: List[ParamBlock]):
    """The bucketed strategies (DDP's optimizers): ({id(param): fp32 main weight or None}, {kind: {id(param):
    state}}), whole TP-local tensors (the distributed optimizer's ranges are gathered over DP: a collective)."""
    from megatron.training.checkpointing import dist_state

    out = dist_state.optimizer_tensors(optimizer, [pb.param for pb in blocks])  # {kind: {id(param): tensor}}
    main_kind = dist_state._main_kind(optimizer)
    return (out.pop(main_kind) if main_kind else {}), out


def _load_bucketed(optimizer, blocks: List[ParamBlock], loaded_main: Dict[int, torch.Tensor],
                   loaded: Dict[str, Dict[int, torch.Tensor]]):
    """Put whole TP-local main weights and state into DDP's optimizers (each keeps its own range of them)."""
    from megatron.training.checkpointing import dist_state

    mains = dist_state._main_params(optimizer)
    adam = "Adam" in type(optimizer.optimizer).__name__
    for pb in blocks:
        if pb.param not in mains:
            continue  # the distributed optimizer: no piece of this parameter on this rank
        main, rng = mains[pb.param]
        lo, hi = rng if rng is not None else (0, pb.param.numel())
        main.copy_(loaded_main[id(pb.param)].reshape(-1)[lo:hi].view(main.shape))
        state = optimizer.optimizer.state[main]
        for kind, by_param in loaded.items():
            state[kind] = by_param[id(pb.param)].reshape(-1)[lo:hi].view(main.shape).clone().to(main.dtype)
        if adam:
            state["step"] = torch.tensor(float(optimizer._inner_steps), dtype=torch.float32)
    if hasattr(optimizer, "_copy_main_params_to_model_params"):
        optimizer._copy_main_params_to_model_params()


def _optimizer_tensors(optimizer, blocks: List[ParamBlock], create: bool) -> Dict[str, Dict[int, torch.Tensor]]:
    """{kind: {id(param): this rank's block of the state}} of the FSDP2 engine's optimizer."""
    return optimizer.state_blocks([pb.param for pb in blocks], create)


def _check_engine(model):
    if len(model) != 1:
        raise CheckpointError("--ckpt-format fsdp_dtensor: one model chunk (pipeline parallelism is not supported "
                              "with Megatron-FSDP here)")


def build_state(model, optimizer, with_optimizer: bool, for_load: bool = False) -> Tuple[dict, List[ParamBlock]]:
    """The sharded state (``{key: LocalShard | object}``) of the model (and optimizer) in fsdp_dtensor keys; for a
    load, zero buffers of the same blocks."""
    chunk = model[0]
    gated = _gated(chunk)
    blocks = param_blocks(chunk)
    bucketed = not getattr(chunk, "uses_fully_shard", False)
    mains, tensors = {}, {}
    if with_optimizer:
        mains, tensors = _bucketed_tensors(optimizer, blocks) if bucketed else \
            ({}, _optimizer_tensors(optimizer, blocks, create=False))
    state: Dict[str, object] = {}
    fresh = (lambda t: torch.zeros(t.shape, dtype=torch.float32)) if for_load else (lambda t: t)
    for pb in blocks:
        weights = mains.get(id(pb.param), pb.block.float() if bucketed else pb.block)
        state.update(_shards(pb, fresh(weights), MODEL_PREFIX, "", gated))
    if with_optimizer:
        meta = _group_meta(optimizer)
        for pb in blocks:
            for kind, by_param in tensors.items():
                state.update(_shards(pb, fresh(by_param[id(pb.param)]), OPTIMIZER_STATE_PREFIX, "." + kind, gated))
            for name in pb.stored_names():
                state[PARAM_GROUP_META_PREFIX + name] = meta.get(id(pb.param))
    return state, blocks


def _common(optimizer, opt_param_scheduler, args, iteration, flops):
    from megatron.training.checkpointing.dist_state import safe_args

    common = {"args": safe_args(args), "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
              "num_floating_point_operations_so_far": float(flops), "content_metadata": dict(CONTENT_METADATA)}
    if optimizer is not None:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.optimizer.param_groups]
        for g in groups:
            g["step"] = int(getattr(optimizer, "_inner_steps", 0))
        common["optimizer.param_groups"] = groups
        scaler = getattr(optimizer, "grad_scaler", None)
        if scaler is not None:
            common["optimizer.grad_scaler"] = scaler.state_dict()
        if opt_param_scheduler is not None:
            common["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    return common


def _all_rng_states() -> dict:
    """``{"(pp, tp)": states}`` of every (pipeline, tensor) rank, from their data-parallel rank 0 (the same dict
    on every rank: DCP writes one copy)."""
    mine = (rng_key(), get_rng_state(False)) if parallel_state.get_data_parallel_rank(
        with_context_parallel=True) == 0 else None
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    return dict(x for x in everyone if x is not None)


def save(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far=0):
    """Collective: write checkpoint ``iteration`` under ``--save`` in the fsdp_dtensor format."""
    args = get_args()
    with_optimizer = optimizer is not None and not args.no_save_optim
    _check_engine(model)
    print_rank_0("saving checkpoint at iteration {:7d} to {} in fsdp_dtensor format".format(iteration, args.save))
    state, _ = build_state(model, optimizer, with_optimizer)
    state.update(_common(optimizer if with_optimizer else None, opt_param_scheduler, args, iteration,
                         num_floating_point_operations_so_far))
    if not args.no_save_rng:
        state["rng_state"] = _all_rng_states()
    protocol.write_staged(args.save, iteration, lambda staging: save_sharded(state, staging))
    print_rank_0("  successfully saved checkpoint at iteration {:7d} to {}".format(iteration, args.save))


def _apply_strictness(request, stored, directory, args):
    """Model keys the checkpoint lacks: an error (strict, the default) or reported and skipped."""
    missing = sorted(k for k in request if k.startswith(MODEL_PREFIX) and k not in stored)
    if missing and args.strict_fsdp_dtensor_load:
        raise CheckpointError(f"fsdp_dtensor checkpoint {directory} has no {missing[0]}"
                              + (f" (and {len(missing) - 1} more model keys)" if len(missing) > 1 else "")
                              + ": the model differs; pass --no-strict-fsdp-dtensor-load to load the rest")
    if missing and args.dist_ckpt_strictness not in ("assume_ok_unexpected", "ignore_all"):
        if args.dist_ckpt_strictness.startswith("raise"):
            raise CheckpointError(f"fsdp_dtensor checkpoint {directory} lacks {len(missing)} model key(s), e.g. "
                                  f"{missing[0]} (--dist-ckpt-strictness {args.dist_ckpt_strictness})")
        print_rank_0(f"WARNING: fsdp_dtensor checkpoint {directory} lacks {len(missing)} model key(s), left as "
                     f"initialised: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    for key in [k for k in request if k not in stored]:
        del request[key]


def load(model, optimizer, opt_param_scheduler, load_arg="load", strict=True):
    """Collective: load the fsdp_dtensor checkpoint the tracker of ``--load`` names; return its iteration."""
    args = get_args()
    load_dir = getattr(args, load_arg)
    found = locate_dcp(args, load_arg, optimizer)
    if found is None:
        return 0
    directory, stored, finetune, load_optim = found
    _check_engine(model)
    if not any(k.startswith(MODEL_PREFIX) for k in stored):
        raise CheckpointError(f"{directory} holds no model.module.* keys: it is not an fsdp_dtensor checkpoint")
    if load_optim and not any(k.startswith(OPTIMIZER_STATE_PREFIX) for k in stored):
        raise CheckpointError(f"{directory} was saved without optimizer state (--no-save-optim): pass "
                              "--no-load-optim or --finetune")
    print_rank_0(f" loading checkpoint from {load_dir} at {os.path.basename(directory)} (fsdp_dtensor)")
    request, blocks = build_state(model, optimizer, load_optim, for_load=True)
    request = {k: v for k, v in request.items() if not k.startswith(PARAM_GROUP_META_PREFIX)}
    _apply_strictness(request, stored, directory, args)
    for key in ("args", "iteration", "num_floating_point_operations_so_far", "rng_state", "optimizer.param_groups",
                "optimizer.grad_scaler", "opt_param_scheduler"):
        if key in stored:
            request[key] = None
    try:
        load_sharded(request, directory)
    except ShardingError as e:
        raise CheckpointError(f"fsdp_dtensor checkpoint {directory}: {e}") from e
    if load_optim:
        _restore_optimizer_common(optimizer, opt_param_scheduler, request, directory)
    _restore(model[0], optimizer if load_optim else None, blocks, request)
    if not finetune and not args.no_load_rng and request.get("rng_state"):
        rngs = request["rng_state"]
        if rng_key() not in rngs:
            print_rank_0(f"WARNING: {directory} has no RNG state for (pp, tp) = {rng_key()}: using "
                         f"{next(iter(rngs))}'s")
        set_rng_state(rngs.get(rng_key(), next(iter(rngs.values()))), False, directory)
    return finish_load(args, request, finetune, load_dir)


def _restore(chunk, optimizer, blocks: List[ParamBlock], loaded):
    """Copy the loaded blocks into the parameters (and the optimizer state)."""
    gated = _gated(chunk)
    bucketed = not getattr(chunk, "uses_fully_shard", False)
    kinds = _state_keys(optimizer.optimizer) if optimizer is not None else []
    targets = _optimizer_tensors(optimizer, blocks, create=True) if optimizer is not None and not bucketed else {}
    main, state = {}, {k: {} for k in kinds}
    with torch.no_grad():
        for pb in blocks:
            # Start from the current weights: a key a partial load skips keeps them.
            dest = {"": main.setdefault(id(pb.param), pb.block.float().clone())}
            for kind in kinds:
                dest["." + kind] = targets[kind][id(pb.param)] if targets else \
                    state[kind].setdefault(id(pb.param), torch.zeros(pb.block.shape, dtype=torch.float32))
            for suffix, tensor in dest.items():
                prefix = MODEL_PREFIX if not suffix else OPTIMIZER_STATE_PREFIX
                for p in pb.pieces(gated):
                    shard = loaded.get(prefix + p.name + suffix)
                    if shard is not None:
                        p.take(tensor).copy_(shard.data)
            pb.block.copy_(main[id(pb.param)])
        if bucketed and optimizer is not None:
            _load_bucketed(optimizer, blocks, main, state)
        elif not bucketed:
            chunk.start_param_sync(force_sync=True)  # optim_grads: gather the loaded blocks


def _restore_optimizer_common(optimizer, opt_param_scheduler, loaded, directory):
    groups = loaded.get("optimizer.param_groups")
    if groups is None or len(groups) != len(optimizer.optimizer.param_groups):
        raise CheckpointError(f"{directory}: the checkpoint's optimizer has "
                              f"{'no' if groups is None else len(groups)} param groups, this one has "
                              f"{len(optimizer.optimizer.param_groups)}: pass --no-load-optim")
    step = 0
    for group, saved in zip(optimizer.optimizer.param_groups, groups):
        step = int(saved.get("step", 0))
        group.update({k: v for k, v in saved.items() if k not in ("params", "step")})
    optimizer._inner_steps = step  # the per-parameter Adam steps are set with the state (_restore)
    scaler = getattr(optimizer, "grad_scaler", None)
    if scaler is not None and loaded.get("optimizer.grad_scaler") is not None:
        scaler.load_state_dict(loaded["optimizer.grad_scaler"])
    if opt_param_scheduler is not None and loaded.get("opt_param_scheduler") is not None:
        opt_param_scheduler.load_state_dict(loaded["opt_param_scheduler"])

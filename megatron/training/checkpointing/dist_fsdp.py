"""``--ckpt-format torch_dist`` of a model sharded by the FSDP2 engine (``--use-torch-fsdp2``).

The model part is the wrapper's ``sharded_state_dict()``: the keys, layer stacking, TP offsets and factories its
modules declare, every FSDP2-sharded parameter cut to the rows this rank holds
(megatron/core/distributed/fsdp/sharded_state.py). So the checkpoint is the one a DDP run writes (the same keys and
global tensors, in other chunks), and the two resume each other. The model tensors are the fp32 main weights (the
FSDP2 shards); with bf16 / fp16 parameters they are also written as ``optimizer.state.fp32_param.<key>``, Megatron's
master copy, so that a mixed-precision DDP run resumes the exact main weights. The optimizer state
(``optimizer.state.{exp_avg,exp_avg_sq}.<key>``, SGD's ``momentum_buffer``) has the parameters' pieces; the common
part (param groups, ``common_step``) is the fp32 optimizer's. On load the master copy, when the checkpoint has one
(``fp32_param``, or the distributed optimizer's ``param``), replaces the loaded weights, else the weights are it.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from megatron.training.checkpointing.dist_state import DistCheckpointError, restore_optimizer_common

MAIN_KINDS = ("fp32_param", "param")


def is_fully_sharded(model) -> bool:
    """Whether the (wrapped) model chunks are sharded by the FSDP2 engine."""
    return any(getattr(chunk, "uses_fully_shard", False) for chunk in model)


def _chunk(model):
    if len(model) != 1:
        raise DistCheckpointError("--ckpt-format torch_dist with FSDP2: one model chunk (pipeline parallelism is not "
                                  "supported with FSDP)")
    return model[0]


def _low_precision(chunk) -> bool:
    return getattr(getattr(chunk, "config", None), "params_dtype", torch.float32) in (torch.bfloat16, torch.float16)


def save_kinds(model, optimizer) -> List[str]:
    """The optimizer-state kinds a save writes."""
    return (["fp32_param"] if _low_precision(_chunk(model)) else []) + optimizer.state_kinds()


def load_kinds(optimizer, stored) -> List[str]:
    """The kinds a load reads: the state, and the master copy when the checkpoint has one."""
    main = [k for k in MAIN_KINDS if any(key.startswith(f"optimizer.state.{k}.") for key in stored)]
    return main[:1] + optimizer.state_kinds()


def _blocks(chunk, optimizer, kinds, create: bool) -> Dict[str, Dict[int, torch.Tensor]]:
    pieces = chunk.sharded_pieces()
    params = list({id(p.param): p.param for p in pieces}.values())
    blocks = optimizer.state_blocks(params, create)
    for kind in kinds:
        if kind in MAIN_KINDS:
            blocks[kind] = {id(p): p.to_local() for p in params}
    return pieces, blocks


def optimizer_sharded_state(model, optimizer, kinds, for_load: bool = False):
    """``{kind: {path: ShardedTensor}}`` (``path`` = ``model/<piece name>``) of the optimizer state with the pieces of
    the parameters; for a load the data are zeros of the same shapes."""
    pieces, blocks = _blocks(_chunk(model), optimizer, kinds, create=False)
    out = {}
    for kind in kinds:
        leaves = {}
        for piece in pieces:
            block = blocks[kind][id(piece.param)]
            leaves[f"model/{piece.name}"] = piece.leaf(torch.zeros_like(block) if for_load else block,
                                                       f"optimizer.state.{kind}.")
        out[kind] = leaves
    return out


def load_optimizer_state(model, optimizer, loaded: Dict[str, Dict[str, torch.Tensor]], common, kinds) -> None:
    """Restore the optimizer (and the master weights, see the module docstring) from ``loaded`` (what
    :func:`optimizer_sharded_state` asked for, read) and the common part."""
    restore_optimizer_common(optimizer, common)
    chunk = _chunk(model)
    pieces, blocks = _blocks(chunk, optimizer, kinds, create=True)
    with torch.no_grad():
        for kind in kinds:
            for piece in pieces:
                value = loaded.get(kind, {}).get(f"model/{piece.name}")
                if value is None:
                    raise DistCheckpointError(f"the checkpoint holds no optimizer.state.{kind} for "
                                              f"{piece.template.key}: pass --no-load-optim")
                piece.leaf(blocks[kind][id(piece.param)]).data.copy_(value)
    chunk.start_param_sync(force_sync=True)  # optim_grads: the loaded blocks gathered whole

"""Process-group builders of megatron-core's parallel_state beyond the plain rank grid (re-exported there).

* ``create_group``: ``torch.distributed.new_group`` with megatron-core's keywords.
* ``build_context_parallel_groups``: the combined groups of context parallelism, DP x CP (and its gloo twin),
  TP x CP, TP x DP, TP x DP x CP. With CP = 1 a group "with CP" is the group without it (no extra communicator).
* ``build_expert_groups``: the groups of the expert grid (tensor, model, tensor x model x pipeline, data over
  expert layers; :func:`megatron.core.rank_grid.expert_rank_generator`), built after the dense grid's.
* ``create_hierarchical_groups(rank, ranks, sizes)``: split ``ranks`` (``len(ranks) = prod(sizes)``) into
  levels. Level ``l`` groups ranks whose positions differ only in digit ``l`` of the mixed-radix number
  ``i = d_0 + s_0 (d_1 + s_1 (d_2 + ...))`` (``d_l < s_l``): member ``k`` of a level-``l`` group sits at position
  ``low + k * prod(s_<l) + high * prod(s_<=l)``. Example, 16 ranks, sizes ``[2, 2, 4]``: level 0 pairs
  ``[0, 1], [2, 3], ...``, level 1 pairs ``[0, 2], [1, 3], [4, 6], ...``, level 2 quadruples ``[0, 4, 8, 12], ...``.
  Returns this rank's group of each level (and their gloo twins, or None).
* ``create_hybrid_dp_cp_groups(rank, ranks)``: for every power of two ``g`` with ``2 <= g < len(ranks)`` (only
  those below ``2**floor(log2 len)``) the consecutive blocks ``ranks[i:i+g]``; returns ``{g: this rank's block}``.
  Hybrid context parallelism runs a sample on a block of ``g`` DP x CP ranks sized to its length.
* ``update_pg_timeout(timeout, pg=None)``: barrier on ``pg`` (the world when None), then set the collective
  timeout of ``pg``, or of every process group this rank belongs to.
* :class:`OptionalGroups` and :func:`build_optional_groups`: the groups ``initialize_model_parallel`` adds for
  several distributed-optimizer instances (``n``), a separate DP x CP all-gather group and hybrid CP. With ``n``
  instances the DP x CP group (size ``D``) splits into ``n`` consecutive intra-instance blocks of ``D / n``; each
  expert-DP group (size ``E``) splits hierarchically into ``[E / n, n]`` (intra-instance, inter-instance); one
  distributed-optimizer instance spans ``E / n`` consecutive expert tensor x model x pipeline groups.
"""
from __future__ import annotations

import dataclasses
import logging
from datetime import timedelta
from math import log2, prod
from typing import Dict, List, Optional, Sequence

import torch

from megatron.core.rank_grid import expert_rank_generator

logger = logging.getLogger(__name__)


def new_group(ranks: Sequence[int], timeout: Optional[timedelta], backend: Optional[str] = None):
    """``torch.distributed.new_group(ranks)`` with ``timeout`` / ``backend`` passed only when given."""
    kwargs = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if backend is not None:
        kwargs["backend"] = backend
    return torch.distributed.new_group(list(ranks), **kwargs)


def create_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
                 group_desc=None):
    """``torch.distributed.new_group`` with megatron-core's keywords (``group_desc`` names the group in torch's
    logs); collective over the world like ``new_group``."""
    kwargs = {"ranks": ranks, "backend": backend, "pg_options": pg_options,
              "use_local_synchronization": use_local_synchronization, "group_desc": group_desc}
    if timeout is not None:
        kwargs["timeout"] = timeout
    return torch.distributed.new_group(**kwargs)


def build_context_parallel_groups(build, cp: int, all_group_ranks: Dict[str, List[List[int]]],
                                  gloo_is_default: bool, base: Dict[str, object]) -> Dict[str, object]:
    """``build(kind, token, backend=None)`` creates every group of one kind of the dense grid and returns this rank's
    ``(group, ranks)``; ``base`` holds this rank's ``data`` (group, ranks), ``data_gloo``, ``tensor`` and ``amax``
    (TP x DP when ``use_fp8`` built it, else None) groups. Returns ``data_with_cp`` (group, ranks) and the
    ``data_with_cp_gloo``, ``tensor_and_context``, ``tensor_and_data``, ``tensor_and_data_with_cp`` groups."""
    out = {}
    if base["amax"] is not None:
        out["tensor_and_data"] = base["amax"]
        all_group_ranks["tensor_and_data"] = all_group_ranks["amax"]
    else:
        out["tensor_and_data"] = build("tensor_and_data", "tp-dp")[0]
    if cp == 1:
        out.update(data_with_cp=base["data"], data_with_cp_gloo=base["data_gloo"], tensor_and_context=base["tensor"],
                   tensor_and_data_with_cp=out["tensor_and_data"])
        for kind, same in (("data_with_cp", "data"), ("data_with_cp_gloo", "data_gloo"),
                           ("tensor_and_context", "tensor"), ("tensor_and_data_with_cp", "tensor_and_data")):
            all_group_ranks[kind] = [list(g) for g in all_group_ranks[same]]
        return out
    out["data_with_cp"] = build("data_with_cp", "dp-cp")
    if gloo_is_default:
        out["data_with_cp_gloo"] = out["data_with_cp"][0]
        all_group_ranks["data_with_cp_gloo"] = all_group_ranks["data_with_cp"]
    else:
        out["data_with_cp_gloo"] = build("data_with_cp_gloo", "dp-cp", backend="gloo")[0]
    out["tensor_and_context"] = build("tensor_and_context", "tp-cp")[0]
    out["tensor_and_data_with_cp"] = build("tensor_and_data_with_cp", "tp-dp-cp")[0]
    return out


def build_expert_groups(dense_gen, tp: int, pp: int, order: str, ep: int, etp: Optional[int], timeout,
                        all_group_ranks: Dict[str, List[List[int]]], gloo_is_default: bool):
    """Create every group of the expert grid (collective over the world); record each kind's rank lists in
    ``all_group_ranks``; return ``{kind: (this rank's group, its ranks)}``. The expert grid must keep the dense
    grid's pipeline groups (and, unless the order ends with ``pp``, its data-parallel size)."""
    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    gen = expert_rank_generator(world_size, tp, pp, ep, etp, order)
    if not order.endswith("pp") and pp > 1 and gen.sizes["dp"] != dense_gen.sizes["dp"]:
        raise RuntimeError("when the order does not end with 'pp', the data parallel sizes of the dense and the "
                           "expert layers must be equal")
    if gen.get_ranks("pp") != dense_gen.get_ranks("pp"):
        raise RuntimeError(f"pipeline groups differ between the dense ({dense_gen.get_ranks('pp')}) and the expert "
                           f"({gen.get_ranks('pp')}) layouts")
    out = {}
    for kind, token in (("expert_model", "ep"), ("expert_tensor", "tp"), ("expert_tensor_and_model", "tp-ep"),
                        ("expert_tensor_model_pipeline", "tp-ep-pp"), ("expert_data", "dp")):
        out[kind] = (None, None)
        all_group_ranks[kind] = gen.get_ranks(token)
        for ranks in all_group_ranks[kind]:
            group = new_group(ranks, timeout)
            if rank in ranks:
                out[kind] = (group, ranks)
    if gloo_is_default:
        out["expert_data_gloo"] = out["expert_data"]
        all_group_ranks["expert_data_gloo"] = all_group_ranks["expert_data"]
    else:
        out["expert_data_gloo"] = (None, None)
        for ranks in all_group_ranks["expert_data"]:
            group = new_group(ranks, timeout, backend="gloo")
            if rank in ranks:
                out["expert_data_gloo"] = (group, ranks)
        all_group_ranks["expert_data_gloo"] = all_group_ranks["expert_data"]
    return out


def overwrite_nccl_comm_cfgs(nccl_comm_cfgs, pg_name, key_value_pair):
    """Set ``nccl_comm_cfgs[pg_name][key] = value`` for ``key_value_pair = (key, value)`` (the per-group NCCL
    communicator settings of ``--nccl-communicator-config-path``), creating the group's entry when missing."""
    key, value = key_value_pair
    nccl_comm_cfgs.setdefault(pg_name, {})[key] = value


def _my_groups():
    """Every process group this rank belongs to (the default group first)."""
    world = torch.distributed.distributed_c10d._world
    groups = [torch.distributed.distributed_c10d._get_default_group()]
    return groups + [pg for pg in world.pg_map if pg is not groups[0]]


def update_pg_timeout(timeout: timedelta, pg: Optional[torch.distributed.ProcessGroup] = None):
    """Barrier on ``pg`` (None: the world), then make ``timeout`` the collective timeout of ``pg``, or, when ``pg``
    is None, of every process group this rank belongs to. A no-op on a torch without ``_set_pg_timeout``."""
    c10d = torch.distributed.distributed_c10d
    if not hasattr(c10d, "_set_pg_timeout"):
        return
    torch.distributed.barrier(pg)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    for group in ([pg] if pg is not None else _my_groups()):
        try:
            c10d._set_pg_timeout(timeout, group)
        except Exception:
            logger.error(f"Error updating pg timeout to {timeout} for process group {group} (pg argument: {pg})")
            raise


def hierarchical_rank_groups(ranks: Sequence[int], hierarchical_group_sizes: Sequence[int]) -> List[List[List[int]]]:
    """For each level, the groups of ``ranks`` at that level (module docstring); pure index arithmetic."""
    ranks = list(ranks)
    if prod(hierarchical_group_sizes) != len(ranks):
        raise ValueError(f"hierarchical group sizes {list(hierarchical_group_sizes)} do not multiply to the "
                         f"{len(ranks)} ranks {ranks}")
    levels = []
    for level, size in enumerate(hierarchical_group_sizes):
        stride = prod(hierarchical_group_sizes[:level])
        outer = prod(hierarchical_group_sizes[level + 1:])
        levels.append([[ranks[low + k * stride + high * stride * size] for k in range(size)]
                       for high in range(outer) for low in range(stride)])
    return levels


def create_hierarchical_groups(rank, ranks, hierarchical_group_sizes, create_gloo_process_groups=False,
                               pg_options=None, timeout=None, group_desc=None):
    """Create every group of every level of ``ranks`` (module docstring; collective over the world); return
    ``(groups, gloo_groups)``: this rank's group of each level, and its gloo twin (None without
    ``create_gloo_process_groups``). ``pg_options`` is one value or one per level."""
    if not isinstance(pg_options, list):
        pg_options = [pg_options] * len(hierarchical_group_sizes)
    groups, gloo_groups = [], []
    for level, sub_groups in enumerate(hierarchical_rank_groups(ranks, hierarchical_group_sizes)):
        for sub_ranks in sub_groups:
            group = create_group(sub_ranks, timeout=timeout, pg_options=pg_options[level],
                                 group_desc=f"HIERARCHICAL_{group_desc}_L{level}")
            gloo = None
            if create_gloo_process_groups:
                gloo = create_group(sub_ranks, timeout=timeout, backend="gloo", pg_options=pg_options[level],
                                    group_desc=f"HIERARCHICAL_{group_desc}_GLOO_L{level}")
            if rank in sub_ranks:
                groups.append(group)
                gloo_groups.append(gloo)
    if rank in ranks and len(groups) != len(hierarchical_group_sizes):
        raise AssertionError(f"rank {rank} got {len(groups)} hierarchical groups, expected "
                             f"{len(hierarchical_group_sizes)}")
    return groups, gloo_groups


def hybrid_dp_cp_group_sizes(num_ranks: int) -> List[int]:
    """The block sizes of :func:`create_hybrid_dp_cp_groups`: ``2, 4, ...`` below ``2**floor(log2 num_ranks)``."""
    return [2 ** i for i in range(1, int(log2(num_ranks)))] if num_ranks > 0 else []


def create_hybrid_dp_cp_groups(rank, ranks, pg_options):
    """Create the blocks of hybrid DP x CP (module docstring; collective over the world); return
    ``{block size: this rank's block group}``."""
    groups = {}
    for size in hybrid_dp_cp_group_sizes(len(ranks)):
        for start in range(0, len(ranks), size):
            block = list(ranks[start:start + size])
            group = create_group(block, pg_options=pg_options, group_desc=f"HYBRID_DP_CP_GROUP_{size}")
            if rank in block:
                if size in groups:
                    raise AssertionError(f"rank {rank} is in two hybrid DP x CP groups of size {size}")
                groups[size] = group
    return groups


@dataclasses.dataclass
class OptionalGroups:
    """This rank's groups from :func:`build_optional_groups` (None where not built)."""
    data_parallel_with_cp_ag: Optional[object] = None
    intra_partial_data_parallel_with_cp: Optional[object] = None
    intra_partial_data_parallel_with_cp_gloo: Optional[object] = None
    intra_partial_expert_data_parallel: Optional[object] = None
    intra_partial_expert_data_parallel_gloo: Optional[object] = None
    inter_partial_expert_data_parallel: Optional[object] = None
    intra_distributed_optimizer_instance: Optional[object] = None
    hybrid_dp_cp: Dict[int, object] = dataclasses.field(default_factory=dict)


def build_optional_groups(all_group_ranks: Dict[str, List[List[int]]], mine: Dict[str, object], timeout,
                          num_distributed_optimizer_instances: int = 1, create_all_gather_group: bool = False,
                          hybrid_context_parallel: bool = False, gloo_is_default: bool = True) -> OptionalGroups:
    """Build the optional groups (module docstring) from the rank lists of the grid's groups
    (``all_group_ranks``: ``data_with_cp``, ``expert_data``, ``expert_tensor_model_pipeline``) and this rank's
    existing groups (``mine``: ``data_with_cp``, ``data_with_cp_gloo``, ``expert_data``, ``expert_data_gloo``),
    which stand in when ``n = 1``. ``gloo_is_default``: the world runs gloo, so a group is its own gloo twin."""
    n = num_distributed_optimizer_instances
    rank = torch.distributed.get_rank()
    out = OptionalGroups()

    def gloo_twin(ranks, group):
        return group if gloo_is_default else new_group(ranks, timeout, backend="gloo")

    for ranks in all_group_ranks["data_with_cp"]:
        if len(ranks) % n:
            raise AssertionError(f"the data x context parallel size ({len(ranks)}) is not divisible by "
                                 f"num_distributed_optimizer_instances ({n})")
        if create_all_gather_group:
            group = new_group(ranks, timeout)
            if rank in ranks:
                out.data_parallel_with_cp_ag = group
        if n > 1:
            block = len(ranks) // n
            for i in range(n):
                sub = ranks[i * block:(i + 1) * block]
                group = new_group(sub, timeout)
                gloo = gloo_twin(sub, group)
                if rank in sub:
                    out.intra_partial_data_parallel_with_cp, out.intra_partial_data_parallel_with_cp_gloo = group, gloo
        if hybrid_context_parallel:
            if len(ranks) % 2:
                raise AssertionError(f"hybrid context parallelism needs an even data x context parallel size, "
                                     f"got {len(ranks)}")
            out.hybrid_dp_cp.update(create_hybrid_dp_cp_groups(rank, ranks, None))
    if n == 1:
        out.intra_partial_data_parallel_with_cp = mine["data_with_cp"]
        out.intra_partial_data_parallel_with_cp_gloo = mine["data_with_cp_gloo"]

    expert_dp = len(all_group_ranks["expert_data"][0])
    if expert_dp % n:
        raise AssertionError(f"the expert data parallel size ({expert_dp}) is not divisible by "
                             f"num_distributed_optimizer_instances ({n})")
    intra = expert_dp // n
    if n > 1:
        for ranks in all_group_ranks["expert_data"]:
            groups, gloo = create_hierarchical_groups(rank, ranks, [intra, n], timeout=timeout,
                                                      group_desc="EXPERT_DATA_PARALLEL_GROUP",
                                                      create_gloo_process_groups=not gloo_is_default)
            if rank in ranks:
                out.intra_partial_expert_data_parallel, out.inter_partial_expert_data_parallel = groups
                out.intra_partial_expert_data_parallel_gloo = gloo[0] if not gloo_is_default else groups[0]
    else:
        out.intra_partial_expert_data_parallel = mine["expert_data"]
        out.intra_partial_expert_data_parallel_gloo = mine["expert_data_gloo"]

    model_groups = all_group_ranks["expert_tensor_model_pipeline"]
    for start in range(0, len(model_groups) - intra + 1, intra):
        ranks = [r for g in model_groups[start:start + intra] for r in g]
        group = new_group(ranks, timeout)
        if rank in ranks:
            out.intra_distributed_optimizer_instance = group
    return out

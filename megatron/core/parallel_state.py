"""Model and data parallel process groups (megatron.core.parallel_state).

``initialize_model_parallel`` creates every group of the dense grid (tensor, context, expert-free data,
pipeline, and their combinations) and of the expert grid on every rank and keeps this rank's own; the
getters below return them. Which ranks form each group (the rank grid, with worked examples for TP/PP,
experts and context parallelism) is :mod:`megatron.core.rank_grid`, re-exported here.

The ``set_*`` overrides (``_MPU_*`` globals) take precedence over group queries: tools that build a model
for one rank of a layout without a process group use them.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Dict, List, Optional, Sequence

import torch

from megatron.core.rank_grid import (RankGenerator, default_embedding_ranks, default_position_embedding_ranks,  # noqa
                                     embedding_ranks_of, expert_rank_generator, generate_masked_orthogonal_rank_groups)
from megatron.core.global_memory_buffer import GlobalMemoryBuffer
from megatron.core.parallel_groups_extra import (OptionalGroups, build_context_parallel_groups,  # noqa
                                                 build_expert_groups, build_optional_groups, create_group,
                                                 create_hierarchical_groups, create_hybrid_dp_cp_groups,
                                                 new_group as _new_group, overwrite_nccl_comm_cfgs,
                                                 update_pg_timeout)

# Process groups of this rank.
_TENSOR_MODEL_PARALLEL_GROUP = None
_PIPELINE_MODEL_PARALLEL_GROUP = None
_MODEL_PARALLEL_GROUP = None
_EMBEDDING_GROUP = None
_POSITION_EMBEDDING_GROUP = None
_DATA_PARALLEL_GROUP = None
_DATA_PARALLEL_GROUP_GLOO = None
_CONTEXT_PARALLEL_GROUP = None
_AMAX_REDUCTION_GROUP = None
# Context-parallel groups (see the module docstring): DP x CP and its gloo twin, TP x CP, TP x DP (x CP).
_DATA_PARALLEL_GROUP_WITH_CP = None
_DATA_PARALLEL_GROUP_WITH_CP_GLOO = None
_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP = None
_TENSOR_AND_CONTEXT_PARALLEL_GROUP = None
_TENSOR_AND_DATA_PARALLEL_GROUP = None
_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP = None

# Expert (mixture-of-experts) groups of this rank, from the expert grid (see the module docstring).
_EXPERT_MODEL_PARALLEL_GROUP = None
_EXPERT_MODEL_PARALLEL_RANKS = None
_EXPERT_TENSOR_PARALLEL_GROUP = None
_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP = None
_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP = None
_EXPERT_DATA_PARALLEL_GROUP = None
_EXPERT_DATA_PARALLEL_GROUP_GLOO = None
_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE = None
_MPU_EXPERT_MODEL_PARALLEL_RANK = None
_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE = None
_MPU_EXPERT_TENSOR_PARALLEL_RANK = None

# Rank lists of this rank's groups (for queries that need global ranks, and the group table).
_EMBEDDING_GLOBAL_RANKS = None
_POSITION_EMBEDDING_GLOBAL_RANKS = None
_PIPELINE_GLOBAL_RANKS = None
_DATA_PARALLEL_GLOBAL_RANKS = None
_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = None
_CONTEXT_PARALLEL_GLOBAL_RANKS = None
_ALL_GROUP_RANKS: Dict[str, List[List[int]]] = {}

_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = None
_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = None
_PIPELINE_MODEL_PARALLEL_SPLIT_RANK = None

# Overrides used by --lazy-mpu-init and offline tools.
_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = None
_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = None
_MPU_TENSOR_MODEL_PARALLEL_RANK = None
_MPU_PIPELINE_MODEL_PARALLEL_RANK = None
_MPU_DATA_PARALLEL_RANK = None

_GLOBAL_MEMORY_BUFFER = None
# Groups of several distributed-optimizer instances, the DP x CP all-gather group, hybrid CP (parallel_groups_extra).
_OPTIONAL_GROUPS = None

# The state above that starts as None (groups, rank lists, overrides, memory buffer): destroy_model_parallel resets it.
_STATE = tuple(name for name, value in list(globals().items())
               if name.startswith("_") and name.isupper() and value is None)

# Backends whose groups already run CPU collectives: their groups double as the "gloo" twins (the fake backend of
# --fake-process-group has no peers to rendezvous with, so it cannot create real gloo groups).
_CPU_BACKENDS = ("gloo", "fake")


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_split_rank: Optional[int] = None,
    use_fp8: bool = False,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[List[int]] = None,
    order: str = "tp-cp-ep-dp-pp",
    distributed_timeout_minutes: Optional[float] = None,
    *,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    num_distributed_optimizer_instances: int = 1,
    hybrid_context_parallel: bool = False,
    create_all_gather_group: Optional[bool] = False,
) -> None:
    """Create the tensor, pipeline, data, context, model, embedding and position-embedding groups, and the
    combined groups of context parallelism (DP x CP with its gloo twin, TP x CP, TP x DP, TP x DP x CP).

    Must be called on every rank after ``torch.distributed.init_process_group``. ``context_parallel_size``
    and ``order`` shape the rank grid as in megatron-core. ``hierarchical_context_parallel_sizes`` (the
    a2a+p2p communication of Transformer Engine) is not implemented and raises ``NotImplementedError``.
    ``expert_model_parallel_size`` (EP) and ``expert_tensor_parallel_size`` (ETP, default TP) shape the expert grid
    (module docstring). ``num_distributed_optimizer_instances``, ``create_all_gather_group`` and
    ``hybrid_context_parallel`` add the groups of :mod:`megatron.core.parallel_groups_extra`.
    """
    global _TENSOR_MODEL_PARALLEL_GROUP, _PIPELINE_MODEL_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP
    global _EMBEDDING_GROUP, _POSITION_EMBEDDING_GROUP, _DATA_PARALLEL_GROUP, _DATA_PARALLEL_GROUP_GLOO
    global _CONTEXT_PARALLEL_GROUP, _AMAX_REDUCTION_GROUP
    global _EMBEDDING_GLOBAL_RANKS, _POSITION_EMBEDDING_GLOBAL_RANKS, _PIPELINE_GLOBAL_RANKS
    global _DATA_PARALLEL_GLOBAL_RANKS, _TENSOR_MODEL_PARALLEL_GLOBAL_RANKS, _CONTEXT_PARALLEL_GLOBAL_RANKS
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK, _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    global _PIPELINE_MODEL_PARALLEL_SPLIT_RANK, _GLOBAL_MEMORY_BUFFER, _ALL_GROUP_RANKS, _OPTIONAL_GROUPS
    global _DATA_PARALLEL_GROUP_WITH_CP, _DATA_PARALLEL_GROUP_WITH_CP_GLOO, _DATA_PARALLEL_GLOBAL_RANKS_WITH_CP
    global _TENSOR_AND_CONTEXT_PARALLEL_GROUP, _TENSOR_AND_DATA_PARALLEL_GROUP, _TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP

    if hierarchical_context_parallel_sizes:
        raise NotImplementedError("hierarchical context parallelism (hierarchical_context_parallel_sizes, "
                                  "--cp-comm-type a2a+p2p) is not implemented in this library")
    if not torch.distributed.is_initialized():
        raise AssertionError("initialize_model_parallel needs torch.distributed.init_process_group to be called first")
    if _DATA_PARALLEL_GROUP is not None or _TENSOR_MODEL_PARALLEL_GROUP is not None:
        raise AssertionError("model parallel groups are already initialized: call destroy_model_parallel() first")

    world_size = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    if tp < 1 or pp < 1 or cp < 1:
        raise RuntimeError(f"tensor ({tp}), pipeline ({pp}) and context ({cp}) parallel sizes must be >= 1")
    if world_size % (tp * pp * cp) != 0:
        raise RuntimeError(
            f"world_size ({world_size}) is not divisible by tensor_model_parallel_size ({tp}) "
            f"x pipeline_model_parallel_size ({pp})"
            + (f" x context_parallel_size ({cp})" if cp > 1 else "")
        )
    dp = world_size // (tp * pp * cp)

    if virtual_pipeline_model_parallel_size is not None:
        if not pp > 2:
            raise RuntimeError(
                "pipeline-model-parallel size should be greater than 2 with interleaved schedule "
                f"(virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size}, "
                f"pipeline_model_parallel_size={pp})"
            )
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = virtual_pipeline_model_parallel_size

    if pipeline_model_parallel_split_rank is not None:
        if not 0 <= pipeline_model_parallel_split_rank < pp:
            raise RuntimeError(
                f"pipeline_model_parallel_split_rank ({pipeline_model_parallel_split_rank}) must be in [0, {pp})"
            )
        _PIPELINE_MODEL_PARALLEL_SPLIT_RANK = pipeline_model_parallel_split_rank

    timeout = timedelta(minutes=distributed_timeout_minutes) if distributed_timeout_minutes is not None else None
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    _ALL_GROUP_RANKS = {}

    def build(kind: str, token: str, backend: Optional[str] = None):
        """Create every group of one kind; return (my group, my ranks)."""
        mine = None
        groups = gen.get_ranks(token)
        for ranks in groups:
            group = _new_group(ranks, timeout, backend)
            if rank in ranks:
                mine = (group, ranks)
        _ALL_GROUP_RANKS[kind] = groups
        return mine

    _DATA_PARALLEL_GROUP, _DATA_PARALLEL_GLOBAL_RANKS = build("data", "dp")
    # A gloo twin of the DP group, for CPU-side collectives (e.g. distributed-optimizer checkpointing).
    if torch.distributed.get_backend() in _CPU_BACKENDS:
        _DATA_PARALLEL_GROUP_GLOO = _DATA_PARALLEL_GROUP
        _ALL_GROUP_RANKS["data_gloo"] = _ALL_GROUP_RANKS["data"]
    else:
        _DATA_PARALLEL_GROUP_GLOO, _ = build("data_gloo", "dp", backend="gloo")
    _CONTEXT_PARALLEL_GROUP, _CONTEXT_PARALLEL_GLOBAL_RANKS = build("context", "cp")
    _MODEL_PARALLEL_GROUP, _ = build("model", "tp-pp")
    _TENSOR_MODEL_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = build("tensor", "tp")
    _PIPELINE_MODEL_PARALLEL_GROUP, _PIPELINE_GLOBAL_RANKS = build("pipeline", "pp")

    embedding_groups, position_groups = [], []
    for ranks in _ALL_GROUP_RANKS["pipeline"]:
        emb, pos = embedding_ranks_of(ranks, pipeline_model_parallel_split_rank)
        embedding_groups.append(emb)
        position_groups.append(pos)
        group = _new_group(emb, timeout)
        if rank in emb:
            _EMBEDDING_GROUP, _EMBEDDING_GLOBAL_RANKS = group, emb
        group = _new_group(pos, timeout)
        if rank in pos:
            _POSITION_EMBEDDING_GROUP, _POSITION_EMBEDDING_GLOBAL_RANKS = group, pos
    _ALL_GROUP_RANKS["embedding"] = embedding_groups
    _ALL_GROUP_RANKS["position_embedding"] = position_groups

    if use_fp8:
        _AMAX_REDUCTION_GROUP, _ = build("amax", "tp-dp")

    # Mixture-of-experts groups: a second grid over the same world (kept in its own function).
    gloo_is_default = torch.distributed.get_backend() in _CPU_BACKENDS
    _initialize_expert_groups(build_expert_groups(gen, tp, pp, order, expert_model_parallel_size,
                                                  expert_tensor_parallel_size, timeout, _ALL_GROUP_RANKS,
                                                  gloo_is_default))

    if use_sharp:
        # SHARP is an NCCL/InfiniBand feature; only meaningful with NCCL.
        import os

        torch.distributed.barrier(group=_DATA_PARALLEL_GROUP)
        os.environ["NCCL_SHARP_DISABLE"] = "1"

    groups = build_context_parallel_groups(build, cp, _ALL_GROUP_RANKS, gloo_is_default, {
        "data": (_DATA_PARALLEL_GROUP, _DATA_PARALLEL_GLOBAL_RANKS), "data_gloo": _DATA_PARALLEL_GROUP_GLOO,
        "tensor": _TENSOR_MODEL_PARALLEL_GROUP, "amax": _AMAX_REDUCTION_GROUP})
    _DATA_PARALLEL_GROUP_WITH_CP, _DATA_PARALLEL_GLOBAL_RANKS_WITH_CP = groups["data_with_cp"]
    _DATA_PARALLEL_GROUP_WITH_CP_GLOO = groups["data_with_cp_gloo"]
    _TENSOR_AND_CONTEXT_PARALLEL_GROUP = groups["tensor_and_context"]
    _TENSOR_AND_DATA_PARALLEL_GROUP = groups["tensor_and_data"]
    _TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP = groups["tensor_and_data_with_cp"]
    mine = {"data_with_cp": _DATA_PARALLEL_GROUP_WITH_CP, "data_with_cp_gloo": _DATA_PARALLEL_GROUP_WITH_CP_GLOO,
            "expert_data": _EXPERT_DATA_PARALLEL_GROUP, "expert_data_gloo": _EXPERT_DATA_PARALLEL_GROUP_GLOO}
    _OPTIONAL_GROUPS = build_optional_groups(
        _ALL_GROUP_RANKS, mine, timeout, num_distributed_optimizer_instances, create_all_gather_group,
        hybrid_context_parallel, gloo_is_default)
    _GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()


def _initialize_expert_groups(groups) -> None:
    """Keep this rank's expert groups (``{kind: (group, ranks)}`` of ``build_expert_groups``)."""
    global _EXPERT_MODEL_PARALLEL_GROUP, _EXPERT_MODEL_PARALLEL_RANKS, _EXPERT_TENSOR_PARALLEL_GROUP
    global _EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP, _EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP
    global _EXPERT_DATA_PARALLEL_GROUP, _EXPERT_DATA_PARALLEL_GROUP_GLOO
    _EXPERT_MODEL_PARALLEL_GROUP, _EXPERT_MODEL_PARALLEL_RANKS = groups["expert_model"]
    _EXPERT_TENSOR_PARALLEL_GROUP = groups["expert_tensor"][0]
    _EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP = groups["expert_tensor_and_model"][0]
    _EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP = groups["expert_tensor_model_pipeline"][0]
    _EXPERT_DATA_PARALLEL_GROUP = groups["expert_data"][0]
    _EXPERT_DATA_PARALLEL_GROUP_GLOO = groups["expert_data_gloo"][0]


# ----------------------------------------------------------------------------------------- status

def is_unitialized() -> bool:
    """True if the data-parallel group is not set (Megatron's spelling kept)."""
    return _DATA_PARALLEL_GROUP is None


is_uninitialized = is_unitialized


def model_parallel_is_initialized() -> bool:
    return not (_TENSOR_MODEL_PARALLEL_GROUP is None or _PIPELINE_MODEL_PARALLEL_GROUP is None
                or _DATA_PARALLEL_GROUP is None)


def is_initialized() -> bool:
    return _DATA_PARALLEL_GROUP is not None


def get_all_group_ranks() -> Dict[str, List[List[int]]]:
    """Every group of every kind, as lists of global ranks (for logs and sanity checks)."""
    return {kind: [list(g) for g in groups] for kind, groups in _ALL_GROUP_RANKS.items()}


# ----------------------------------------------------------------------------------------- groups

def _checked(group, name: str, check_initialized: bool = True):
    if check_initialized and group is None:
        raise AssertionError(f"{name} group is not initialized: call parallel_state.initialize_model_parallel() first")
    return group


def get_model_parallel_group():
    return _checked(_MODEL_PARALLEL_GROUP, "model parallel")


def get_tensor_model_parallel_group(check_initialized: bool = True):
    return _checked(_TENSOR_MODEL_PARALLEL_GROUP, "tensor model parallel", check_initialized)


def get_pipeline_model_parallel_group():
    return _checked(_PIPELINE_MODEL_PARALLEL_GROUP, "pipeline_model parallel")


def _optional(field: str, name: str, check_initialized: bool = True):
    return _checked(getattr(_OPTIONAL_GROUPS, field, None), name, check_initialized)


def get_data_parallel_group(with_context_parallel: bool = False, partial_data_parallel: bool = False,
                            independent_all_gather: bool = False):
    """The DP group; ``with_context_parallel``: DP x CP (gradient reduction, distributed optimizer, loss), or its
    block of one distributed-optimizer instance (``partial_data_parallel``), or its separate all-gather twin
    (``independent_all_gather``, built with ``create_all_gather_group``)."""
    if not with_context_parallel:
        if partial_data_parallel:
            raise AssertionError("Partial DP for Optimizer needs to include CP")
        return _checked(_DATA_PARALLEL_GROUP, "data parallel")
    if partial_data_parallel:
        return _optional("intra_partial_data_parallel_with_cp", "intra partial data parallel")
    if independent_all_gather:
        return _optional("data_parallel_with_cp_ag", "data parallel with context parallel all-gather")
    return _checked(_DATA_PARALLEL_GROUP_WITH_CP, "data parallel with context parallel")


def has_separate_all_gather_group() -> bool:
    """True when ``initialize_model_parallel(create_all_gather_group=True)`` built a DP x CP all-gather group."""
    return getattr(_OPTIONAL_GROUPS, "data_parallel_with_cp_ag", None) is not None


def get_data_parallel_group_gloo(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    """A gloo group with the ranks of :func:`get_data_parallel_group` (the same group on a gloo world)."""
    if not with_context_parallel:
        if partial_data_parallel:
            raise AssertionError("Partial DP for Optimizer needs to include CP")
        return _checked(_DATA_PARALLEL_GROUP_GLOO, "data parallel gloo")
    if partial_data_parallel:
        return _optional("intra_partial_data_parallel_with_cp_gloo", "intra partial data parallel gloo")
    return _checked(_DATA_PARALLEL_GROUP_WITH_CP_GLOO, "data parallel gloo with context parallel")


def get_hybrid_data_context_parallel_groups(check_initialized: bool = True, group_size=None):
    """This rank's hybrid-CP block of ``group_size`` DP x CP ranks (``hybrid_context_parallel``); the whole DP x CP
    group when ``group_size`` is its size."""
    if get_data_parallel_world_size(with_context_parallel=True) == group_size:
        return _checked(_DATA_PARALLEL_GROUP_WITH_CP, "data parallel with context parallel", check_initialized)
    groups = getattr(_OPTIONAL_GROUPS, "hybrid_dp_cp", {})
    if group_size not in groups:
        raise KeyError(f"no hybrid data x context parallel group of size {group_size} (built: {sorted(groups)}; "
                       "initialize_model_parallel(hybrid_context_parallel=True) builds them)")
    return groups[group_size]


def get_context_parallel_group(check_initialized: bool = True):
    return _checked(_CONTEXT_PARALLEL_GROUP, "context parallel", check_initialized)


def get_context_parallel_global_ranks(check_initialized: bool = True):
    """Global ranks of this rank's CP group, in CP-rank order (the ring order of the p2p attention)."""
    return _checked(_CONTEXT_PARALLEL_GLOBAL_RANKS, "context parallel", check_initialized)


def get_hierarchical_context_parallel_groups(check_initialized: bool = True):
    """Hierarchical CP (a2a+p2p) is not implemented: always raises ``NotImplementedError``."""
    raise NotImplementedError("hierarchical context parallelism (--hierarchical-context-parallel-sizes, "
                              "--cp-comm-type a2a+p2p) is not implemented in this library")


def get_tensor_and_context_parallel_group(check_initialized: bool = True):
    return _checked(_TENSOR_AND_CONTEXT_PARALLEL_GROUP, "tensor and context parallel", check_initialized)


def get_tensor_and_data_parallel_group(check_initialized: bool = True, with_context_parallel: bool = False):
    if with_context_parallel:
        return _checked(_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP, "tensor and data parallel with context parallel",
                        check_initialized)
    return _checked(_TENSOR_AND_DATA_PARALLEL_GROUP, "tensor and data parallel", check_initialized)


def get_embedding_group():
    return _checked(_EMBEDDING_GROUP, "embedding")


def get_position_embedding_group():
    return _checked(_POSITION_EMBEDDING_GROUP, "position embedding")


def get_amax_reduction_group(with_context_parallel: bool = False, tp_only_amax_red: bool = False):
    """FP8 amax group: TP x DP (the group built with ``use_fp8``); ``with_context_parallel``: TP x DP x CP;
    ``tp_only_amax_red``: TP (or TP x CP with ``with_context_parallel``)."""
    if tp_only_amax_red:
        return (get_tensor_and_context_parallel_group() if with_context_parallel
                else get_tensor_model_parallel_group())
    if with_context_parallel:
        return _checked(_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP, "FP8 amax reduction")
    return _checked(_AMAX_REDUCTION_GROUP, "FP8 amax reduction")


# ---------------------------------------------------------------------------------- sizes and ranks

def set_tensor_model_parallel_world_size(world_size):
    global _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_pipeline_model_parallel_world_size(world_size):
    global _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_tensor_model_parallel_rank(rank):
    global _MPU_TENSOR_MODEL_PARALLEL_RANK
    _MPU_TENSOR_MODEL_PARALLEL_RANK = rank


def set_pipeline_model_parallel_rank(rank):
    global _MPU_PIPELINE_MODEL_PARALLEL_RANK
    _MPU_PIPELINE_MODEL_PARALLEL_RANK = rank


def set_pipeline_model_parallel_split_rank(rank):
    global _PIPELINE_MODEL_PARALLEL_SPLIT_RANK
    _PIPELINE_MODEL_PARALLEL_SPLIT_RANK = rank


def get_tensor_model_parallel_world_size() -> int:
    if _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    return torch.distributed.get_world_size(group=get_tensor_model_parallel_group())


def get_pipeline_model_parallel_world_size() -> int:
    if _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    return torch.distributed.get_world_size(group=get_pipeline_model_parallel_group())


def get_tensor_model_parallel_rank() -> int:
    if _MPU_TENSOR_MODEL_PARALLEL_RANK is not None:
        return _MPU_TENSOR_MODEL_PARALLEL_RANK
    return torch.distributed.get_rank(group=get_tensor_model_parallel_group())


def get_pipeline_model_parallel_rank() -> int:
    if _MPU_PIPELINE_MODEL_PARALLEL_RANK is not None:
        return _MPU_PIPELINE_MODEL_PARALLEL_RANK
    return torch.distributed.get_rank(group=get_pipeline_model_parallel_group())


def get_pipeline_model_parallel_split_rank():
    return _PIPELINE_MODEL_PARALLEL_SPLIT_RANK


def get_context_parallel_world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized() and _CONTEXT_PARALLEL_GROUP is not None:
        return torch.distributed.get_world_size(group=_CONTEXT_PARALLEL_GROUP)
    return 1


def get_context_parallel_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized() and _CONTEXT_PARALLEL_GROUP is not None:
        return torch.distributed.get_rank(group=_CONTEXT_PARALLEL_GROUP)
    return 0


def get_data_parallel_world_size(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    """Size of this rank's DP (or DP x CP) group; 0 when torch.distributed is not initialized (as Megatron)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(
            group=get_data_parallel_group(with_context_parallel, partial_data_parallel))
    return 0


def set_data_parallel_rank(rank):
    """Override what ``get_data_parallel_rank`` returns (``None`` clears it; ``destroy_model_parallel`` too)."""
    global _MPU_DATA_PARALLEL_RANK
    _MPU_DATA_PARALLEL_RANK = rank


def get_data_parallel_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    """Rank in the DP (or DP x CP: ``cp_rank + CP * dp_rank``) group; 0 without torch.distributed; the value of
    ``set_data_parallel_rank`` when one was set."""
    if _MPU_DATA_PARALLEL_RANK is not None:
        return _MPU_DATA_PARALLEL_RANK
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=get_data_parallel_group(with_context_parallel, partial_data_parallel))
    return 0


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """The global rank of the first member of this rank's DP (or DP x CP) group."""
    ranks = _DATA_PARALLEL_GLOBAL_RANKS_WITH_CP if with_context_parallel else _DATA_PARALLEL_GLOBAL_RANKS
    if ranks is None:
        raise AssertionError("data parallel group is not initialized")
    return ranks[0]


def get_tensor_and_context_parallel_world_size() -> int:
    """TP x CP: 0 when torch.distributed is not initialized (as Megatron)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(group=get_tensor_and_context_parallel_group())
    return 0


def get_tensor_and_context_parallel_rank() -> int:
    """Rank in the TP x CP group (``tp_rank + TP * cp_rank``); 0 without torch.distributed."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=get_tensor_and_context_parallel_group())
    return 0


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of TP rank 0 of this rank's TP group (TP groups are contiguous blocks)."""
    global_rank = torch.distributed.get_rank()
    local_world_size = get_tensor_model_parallel_world_size()
    return (global_rank // local_world_size) * local_world_size


def get_model_parallel_src_rank() -> int:
    return get_tensor_model_parallel_src_rank()


# -------------------------------------------------------------------------------------- pipeline

def _pipeline_ranks():
    if _PIPELINE_GLOBAL_RANKS is None:
        raise AssertionError("pipeline parallel group is not initialized")
    return _PIPELINE_GLOBAL_RANKS


def get_pipeline_model_parallel_first_rank() -> int:
    return _pipeline_ranks()[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _pipeline_ranks()[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _pipeline_ranks()
    return ranks[(get_pipeline_model_parallel_rank() + 1) % get_pipeline_model_parallel_world_size()]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _pipeline_ranks()
    return ranks[(get_pipeline_model_parallel_rank() - 1) % get_pipeline_model_parallel_world_size()]


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """True on the first pipeline stage (and, unless ``ignore_virtual``, on its first virtual chunk)."""
    if not ignore_virtual:
        if (get_virtual_pipeline_model_parallel_world_size() is not None
                and get_virtual_pipeline_model_parallel_rank() != 0):
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """True on the last pipeline stage (and, unless ``ignore_virtual``, on its last virtual chunk)."""
    if not ignore_virtual:
        vpp = get_virtual_pipeline_model_parallel_world_size()
        if vpp is not None and get_virtual_pipeline_model_parallel_rank() != vpp - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual: bool = False) -> bool:
    rank = torch.distributed.get_rank()
    ranks = _EMBEDDING_GLOBAL_RANKS or []
    if ignore_virtual:
        return rank in ranks
    if rank in ranks:
        if rank == ranks[0]:
            return is_pipeline_first_stage(ignore_virtual=False)
        if rank == ranks[-1]:
            return is_pipeline_last_stage(ignore_virtual=False)
        return True
    return False


def is_rank_in_position_embedding_group() -> bool:
    return torch.distributed.get_rank() in (_POSITION_EMBEDDING_GLOBAL_RANKS or [])


def is_pipeline_stage_before_split(rank=None) -> bool:
    """True if the stage executes the encoder (before the split rank) of an encoder-decoder model."""
    if get_pipeline_model_parallel_world_size() == 1:
        return True
    if rank is None:
        rank = get_pipeline_model_parallel_rank()
    if _PIPELINE_MODEL_PARALLEL_SPLIT_RANK is None:
        return True
    return rank < _PIPELINE_MODEL_PARALLEL_SPLIT_RANK


def is_pipeline_stage_after_split(rank=None) -> bool:
    """True if the stage executes the decoder (at or after the split rank) of an encoder-decoder model."""
    if get_pipeline_model_parallel_world_size() == 1:
        return True
    if rank is None:
        rank = get_pipeline_model_parallel_rank()
    if _PIPELINE_MODEL_PARALLEL_SPLIT_RANK is None:
        return True
    return rank >= _PIPELINE_MODEL_PARALLEL_SPLIT_RANK


def is_pipeline_stage_at_split() -> bool:
    """True if this stage is the last encoder stage and the next is the first decoder stage."""
    rank = get_pipeline_model_parallel_rank()
    return is_pipeline_stage_before_split(rank) and is_pipeline_stage_after_split(rank + 1)


def get_virtual_pipeline_model_parallel_rank():
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK


def set_virtual_pipeline_model_parallel_rank(rank):
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = rank


def get_virtual_pipeline_model_parallel_world_size():
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE


def set_virtual_pipeline_model_parallel_world_size(world_size):
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = world_size


# ---------------------------------------------------------------------------------------- experts

def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def get_expert_model_parallel_group(check_initialized: bool = True):
    return _checked(_EXPERT_MODEL_PARALLEL_GROUP, "expert model parallel", check_initialized)


def get_expert_model_parallel_src_rank() -> int:
    """Global rank of the first member of this rank's expert-model-parallel group."""
    if _EXPERT_MODEL_PARALLEL_RANKS is None:
        raise AssertionError("expert model parallel group is not initialized")
    return _EXPERT_MODEL_PARALLEL_RANKS[0]


def get_expert_model_parallel_world_size() -> int:
    if _MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE
    if _dist_ready():
        return torch.distributed.get_world_size(group=get_expert_model_parallel_group())
    return 0


def set_expert_model_parallel_world_size(world_size):
    global _MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE
    _MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE = world_size


def get_expert_model_parallel_rank() -> int:
    if _MPU_EXPERT_MODEL_PARALLEL_RANK is not None:
        return _MPU_EXPERT_MODEL_PARALLEL_RANK
    if _dist_ready():
        return torch.distributed.get_rank(group=get_expert_model_parallel_group())
    return 0


def set_expert_model_parallel_rank(rank):
    global _MPU_EXPERT_MODEL_PARALLEL_RANK
    _MPU_EXPERT_MODEL_PARALLEL_RANK = rank


def get_expert_tensor_parallel_group(check_initialized: bool = True):
    return _checked(_EXPERT_TENSOR_PARALLEL_GROUP, "expert tensor parallel", check_initialized)


def get_expert_tensor_parallel_world_size():
    """Size of the expert-TP group; without one, the TP override (as megatron-core, for offline tools)."""
    if _MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE is not None:
        return _MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE
    if _EXPERT_TENSOR_PARALLEL_GROUP is None:
        return _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    return torch.distributed.get_world_size(group=_EXPERT_TENSOR_PARALLEL_GROUP)


def set_expert_tensor_parallel_world_size(world_size):
    global _MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE
    _MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE = world_size


def get_expert_tensor_parallel_rank():
    if _MPU_EXPERT_TENSOR_PARALLEL_RANK is not None:
        return _MPU_EXPERT_TENSOR_PARALLEL_RANK
    if _EXPERT_TENSOR_PARALLEL_GROUP is None:
        return _MPU_TENSOR_MODEL_PARALLEL_RANK
    return torch.distributed.get_rank(group=_EXPERT_TENSOR_PARALLEL_GROUP)


def set_expert_tensor_parallel_rank(rank):
    global _MPU_EXPERT_TENSOR_PARALLEL_RANK
    _MPU_EXPERT_TENSOR_PARALLEL_RANK = rank


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True):
    return _checked(_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP, "expert tensor and model parallel", check_initialized)


def get_expert_tensor_and_model_parallel_world_size() -> int:
    if _dist_ready():
        return torch.distributed.get_world_size(group=get_expert_tensor_and_model_parallel_group())
    return 0


def get_expert_tensor_and_model_parallel_rank() -> int:
    if _dist_ready():
        return torch.distributed.get_rank(group=get_expert_tensor_and_model_parallel_group())
    return 0


def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool = True):
    return _checked(_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP, "expert tensor-model-pipeline parallel",
                    check_initialized)


def get_expert_data_parallel_group(check_initialized: bool = True, partial_expert_data_parallel: bool = False):
    """The expert-data-parallel group, or its block of one distributed-optimizer instance."""
    if partial_expert_data_parallel:
        return _optional("intra_partial_expert_data_parallel", "intra partial expert data parallel",
                         check_initialized)
    return _checked(_EXPERT_DATA_PARALLEL_GROUP, "expert data parallel", check_initialized)


def get_data_modulo_expert_parallel_group(partial_expert_data_parallel: bool = False):
    """Deprecated megatron-core name of :func:`get_expert_data_parallel_group`."""
    import warnings

    warnings.warn("get_data_modulo_expert_parallel_group is deprecated, please use get_expert_data_parallel_group "
                  "instead.", DeprecationWarning)
    return get_expert_data_parallel_group(partial_expert_data_parallel=partial_expert_data_parallel)


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel: bool = False):
    if partial_expert_data_parallel:
        return _optional("intra_partial_expert_data_parallel_gloo", "intra partial expert data parallel gloo")
    return _checked(_EXPERT_DATA_PARALLEL_GROUP_GLOO, "expert data parallel gloo")


def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
    if _dist_ready():
        return torch.distributed.get_rank(group=get_expert_data_parallel_group(
            partial_expert_data_parallel=partial_expert_data_parallel))
    return 0


def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
    if _dist_ready():
        return torch.distributed.get_world_size(group=get_expert_data_parallel_group(
            partial_expert_data_parallel=partial_expert_data_parallel))
    return 0


def get_intra_distributed_optimizer_instance_group(check_initialized: bool = True):
    """All ranks of this rank's distributed-optimizer instance (the whole world with one instance)."""
    return _optional("intra_distributed_optimizer_instance", "intra distributed optimizer instance",
                     check_initialized)


def get_inter_distributed_optimizer_instance_group(check_initialized: bool = True):
    """The ranks holding the same shard in the different distributed-optimizer instances (built only with
    ``num_distributed_optimizer_instances > 1``; attention and experts share it)."""
    return _optional("inter_partial_expert_data_parallel", "inter distributed optimizer instance",
                     check_initialized)


# ----------------------------------------------------------------------------------- memory buffer

def get_all_ranks() -> str:
    """This rank's coordinates as ``"<tp>_<dp>_<cp>_<pp>_<ep>"`` (e.g. for per-rank file names)."""
    ranks = [get_tensor_model_parallel_rank(), get_data_parallel_rank(), get_context_parallel_rank(),
             get_pipeline_model_parallel_rank(), get_expert_model_parallel_rank()]
    return "_".join(str(r or 0) for r in ranks)


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    if _GLOBAL_MEMORY_BUFFER is None:
        raise AssertionError("global memory buffer is not initialized")
    return _GLOBAL_MEMORY_BUFFER


def destroy_global_memory_buffer():
    global _GLOBAL_MEMORY_BUFFER
    _GLOBAL_MEMORY_BUFFER = None


def destroy_model_parallel():
    """Forget every group and override so that ``initialize_model_parallel`` can be called again.

    The torch.distributed groups themselves are not destroyed: other code may still hold them, and
    destroying a subgroup is collective.
    """
    global _ALL_GROUP_RANKS
    for name in _STATE:
        globals()[name] = None
    _ALL_GROUP_RANKS = {}

"""Megatron-FSDP's helpers (megatron-core's ``megatron_fsdp.utils``): device-mesh lookups, the process groups
Megatron-FSDP uses (:class:`FSDPDistributedIndex`), and re-exports of this library's version checks, RNG tracker and
scratch buffer (one implementation each, here under Megatron-FSDP's names).

Mesh names: a DeviceMesh has its own dimension names (``mesh_dim_names``) and the names of the meshes flattened
from its root (``mesh._flatten(name)``); :func:`get_mesh_names` lists both, root dimensions first.
"""
from __future__ import annotations

import inspect
import logging
from typing import Optional

import torch
from torch.distributed import DeviceMesh, ProcessGroup

from megatron.core import parallel_state
from megatron.core import utils as _core_utils
from megatron.core.global_memory_buffer import GlobalMemoryBuffer
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, initialize_rng_tracker
from megatron.core.utils import get_te_version, is_submodule

logger = logging.getLogger(__name__)

__all__ = ["get_te_version", "is_te_min_version", "is_submodule", "get_mesh_names", "contains_submesh",
           "initialize_rng_tracker", "get_cuda_rng_tracker", "FSDPDistributedIndex", "GlobalMemoryBuffer",
           "get_global_memory_buffer", "create_updated_function_signature", "is_mcore_tensor_model_parallel",
           "is_mcore_tensor_parallel_duplicated", "get_mcore_tensor_parallel_partition_dim"]


def is_te_min_version(vers, check_equality=True):
    """Whether Transformer Engine >= ``vers`` (> with ``check_equality=False``) is installed; False without it."""
    return _core_utils.is_te_min_version(vers, check_equality)


def get_mesh_names(device_mesh: Optional[DeviceMesh] = None, only_submesh_dims: bool = False) -> list:
    """The mesh's dimension names, then the names of the meshes flattened from its root (not with
    ``only_submesh_dims``); ``[]`` for no mesh."""
    if device_mesh is None:
        return []
    own = list(device_mesh.mesh_dim_names or ())
    if only_submesh_dims:
        return own
    root = device_mesh._get_root_mesh()
    flattened = [name for name in getattr(root, "_flatten_mapping", {}) if name not in own]
    return own + flattened


def contains_submesh(device_mesh: Optional[DeviceMesh], submesh_names) -> bool:
    """Whether every name of ``submesh_names`` (one name or several) is a dimension or flattened mesh of
    ``device_mesh``; False when either is None."""
    if device_mesh is None or submesh_names is None:
        return False
    if isinstance(submesh_names, str):
        submesh_names = (submesh_names,)
    names = get_mesh_names(device_mesh)
    return all(name in names for name in submesh_names)


class FSDPDistributedIndex:
    """The meshes and process groups of Megatron-FSDP, from named dimensions of ``device_mesh``.

    ``dp_shard_dim``: the mesh dimension (or flattened DP x CP mesh) that parameters, gradients and optimizer state
    are sharded over (required); ``dp_outer_dim`` / ``hybrid_fsdp_group``: the outer DP dimension of hybrid FSDP and
    the flattened (outer, shard) group, given together or not at all; ``tp_dim``: the tensor-parallel dimension;
    ``expt_device_mesh``: the experts' mesh with the same dimension names (default: ``device_mesh``).
    Sub-meshes built from these names are registered under ``(*names, is_expert_parallel)`` for
    :meth:`get_submesh`.
    """

    def __init__(self, device_mesh: DeviceMesh, dp_shard_dim: Optional[str] = None,
                 dp_outer_dim: Optional[str] = None, tp_dim: Optional[str] = None,
                 hybrid_fsdp_group: Optional[torch.distributed.ProcessGroup] = None,
                 hsdp_outer_dp_shard: bool = False, expt_device_mesh: Optional[DeviceMesh] = None):
        self.device_mesh = device_mesh
        self.dp_shard_dim = dp_shard_dim
        self.dp_outer_dim = dp_outer_dim
        self.tp_dim = tp_dim
        self.use_hybrid_fsdp = dp_outer_dim is not None
        self.hsdp_outer_dp_shard = hsdp_outer_dp_shard
        self.expt_device_mesh = expt_device_mesh if expt_device_mesh is not None else device_mesh
        self.hybrid_fsdp_group = hybrid_fsdp_group

        def group_of(mesh, dim):
            return mesh[dim].get_group() if contains_submesh(mesh, dim) else None

        self.fsdp_group = group_of(device_mesh, dp_shard_dim)
        # The separate DP x CP all-gather group (to overlap gathers with reductions) comes from parallel_state when
        # initialize_model_parallel built one, as in megatron-core; FSDP2 here gathers over fsdp_group.
        self.fsdp_group_ag = (parallel_state.get_data_parallel_group(with_context_parallel=True,
                                                                     independent_all_gather=True)
                              if parallel_state.has_separate_all_gather_group() else None)
        self.outer_fsdp_group = group_of(device_mesh, dp_outer_dim)
        self.expt_fsdp_group = group_of(self.expt_device_mesh, dp_shard_dim)

        self.mesh_library = {}
        patterns = [(tp_dim,), (dp_outer_dim, dp_shard_dim, tp_dim), (dp_shard_dim, tp_dim),
                    (dp_outer_dim, dp_shard_dim), (dp_shard_dim,)]
        for names in patterns:
            self._register(device_mesh, names, False)
        for names in patterns[1], patterns[3]:  # the outer DP dimension is the dense mesh's for experts too
            self._register(device_mesh, names, True)
        for names in patterns[0], patterns[2], patterns[4]:
            self._register(self.expt_device_mesh, names, True)

        if self.fsdp_group is None:
            raise ValueError(f"FSDPDistributedIndex: dp_shard_dim={dp_shard_dim!r} names no dimension of the device "
                             f"mesh {get_mesh_names(device_mesh)}: Megatron-FSDP needs the mesh dimension it shards "
                             "over")
        if self.use_hybrid_fsdp and self.outer_fsdp_group is None:
            raise ValueError(f"FSDPDistributedIndex: dp_outer_dim={dp_outer_dim!r} names no dimension of the device "
                             "mesh (hybrid FSDP needs the outer DP dimension)")
        if self.use_hybrid_fsdp and hybrid_fsdp_group is None:
            raise ValueError("FSDPDistributedIndex: hybrid FSDP (dp_outer_dim given) needs hybrid_fsdp_group, the "
                             "flattened (dp_outer, dp_shard) process group")

    def _register(self, mesh, names, is_expert_parallel):
        if all(n is not None for n in names) and contains_submesh(mesh, names):
            self.mesh_library[tuple(names) + (is_expert_parallel,)] = mesh[tuple(names) if len(names) > 1
                                                                          else names[0]]

    def get_submesh(self, mesh_dim_names, is_expert_parallel: bool = False) -> DeviceMesh:
        """The registered sub-mesh of these dimension names (ValueError if there is none)."""
        if isinstance(mesh_dim_names, str):
            mesh_dim_names = (mesh_dim_names,)
        key = tuple(mesh_dim_names) + (is_expert_parallel,)
        if key not in self.mesh_library:
            hint = (" (give tp_dim: frameworks that assume TP=1 need a TP dimension of size 1)"
                    if self.tp_dim is None else "")
            raise ValueError(f"FSDPDistributedIndex.get_submesh: no sub-mesh {tuple(mesh_dim_names)} "
                             f"(is_expert_parallel={is_expert_parallel}) is registered{hint}")
        return self.mesh_library[key]

    def get_dp_group(self, is_expert_parallel: bool = False) -> ProcessGroup:
        """The group gradients are reduced over: the experts' shard group, the hybrid group, or the shard group."""
        if is_expert_parallel:
            return self.expt_fsdp_group
        return self.hybrid_fsdp_group if self.use_hybrid_fsdp else self.fsdp_group

    def get_fsdp_group(self, is_expert_parallel: bool = False, independent_all_gather: bool = False) -> ProcessGroup:
        """The group parameters are sharded over (the separate all-gather group: None here)."""
        if is_expert_parallel:
            return self.expt_fsdp_group
        return self.fsdp_group_ag if independent_all_gather else self.fsdp_group

    def get_outer_fsdp_group(self) -> Optional[ProcessGroup]:
        return self.outer_fsdp_group if self.use_hybrid_fsdp else None

    def get_root_mesh(self, is_expert_parallel: bool = False) -> DeviceMesh:
        """The mesh given to this index (the experts' for ``is_expert_parallel``), not DeviceMesh's own root."""
        return self.expt_device_mesh if is_expert_parallel else self.device_mesh

    def get_logical_hybrid_fsdp_rank(self) -> int:
        """This rank's index when hybrid FSDP shards over (inner, outer): the hybrid group's ranks are numbered
        ``outer * n_inner + inner`` and re-ordered to ``inner * n_outer + outer``."""
        if not self.hsdp_outer_dp_shard:
            raise AssertionError("get_logical_hybrid_fsdp_rank is only valid when full-shard hybrid FSDP is enabled")
        n_outer, n_inner = self.outer_fsdp_group.size(), self.fsdp_group.size()
        rank = self.hybrid_fsdp_group.rank()
        return (rank % n_inner) * n_outer + rank // n_inner


_MEMORY_BUFFER: Optional[GlobalMemoryBuffer] = None


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    """Megatron-FSDP's process-wide scratch buffer, created on first use."""
    global _MEMORY_BUFFER
    if _MEMORY_BUFFER is None:
        _MEMORY_BUFFER = GlobalMemoryBuffer()
    return _MEMORY_BUFFER


def create_updated_function_signature(original_function, **extended_kwargs: dict):
    """``original_function``'s signature with ``extended_kwargs`` appended as keyword-only parameters (default the
    given value, annotated with its type unless None)."""
    params = list(inspect.signature(original_function).parameters.values())
    for name, value in extended_kwargs.items():
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=value,
                                        annotation=type(value) if value is not None else inspect.Parameter.empty))
    return inspect.Signature(params)


def is_mcore_tensor_model_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` is a tensor-parallel slice (``_mcore_tp`` or Megatron's ``tensor_model_parallel``)."""
    return bool(getattr(param, "_mcore_tp", False) or getattr(param, "tensor_model_parallel", False))


def is_mcore_tensor_parallel_duplicated(param: torch.Tensor) -> bool:
    """Whether ``param`` is marked as duplicated over the tensor-parallel ranks (``_tp_duplicated``)."""
    return bool(getattr(param, "_tp_duplicated", False))


def get_mcore_tensor_parallel_partition_dim(param: torch.Tensor) -> Optional[int]:
    """The dimension a tensor-parallel ``param`` is split along (``_tp_partition_dim``, else ``partition_dim``);
    None for other parameters."""
    if not is_mcore_tensor_model_parallel(param):
        return None
    return getattr(param, "_tp_partition_dim", getattr(param, "partition_dim", None))

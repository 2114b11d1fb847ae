"""``HyperCommGrid``: process groups over any subset of the named dimensions of a rank grid (megatron-core's).

The grid ``shape = [s_0, s_1, ...]`` with ``dim_names = [n_0, n_1, ...]`` lays the ranks out with the FIRST
dimension varying fastest (the ``order`` of ``initialize_model_parallel``, e.g. ``tp-cp-pp-dp``): rank
``rank_offset + c_0 + s_0 * (c_1 + s_1 * (c_2 + ...))``. The group of dimensions ``D`` holds the ranks that differ
only in their ``D`` coordinates; ``create_pg(D)`` creates all such groups (collective: every rank calls it) and
returns this rank's, ``get_pg(D)`` returns it afterwards. Example: ``HyperCommGrid([2, 3, 4, 5], ["tp", "cp",
"pp", "dp"]).create_pg("dp")`` gives the groups parallel_state builds for TP 2, CP 3, PP 4 (order tp-cp-pp-dp).
"""
from __future__ import annotations

import os
from typing import Any, List, Optional, Tuple, Union

import numpy as np
import torch.distributed as dist


class HyperCommGrid:
    def __init__(self, shape: List[int], dim_names: List[str], rank_offset: int = 0,
                 backend: Optional[str] = None) -> None:
        if len(shape) != len(dim_names):
            raise ValueError(f"len(shape) {shape} != len(dim_names) {dim_names}")
        if len(set(dim_names)) != len(dim_names):
            raise ValueError(f"dimension names must be distinct, got {dim_names}")
        if rank_offset < 0:
            raise ValueError(f"rank_offset must be non-negative, got {rank_offset}")
        if "WORLD_SIZE" in os.environ:
            world_size = int(os.environ["WORLD_SIZE"])
        elif dist.is_initialized():
            world_size = dist.get_world_size()
        else:
            raise RuntimeError("HyperCommGrid cannot determine the world size: set WORLD_SIZE or initialize "
                               "torch.distributed first")
        self.size = int(np.prod(shape))
        if self.size > world_size - rank_offset:
            raise RuntimeError(f"grid shape {shape} needs {self.size} ranks; the world has {world_size} and the "
                               f"grid starts at rank {rank_offset}")
        self.shape, self.dim_names = list(shape), list(dim_names)
        self.rank_offset, self.backend = rank_offset, backend
        self._pgs = {}

    def _order_dims(self, dims: Union[str, List[str]]) -> Tuple[List[str], str]:
        """(``dims`` in the order of the reversed ``dim_names``, the group's key ``'-'.join`` of them)."""
        dims = [dims] if isinstance(dims, str) else list(dims)
        unknown = [d for d in dims if d not in self.dim_names]
        if unknown:
            raise KeyError(f"unknown grid dimension(s) {unknown} (the grid has {self.dim_names})")
        reverse = self.dim_names[::-1]
        ordered = sorted(dims, key=reverse.index)
        return ordered, "-".join(ordered)

    def _gen_rank_enum(self, dims: List[str]) -> List[List[int]]:
        """Every group of ``dims`` (ordered as :meth:`_order_dims`), as lists of global ranks."""
        reverse = self.dim_names[::-1]
        grid = np.arange(self.rank_offset, self.rank_offset + self.size).reshape(
            [self.shape[self.dim_names.index(d)] for d in reverse])  # slowest dimension first
        others = [d for d in reverse if d not in dims]
        order = [reverse.index(d) for d in others + list(dims)]
        group_size = int(np.prod([self.shape[self.dim_names.index(d)] for d in dims]))
        return grid.transpose(order).reshape(-1, group_size).tolist()

    def get_rank_enum(self, dims: Union[str, List[str]]) -> List[List[int]]:
        """The groups :meth:`create_pg` would create for ``dims``."""
        ordered, _ = self._order_dims(dims)
        return self._gen_rank_enum(ordered)

    def create_pg(self, dims: Union[str, List[str]], **kwargs: Any):
        """Create the groups of ``dims`` (collective; ``kwargs`` go to ``new_subgroups_by_enumeration``: timeout,
        pg_options, group_desc); this rank's group, or None when this rank is outside the grid. A second creation
        of the same dimensions is refused (its options could differ)."""
        ordered, key = self._order_dims(dims)
        if key in self._pgs:
            raise KeyError(f"process group {key} was already created (get it with get_pg)")
        group, _ = dist.new_subgroups_by_enumeration(self._gen_rank_enum(ordered), backend=self.backend, **kwargs)
        self._pgs[key] = group
        return group

    def get_pg(self, dims: Union[str, List[str]]):
        _, key = self._order_dims(dims)
        if key not in self._pgs:
            raise KeyError(f"process group {key} has not been created: call create_pg first")
        return self._pgs[key]

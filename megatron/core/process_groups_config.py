"""``ProcessGroupCollection``: the process groups a module communicates over, passed in explicitly
(``pg_collection=``) instead of looked up in :mod:`megatron.core.parallel_state`, which stays the default provider
(:meth:`ProcessGroupCollection.use_mpu_process_groups`).

Fields (all optional; an unset field reads as None): ``tp`` tensor parallel, ``pp`` pipeline, ``mp`` model
parallel (TP x PP), ``embd`` / ``pos_embd`` the first and last stages sharing embeddings, ``cp`` context parallel,
``tp_cp``, ``hcp`` (hierarchical CP groups, a list), ``ep`` expert parallel, ``expt_tp`` expert tensor parallel,
``tp_ep``, ``tp_ep_pp``, ``tp_dp_cp``, ``dp`` data parallel, ``dp_cp`` DP x CP (gradient reduction), ``expt_dp``
expert data parallel, ``intra_dp_cp`` / ``intra_expt_dp`` / ``inter_dist_opt`` / ``intra_dist_opt`` (distributed
optimizer instances). The constructor takes them as keywords and refuses unknown names.

Every module megatron-core gives a ``pg_collection`` (GPT / Mamba / BERT / T5 models, TransformerBlock / Layer,
attention incl. MLA, MLP, the MoE layer with its router, experts and dispatchers, the Mamba stack / layer / mixer, the
MTP block, DistributedDataParallel, get_megatron_optimizer, finalize_model_grads, the pipeline schedules) communicates
over the collection's groups (an encoder-decoder pipeline's split rank is a stage number and stays parallel_state's,
applied to the collection's ``pp`` group). A field left None, and no collection at all, means parallel_state's group
(:func:`pg_group`, :func:`pg_size`, :func:`pg_rank`), so a collection may carry only the groups that differ.

Example::

    pgs = ProcessGroupCollection(tp=tp_group, dp=dp_group, dp_cp=dp_group)
    model = GPTModel(config, spec, vocab_size, max_len, pg_collection=pgs)
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import List, Optional

import torch

__all__ = ["ProcessGroupCollection"]


class ProcessGroupHelperMeta(type):
    """A metaclass (megatron-core's) for helper classes that keep parallel sizes as class attributes: assigning
    ``virtual_pipeline_model_parallel_size`` on the class raises ``AttributeError`` (it must go through the class's
    ``set_virtual_pipeline_model_parallel_size()``); every other class attribute is assigned as usual."""

    def __setattr__(cls, name, value):
        if name == "virtual_pipeline_model_parallel_size":
            raise AttributeError(f"Cannot set '{name}' directly. Use set_virtual_pipeline_model_parallel_size() "
                                 "method instead.")
        super().__setattr__(name, value)


@dataclasses.dataclass(init=False, repr=False)
class ProcessGroupCollection:
    tp: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    pp: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    mp: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    embd: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    pos_embd: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    cp: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    tp_cp: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    hcp: Optional[List[torch.distributed.ProcessGroup]] = dataclasses.field(init=False, default=None)
    ep: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    expt_tp: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    tp_ep: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    tp_ep_pp: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    tp_dp_cp: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    dp: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    dp_cp: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    expt_dp: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    intra_dp_cp: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    intra_expt_dp: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    inter_dist_opt: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)
    intra_dist_opt: Optional[torch.distributed.ProcessGroup] = dataclasses.field(init=False, default=None)

    def __init__(self, **kwargs):
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"ProcessGroupCollection has no field {', '.join(unknown)} (fields: "
                             f"{', '.join(sorted(names))})")
        for name, value in kwargs.items():
            setattr(self, name, value)

    def __repr__(self):
        def size(group):
            if isinstance(group, list):
                return f"[{', '.join(str(size(g)) for g in group)}]"
            return torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else "?"

        active = [f"{f.name}({size(getattr(self, f.name))})" for f in dataclasses.fields(self)
                  if getattr(self, f.name) is not None]
        return f"ProcessGroupCollection({', '.join(active) or 'empty'})"

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: Optional[List[str]] = None) -> "ProcessGroupCollection":
        """The groups of :mod:`megatron.core.parallel_state` (all fields, or those named in ``required_pgs``; an
        unknown name raises). Groups parallel_state did not create stay None."""
        names = [f.name for f in dataclasses.fields(cls)]
        required = names if required_pgs is None else list(required_pgs)
        invalid = [name for name in required if name not in names]
        if invalid:
            raise ValueError(f"invalid process groups requested: {invalid} (fields: {', '.join(names)})")
        return cls(**{name: mpu_group(name) for name in required})


def _mpu_providers():
    from megatron.core import parallel_state as ps

    return {
        "tp": partial(ps.get_tensor_model_parallel_group, check_initialized=False),
        "pp": ps.get_pipeline_model_parallel_group,
        "mp": ps.get_model_parallel_group,
        "embd": ps.get_embedding_group,
        "pos_embd": ps.get_position_embedding_group,
        "cp": partial(ps.get_context_parallel_group, check_initialized=False),
        "tp_cp": partial(ps.get_tensor_and_context_parallel_group, check_initialized=False),
        "hcp": lambda: None,  # hierarchical CP is not implemented
        "ep": partial(ps.get_expert_model_parallel_group, check_initialized=False),
        "expt_tp": partial(ps.get_expert_tensor_parallel_group, check_initialized=False),
        "tp_ep": partial(ps.get_expert_tensor_and_model_parallel_group, check_initialized=False),
        "tp_ep_pp": partial(ps.get_expert_tensor_model_pipeline_parallel_group, check_initialized=False),
        "tp_dp_cp": partial(ps.get_tensor_and_data_parallel_group, check_initialized=False, with_context_parallel=True),
        "dp": ps.get_data_parallel_group,
        "dp_cp": partial(ps.get_data_parallel_group, with_context_parallel=True),
        "expt_dp": partial(ps.get_expert_data_parallel_group, check_initialized=False),
        # One distributed-optimizer instance: the intra-instance groups are the whole DP groups.
        "intra_dp_cp": partial(ps.get_data_parallel_group, with_context_parallel=True),
        "intra_expt_dp": partial(ps.get_expert_data_parallel_group, check_initialized=False),
        "inter_dist_opt": lambda: None,
        "intra_dist_opt": lambda: torch.distributed.group.WORLD,
    }


def mpu_group(name: str):
    """parallel_state's group for the collection field ``name`` (None where parallel_state has not created it)."""
    try:
        return _mpu_providers()[name]()
    except AssertionError:  # parallel_state did not create that group
        return None


def _mpu_size_rank(name: str):
    """parallel_state's (size, rank) getters for the fields whose getters honour the offline overrides
    (``set_tensor_model_parallel_world_size`` ...), or None."""
    from megatron.core import parallel_state as ps

    return {
        "tp": (ps.get_tensor_model_parallel_world_size, ps.get_tensor_model_parallel_rank),
        "pp": (ps.get_pipeline_model_parallel_world_size, ps.get_pipeline_model_parallel_rank),
        "cp": (ps.get_context_parallel_world_size, ps.get_context_parallel_rank),
        "ep": (ps.get_expert_model_parallel_world_size, ps.get_expert_model_parallel_rank),
        "expt_tp": (ps.get_expert_tensor_parallel_world_size, ps.get_expert_tensor_parallel_rank),
    }.get(name)


def pg_group(pg_collection: Optional[ProcessGroupCollection], name: str):
    """The group ``name`` a module communicates over: the collection's when it carries one, else parallel_state's
    (None where neither has it)."""
    group = None if pg_collection is None else getattr(pg_collection, name)
    return group if group is not None else mpu_group(name)


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _size_or_rank(pg_collection: Optional[ProcessGroupCollection], name: str, which: int) -> int:
    """``which`` 0: the size of the group ``name`` (1 where there is none); 1: this rank's index in it (0)."""
    default = (1, 0)[which]
    group = None if pg_collection is None else getattr(pg_collection, name)
    if group is None:
        getters = _mpu_size_rank(name)
        if getters is not None:
            try:
                return getters[which]() or default
            except AssertionError:
                return default
        group = mpu_group(name)
    if group is None or not _dist_ready():
        return default
    return (torch.distributed.get_world_size, torch.distributed.get_rank)[which](group=group)


def pg_size(pg_collection: Optional[ProcessGroupCollection], name: str) -> int:
    """Size of the group ``name`` (:func:`pg_group`); parallel_state's size getters (and their overrides) without a
    collection group; 1 where there is no group."""
    return _size_or_rank(pg_collection, name, 0)


def pg_rank(pg_collection: Optional[ProcessGroupCollection], name: str) -> int:
    """This rank's index in the group ``name`` (see :func:`pg_size`); 0 where there is no group."""
    return _size_or_rank(pg_collection, name, 1)


def is_pp_first_stage_of(pg_collection: Optional[ProcessGroupCollection], ignore_virtual: bool = False) -> bool:
    """First pipeline stage of the collection's ``pp`` group (and, unless ``ignore_virtual``, parallel_state's
    current virtual chunk is the first)."""
    from megatron.core import parallel_state as ps

    if not ignore_virtual and ps.get_virtual_pipeline_model_parallel_world_size() is not None \
            and (ps.get_virtual_pipeline_model_parallel_rank() or 0) != 0:
        return False
    return pg_rank(pg_collection, "pp") == 0


def is_pp_last_stage_of(pg_collection: Optional[ProcessGroupCollection], ignore_virtual: bool = False) -> bool:
    """Last pipeline stage of the collection's ``pp`` group (and, unless ``ignore_virtual``, the last virtual
    chunk)."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vpp is not None and (ps.get_virtual_pipeline_model_parallel_rank() or 0) != vpp - 1:
        return False
    return pg_rank(pg_collection, "pp") == pg_size(pg_collection, "pp") - 1


def is_pp_stage_before_split_of(pg_collection: Optional[ProcessGroupCollection], rank: Optional[int] = None,
                                pp_size: Optional[int] = None) -> bool:
    """An encoder stage of an encoder-decoder pipeline: stage ``rank`` (default this rank's) of the collection's
    ``pp`` group of ``pp_size`` stages (default its size; else parallel_state's) lies before the split rank. The split
    rank is a stage number and stays parallel_state's (``initialize_model_parallel(pipeline_model_parallel_split_rank=)``
    or ``set_pipeline_model_parallel_split_rank``); without it, or without a pipeline, a stage holds both stacks."""
    from megatron.core import parallel_state as ps

    split = ps.get_pipeline_model_parallel_split_rank()
    if split is None or (pp_size if pp_size is not None else pg_size(pg_collection, "pp")) == 1:
        return True
    return (rank if rank is not None else pg_rank(pg_collection, "pp")) < split


def is_pp_stage_after_split_of(pg_collection: Optional[ProcessGroupCollection], rank: Optional[int] = None,
                               pp_size: Optional[int] = None) -> bool:
    """A decoder stage of an encoder-decoder pipeline: stage ``rank`` lies at or after the split rank (see
    :func:`is_pp_stage_before_split_of`); without a split rank or a pipeline every stage."""
    from megatron.core import parallel_state as ps

    split = ps.get_pipeline_model_parallel_split_rank()
    if split is None or (pp_size if pp_size is not None else pg_size(pg_collection, "pp")) == 1:
        return True
    return (rank if rank is not None else pg_rank(pg_collection, "pp")) >= split


def group_ranks(group) -> List[int]:
    """Global ranks of ``group``'s members in group-rank order."""
    return torch.distributed.get_process_group_ranks(group)


def group_of(pg_collection: Optional[ProcessGroupCollection], name: str):
    """``pg_collection.<name>``, or None (meaning: parallel_state's group) without a collection."""
    return None if pg_collection is None else getattr(pg_collection, name)

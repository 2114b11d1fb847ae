"""Fully sharded data parallelism on PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard`` over a DeviceMesh).

The math. Let ``d`` be the number of DP x CP ranks (context-parallel ranks hold other tokens of the same samples,
so for the weights they are data-parallel replicas). Every parameter ``W`` (this rank's tensor-parallel piece) is
cut along dim 0 into ``d`` row blocks the way ``torch.chunk`` cuts (``ceil(rows/d)`` rows each; the last blocks
shorter or empty) and rank ``r`` keeps block ``r`` as a DTensor placed ``Shard(0)`` on the DP x CP mesh: the fp32
"main" weight that the optimizer updates in place. A *unit* (a transformer layer, ..., the root module for
what is left) all-gathers its blocks before its forward (cast to the compute dtype), and in backward
reduce-scatters the weight gradients and divides by ``d``, so rank ``r`` receives block ``r`` of
``(1/d) sum_ranks dW_rank``: the data-parallel mean of DDP, restricted to ``r``'s rows. Adam and SGD are
element-wise, so updating every block on its own rank equals the unsharded update, and the global gradient norm
is ``sqrt(sum over ranks of ||local blocks||^2)`` (each block exists once; tensor-parallel duplicates counted on
TP rank 0 only).

Strategies (Megatron-FSDP's names; ``--use-torch-fsdp2`` is ``optim_grads_params`` with its units):

* ``optim_grads_params`` (ZeRO-3): a unit's gathered weights are freed after its forward (unless
  ``reshard_after_forward=False``) and after its backward. Per rank: weights, gradients and optimizer state /d.
* ``optim_grads`` (ZeRO-2): weights are gathered once per step (by the first forward) and kept whole through
  every micro-batch's forward and backward; gradients are reduce-scattered at every micro-batch and accumulate in
  the sharded ``.grad``; after the optimizer step the updated blocks are all-gathered again
  (:meth:`FullyShardedModule.start_param_sync`). Per rank: whole weights (compute dtype), main weights,
  gradients and optimizer state /d.

(``no_shard`` and ``optim`` are Megatron's DDP and distributed optimizer: they need one gradient buffer reduced
once per step, which is what our DDP buckets do; see ``mcore_fsdp_adapter.py``. The standalone Megatron-FSDP API,
which has no such buffers, gets ``no_shard`` here from FSDP2's replicate dimension: a ``(d, 1)`` mesh, every
weight whole on every rank, gradients all-reduced and divided by ``d`` after each unit's backward.)

Mixed precision is FSDP2's policy: main weights fp32, compute in ``config.params_dtype`` (bf16), gradients reduced
in fp32 when ``grad_reduce_in_fp32``, the root's outputs cast back to fp32 (as ``Float16Module`` does).

Experts (parameters with ``allreduce = False``) are sharded over the expert data-parallel group instead; their
reduce-scatter divides by the dense ``d`` (not by the expert-DP size), because an expert's gradient already sums
the tokens that the dispatcher brought from the other expert-parallel ranks (Megatron's DDP scales them so too).
With ``calculate_per_token_loss`` every divide factor is 1 (gradients are summed; ``finalize_model_grads``
divides by the global token count).

FSDP2 replaces every parameter by a DTensor parameter of the same name; the attributes Megatron hangs on
parameters (``tensor_model_parallel``, ``partition_dim``, ``sequence_parallel``, ``allreduce``, ``shared``, ...)
are copied over by name.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, List, Optional, Tuple, Type

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from megatron.core import device as _device
from megatron.core import parallel_state
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.sharded_state import PIECE_MARK, Piece, fsdp_pieces
from megatron.core.utils import log_once

FULLY_SHARDED_STRATEGIES = ("optim_grads", "optim_grads_params")


def local_tensor(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's block of a DTensor (sharing its storage); any other tensor unchanged."""
    if isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor


def dp_tp_mesh(dp_cp_group, tp_group) -> DeviceMesh:
    """The 2-D mesh ``("dp_cp", "tp")`` of this rank from existing process groups: row ``i`` holds the tensor-parallel
    group of the ``i``-th rank of this rank's DP x CP group. FSDP shards over ``mesh["dp_cp"]``; TP stays Megatron's
    (its layers hold their slices as plain tensors)."""
    dp_ranks = torch.distributed.get_process_group_ranks(dp_cp_group)
    tp_groups = parallel_state.get_all_group_ranks()["tensor"]
    rows = [next(sorted(g) for g in tp_groups if r in g) for r in dp_ranks]
    mesh = torch.tensor(rows, dtype=torch.int)
    return DeviceMesh.from_group([dp_cp_group, tp_group], _device.current_device().type, mesh=mesh,
                                 mesh_dim_names=("dp_cp", "tp"))


def _mp_policy(config, ddp_config: DistributedDataParallelConfig, root: bool) -> MixedPrecisionPolicy:
    low = config.params_dtype if config.params_dtype in (torch.bfloat16, torch.float16) else None
    reduce = torch.float32 if (low is not None and ddp_config.grad_reduce_in_fp32) else None
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce,
                                output_dtype=torch.float32 if (root and low is not None) else None)


def _is_expert_container(module: torch.nn.Module) -> bool:
    params = list(module.parameters())
    return bool(params) and all(not getattr(p, "allreduce", True) for p in params)


class FullyShardedModule(torch.nn.Module):
    """``module`` sharded in place with ``fully_shard``; the interface of our DistributedDataParallel.

    ``units``: the submodules that become FSDP units (gathered one at a time), outermost first; the root is added.
    ``strategy``: ``optim_grads`` or ``optim_grads_params`` (module docstring).
    Shards over ``fsdp_mesh`` (experts over ``expert_mesh``) when given, else over the DP x CP group
    (``dp_cp_group``, default parallel_state's; experts over ``expert_dp_group``).
    ``config`` supplies ``params_dtype`` (the compute dtype) and ``calculate_per_token_loss``; ``fp32_outputs``: the
    root's low-precision outputs are cast to fp32 (Megatron's ``Float16Module`` behaviour; the standalone API
    returns them in the compute dtype).
    """

    uses_fully_shard = True

    def __init__(self, config, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module,
                 units: Iterable[torch.nn.Module], strategy: str = "optim_grads_params",
                 reshard_after_forward: bool = True, dp_cp_group=None, tp_group=None, expert_dp_group=None,
                 fsdp_mesh: Optional[DeviceMesh] = None, expert_mesh: Optional[DeviceMesh] = None,
                 fp32_outputs: bool = True):
        super().__init__()
        unsharded = fsdp_mesh is not None and fsdp_mesh.ndim == 2 and fsdp_mesh.shape[1] == 1
        if strategy not in FULLY_SHARDED_STRATEGIES and not (strategy == "no_shard" and unsharded):
            raise ValueError(f"FullyShardedModule shards with {FULLY_SHARDED_STRATEGIES} (no_shard: over a "
                             f"(d, 1) replicate x shard mesh), got {strategy!r}")
        self.config = config
        self.ddp_config = ddp_config
        self.sharding_strategy = strategy
        if fsdp_mesh is not None:  # a DeviceMesh given by the caller (the standalone Megatron-FSDP API): 1-D, or
            # (replicate, shard) for hybrid sharding; dp_cp_group then spans all its ranks (default: a 1-D mesh's)
            self.device_mesh = self.fsdp_mesh = fsdp_mesh
            dp_cp_group = dp_cp_group if dp_cp_group is not None else fsdp_mesh.get_group(0)
        else:
            if dp_cp_group is None:
                dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            if tp_group is None:
                tp_group = parallel_state.get_tensor_model_parallel_group()
            self.device_mesh = dp_tp_mesh(dp_cp_group, tp_group)
            self.fsdp_mesh = self.device_mesh["dp_cp"]
        self.data_parallel_group = dp_cp_group
        dp_size = fsdp_mesh.size() if fsdp_mesh is not None else torch.distributed.get_world_size(dp_cp_group)
        divide = 1.0 if config.calculate_per_token_loss else float(dp_size)

        # Parameters are the fp32 main weights; the policy casts the gathered copies for compute.
        if config.params_dtype in (torch.bfloat16, torch.float16):
            module.float()
        attributes = {name: dict(vars(p)) for name, p in module.named_parameters()}
        keep_whole = strategy == "optim_grads"
        kwargs = dict(reshard_after_forward=reshard_after_forward and not keep_whole,
                      mp_policy=_mp_policy(config, ddp_config, root=False))

        self.expert_mesh = None
        self.units: List[FSDPModule] = []
        shard_sizes = []  # the size of each unit's mesh dimension it shards over (the last)
        experts = [m for m in _outermost(module.modules(), _is_expert_container)]
        if experts:
            if expert_mesh is None:
                if expert_dp_group is None:
                    expert_dp_group = parallel_state.get_expert_data_parallel_group()
                expert_mesh = DeviceMesh.from_group(expert_dp_group, _device.current_device().type)
            self.expert_mesh = expert_mesh
            for m in experts:
                fully_shard(m, mesh=self.expert_mesh, **kwargs)
                self.units.append(m)
                shard_sizes.append(self.expert_mesh.shape[-1])
        for m in units:
            if m is module or not any(True for _ in m.parameters()):
                continue
            fully_shard(m, mesh=self.fsdp_mesh, **kwargs)
            self.units.append(m)
            shard_sizes.append(self.fsdp_mesh.shape[-1])
        fully_shard(module, mesh=self.fsdp_mesh, reshard_after_forward=kwargs["reshard_after_forward"],
                    mp_policy=_mp_policy(config, ddp_config, root=fp32_outputs))
        self.units.append(module)
        shard_sizes.append(self.fsdp_mesh.shape[-1])
        gloo = torch.distributed.get_backend(dp_cp_group) == "gloo"
        for unit, shard_size in zip(self.units, shard_sizes):
            unit.set_gradient_divide_factor(divide)
            # gloo has no PREMUL_SUM / AVG: reduce with SUM and scale locally. Not when the shard dimension has one
            # rank (experts when the expert data-parallel size is 1; the (d, 1) mesh of no_shard): FSDP2 (torch
            # 2.13) skips the reduce-scatter there and divides by the factor itself (after the replicate
            # dimension's all-reduce, if any), and forced SUM would divide a second time (gradients / d^2).
            # Measured with a (replicate, shard) mesh on gloo: (2, 2) needs the forced SUM, (2, 1) must not have it.
            if gloo and shard_size > 1:
                unit.set_force_sum_reduction_for_comms(True)
            if keep_whole:
                unit.set_reshard_after_backward(False)
        self.module = module
        # The sharded parameters, kept here: while optim_grads holds whole weights the module's own parameters are
        # the gathered copies, whose gradients FSDP2 has already moved into these.
        self._sharded_params = list(module.named_parameters())
        for name, param in self._sharded_params:
            for key, value in attributes.get(name, {}).items():
                setattr(param, key, value)
        log_once(f"fsdp-{strategy}", f"data parallelism: torch.distributed.fsdp.fully_shard ({strategy}) over "
                                     f"{dp_size} DP x CP ranks, {len(self.units)} FSDP units"
                                     + (", experts over the expert data-parallel group" if experts else ""))

    # ------------------------------------------------------------------------------ DDP's interface
    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self):
        """Gradients are reduce-scattered at every micro-batch (ZeRO-2/3 keep no whole gradient): nothing to defer."""
        yield

    def start_grad_sync(self, *unused):
        """Nothing to start: each unit reduce-scatters its gradients at the end of its backward pass."""

    def finish_grad_sync(self):
        """Nothing to wait for: FSDP2 waits for the reduce-scatters when the backward pass ends."""

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The sharded DTensor parameters (``module.<name>``), also while optim_grads holds whole weights."""
        head = f"{prefix}.module." if prefix else "module."
        for name, param in self._sharded_params:
            yield head + name, param

    def parameters(self, recurse: bool = True):
        for _, param in self._sharded_params:
            yield param

    def scale_gradients(self, scaling_factor: float):
        with torch.no_grad():
            for param in self.parameters():
                if param.grad is not None:
                    local_tensor(param.grad).mul_(scaling_factor)

    def zero_grad_buffer(self, zero_buffer: bool = True):
        for param in self.parameters():
            param.grad = None

    def broadcast_params(self):
        """Nothing to do: every weight block exists on one rank only, so replicas cannot disagree."""

    def start_param_sync(self, *unused, force_sync: bool = False):
        """After an optimizer step: ``optim_grads`` all-gathers the updated blocks (weights stay whole until the
        next step); ``optim_grads_params`` gathers each unit just in time, so nothing happens here."""
        if self.sharding_strategy == "optim_grads":
            self._reshard()
            for unit in self.units:
                unit.unshard()

    def disable_forward_pre_hook(self, param_sync: bool = True):
        """FSDP2 schedules its own all-gathers (--overlap-param-gather has nothing to switch)."""

    def enable_forward_pre_hook(self):
        """See disable_forward_pre_hook."""

    def _reshard(self):
        for unit in self.units:
            unit.reshard()

    @contextmanager
    def _sharded(self):
        """The module's parameters as their sharded DTensors (whole weights of optim_grads dropped meanwhile)."""
        self._reshard()
        try:
            yield
        finally:
            self.start_param_sync()

    def state_dict(self, prefix: str = "", keep_vars: bool = False):
        with self._sharded():
            return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True):
        """The module's own state dict (DTensors or whole tensors), or the values read for :meth:`sharded_state_dict`
        (``dist_checkpointing.load(model.sharded_state_dict(), dir)``): each piece is copied into its rows of this
        rank's block."""
        with self._sharded():
            if not any(PIECE_MARK in key for key in state_dict):
                return self.module.load_state_dict(state_dict, strict=strict)
            pieces, others = fsdp_pieces(self.module)
            missing = [p.name for p in pieces if p.name not in state_dict]
            if strict and missing:
                raise RuntimeError(f"the loaded sharded state lacks {missing[0]} (and {len(missing) - 1} more)")
            with torch.no_grad():
                for piece in pieces:
                    if piece.name in state_dict:
                        piece.leaf(local_tensor(piece.param)).data.copy_(state_dict[piece.name])
            rest = {k: v for k, v in state_dict.items() if k in others}
            return self.module.load_state_dict(rest, strict=False)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None):
        """The model's sharded state as its modules declare it, each FSDP2-sharded parameter cut to the rows this
        rank holds (megatron/core/distributed/fsdp/sharded_state.py); the data are views of the local blocks."""
        with self._sharded():
            pieces, others = fsdp_pieces(self.module, prefix, sharded_offsets, metadata)
        return {**others, **{piece.name: piece.leaf(local_tensor(piece.param)) for piece in pieces}}

    def sharded_pieces(self) -> List[Piece]:
        """The :class:`Piece` of every FSDP2-sharded parameter (what :meth:`sharded_state_dict` cuts), for state
        tensors of the same sharding (the optimizer's)."""
        with self._sharded():
            return fsdp_pieces(self.module)[0]

    def sharded_parameters(self) -> List[Tuple[str, torch.nn.Parameter]]:
        """``(name, DTensor parameter)`` of every parameter, names as in the unwrapped model."""
        return list(self._sharded_params)


def _outermost(modules: Iterable[torch.nn.Module], select) -> List[torch.nn.Module]:
    """The selected modules not nested inside another selected one (``modules`` in pre-order)."""
    chosen: List[torch.nn.Module] = []
    inside = set()
    for m in modules:
        if id(m) in inside:
            continue
        if select(m):
            chosen.append(m)
            inside.update(id(x) for x in m.modules())
    return chosen


def units_of_types(module: torch.nn.Module, types: Tuple[Type[torch.nn.Module], ...],
                   names: Tuple[str, ...] = ()) -> List[torch.nn.Module]:
    """The outermost submodules of ``module`` that are instances of ``types`` or whose class is named in ``names``,
    plus any submodule of a class listed in a module's ``_fsdp_modules`` attribute."""
    extra = tuple(t for m in module.modules() for t in getattr(m, "_fsdp_modules", ()))
    return _outermost((m for m in module.modules() if m is not module),
                      lambda m: isinstance(m, types + extra) or type(m).__name__ in names)

"""Small utilities shared by the whole library (megatron.core.utils)."""
from __future__ import annotations

import math
from operator import itemgetter
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from megatron.core.global_memory_buffer import GlobalMemoryBuffer  # noqa: F401  (megatron-core's path)


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Raise if ``numerator`` is not divisible by ``denominator``."""
    if numerator % denominator != 0:
        raise AssertionError(f"{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    """Divide exactly, raising if the division leaves a remainder."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


# torch >= 2.10 renamed the tensor-in/tensor-out collectives to *_single and deprecated the old names. The
# function is looked up on torch.distributed at call time, so that wrappers installed there (e.g.
# megatron.core.comm_accounting) see these calls too.
_ALL_GATHER_TENSOR_NAME = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") \
    else "all_gather_into_tensor"
_REDUCE_SCATTER_TENSOR_NAME = "reduce_scatter_single" if hasattr(torch.distributed, "reduce_scatter_single") \
    else "reduce_scatter_tensor"


def all_gather_into_tensor(output: torch.Tensor, input_: torch.Tensor, group=None, async_op: bool = False):
    """All-gather ``input_`` of every rank of ``group`` into ``output`` (concatenated along dim 0)."""
    return getattr(torch.distributed, _ALL_GATHER_TENSOR_NAME)(output, input_, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input_: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``input_`` over ``group`` and keep this rank's equal slice along dim 0 in ``output``."""
    return getattr(torch.distributed, _REDUCE_SCATTER_TENSOR_NAME)(output, input_, group=group, async_op=async_op)


def context_parallel_chunk_indices(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions (along the sequence) that context-parallel rank ``cp_rank`` of ``cp_size`` holds.

    The sequence is cut into ``2 * cp_size`` equal chunks; rank ``r`` holds chunk ``r`` followed by chunk
    ``2 * cp_size - 1 - r`` (Megatron's load-balanced "zigzag" split: under a causal mask an early chunk has
    little work and a late one much, so every rank gets one of each). Example, 8 positions, CP = 2: rank 0 holds
    ``[0, 1, 6, 7]``, rank 1 holds ``[2, 3, 4, 5]``.
    """
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context-parallel size ({2 * cp_size})")
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat([first, second])


def get_batch_on_this_cp_rank(batch: dict) -> dict:
    """This context-parallel rank's part of every tensor of ``batch`` (megatron-core's function).

    Each tensor's sequence dimension (dim 1; dim 2 for ``attention_mask``, whose key dimension stays whole) keeps
    the positions of :func:`context_parallel_chunk_indices`: ``S / CP`` of them, chunk ``r`` first, then chunk
    ``2 CP - 1 - r``. ``None`` values pass through; with CP = 1 the batch is returned unchanged.
    """
    from megatron.core import parallel_state

    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size <= 1:
        return batch
    cp_rank = parallel_state.get_context_parallel_rank()
    out = {}
    for key, value in batch.items():
        if value is None:
            out[key] = value
            continue
        dim = 2 if key == "attention_mask" else 1
        index = context_parallel_chunk_indices(value.size(dim), cp_size, cp_rank).to(value.device)
        out[key] = value.index_select(dim, index)
    return out


_LOGGED = set()


def log_once(key: str, message: str) -> None:
    """Print ``message`` the first time ``key`` is seen in this process (on rank 0 only): which implementation of
    a fused op, attention or optimizer was chosen."""
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_rank() != 0:
            return
    print(f"> {message}", flush=True)


def print_rank_0(message) -> None:
    """Print on global rank 0 only (or always, without torch.distributed)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_rank() != 0):
        print(message, flush=True)


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Init method based on N(0, sigma)."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Init method based on N(0, sigma / sqrt(2 * num_layers)), for output projections."""
    std = sigma / math.sqrt(2.0 * num_layers)

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


def _kernel_make_viewless_tensor(inp: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    out = torch.empty((1,), dtype=inp.dtype, device=inp.device, requires_grad=requires_grad)
    out.data = inp.data
    return out


class MakeViewlessTensor(torch.autograd.Function):
    """Autograd function that returns a tensor which is not a view, passing gradients straight through."""

    @staticmethod
    def forward(ctx, inp, requires_grad):
        return _kernel_make_viewless_tensor(inp, requires_grad)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def make_viewless_tensor(inp: torch.Tensor, requires_grad: bool, keep_graph: bool) -> torch.Tensor:
    """Return a tensor with ``._base`` set to None holding the same data as ``inp``.

    Pipeline schedules free a stage's output after sending it by replacing ``.data``; that only frees
    memory if the tensor is not a view of a larger one, hence this helper.
    """
    if inp._base is None:
        return inp
    if keep_graph:
        return MakeViewlessTensor.apply(inp, requires_grad)
    return _kernel_make_viewless_tensor(inp, requires_grad)


def assert_viewless_tensor(tensor, extra_msg=None):
    if isinstance(tensor, list):
        for t in tensor:
            assert_viewless_tensor(t, extra_msg)
        return tensor
    if not isinstance(tensor, torch.Tensor):
        return tensor
    assert tensor._base is None, (
        f"Ensure tensor._base is None before setting tensor.data or storing tensor to memory buffer. {extra_msg}"
    )
    return tensor


def safely_set_viewless_tensor_data(tensor: torch.Tensor, new_data_tensor: torch.Tensor) -> None:
    assert_viewless_tensor(tensor, extra_msg=f"FYI, tensor._base has shape {tensor._base.shape if tensor._base is not None else None}")
    tensor.data = new_data_tensor


def get_attr_wrapped_model(model, attr: str, allow_none: bool = True):
    """Find ``attr`` on ``model`` or on the first ``.module`` in its wrapper chain that has it."""
    if isinstance(model, list):
        raise RuntimeError("get_attr_wrapped_model does not support lists of model chunks")
    while not hasattr(model, attr):
        if not hasattr(model, "module"):
            raise RuntimeError(f"couldn't find attribute {attr} on the model or its wrappers")
        model = model.module
    value = getattr(model, attr)
    if not allow_none and value is None:
        raise RuntimeError(f"attribute {attr} of the model is None")
    return value


def get_model_type(model):
    return get_attr_wrapped_model(model, "model_type")


def get_model_config(model):
    return get_attr_wrapped_model(model, "config", allow_none=False)


# ------------------------------------------------------------------------------------ process groups and sharding
def get_pg_rank(group=None) -> int:
    """This rank's index in ``group`` (0 without a group or without torch.distributed)."""
    if group is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0
    return torch.distributed.get_rank(group=group)


def get_pg_size(group=None) -> int:
    """The size of ``group`` (1 without a group or without torch.distributed)."""
    if group is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    return torch.distributed.get_world_size(group=group)


def _tp_dp_ranks(tp_group, dp_cp_group):
    """(tp rank, tp size, dp rank, dp size), each pair from its group when given, else from parallel_state (whose
    getters also honour the rank overrides offline tools set)."""
    from megatron.core import parallel_state

    if tp_group is not None:
        tp_rank, tp_size = get_pg_rank(tp_group), get_pg_size(tp_group)
    else:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if dp_cp_group is not None:
        dp_rank, dp_size = get_pg_rank(dp_cp_group), get_pg_size(dp_cp_group)
    elif parallel_state.is_initialized():
        dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
        dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    else:
        dp_rank, dp_size = 0, 1
    return tp_rank, tp_size, dp_rank, dp_size


def _is_dtensor(tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(tensor, DTensor)


def make_tp_sharded_tensor_for_checkpoint(tensor, key, tp_axis=0, replica_id=None, prepend_offsets=(), **kwargs):
    """A ShardedTensor of ``tensor`` split along ``tp_axis`` over the TP group (``tp_group=``, default
    parallel_state's): ``(tp_axis + len(prepend_offsets), tp_rank, tp_size)`` after the prepended ``(axis, offset,
    fragments)`` entries; replica id ``(0, 0, dp rank)`` over ``dp_cp_group`` by default. A DTensor (FSDP2) is its
    local shard, further split along axis 0 by the DP rank (combined with TP when ``tp_axis`` is 0)."""
    tp_group = kwargs.pop("tp_group", None)
    dp_cp_group = kwargs.pop("dp_cp_group", None)
    tp_rank, tp_size, dp_rank, dp_size = _tp_dp_ranks(tp_group, dp_cp_group)
    prepend = len(prepend_offsets)
    offsets = [(tp_axis + prepend, tp_rank, tp_size)]
    dp_replica = dp_rank
    if _is_dtensor(tensor):
        tensor, dp_replica = tensor._local_tensor, 0
        if tp_axis == 0:
            offsets = [(prepend, tp_rank * dp_size + dp_rank, tp_size * dp_size)]
        else:
            offsets.append((prepend, dp_rank, dp_size))
    if replica_id is None:
        replica_id = (0, 0, dp_replica)
    return ShardedTensor.from_rank_offsets(key, tensor, *prepend_offsets, *offsets, replica_id=replica_id,
                                           prepend_axis_num=prepend, **kwargs)


def make_sharded_tensor_for_checkpoint(tensor, key, prepend_offsets=(), replica_id=None, **kwargs):
    """A ShardedTensor of a tensor replicated over TP and DP: replica id ``(0, tp rank, dp rank)`` by default
    (``tp_group=`` / ``dp_cp_group=``, default parallel_state's). A DTensor (FSDP2) is split along axis 0 by the DP
    rank (the full tensor is gathered first when some rank would hold an empty shard)."""
    tp_group = kwargs.pop("tp_group", None)
    dp_cp_group = kwargs.pop("dp_cp_group", None)
    tp_rank, _, dp_rank, dp_size = _tp_dp_ranks(tp_group, dp_cp_group)
    prepend = len(prepend_offsets)
    offsets = []
    dp_replica = dp_rank
    if _is_dtensor(tensor):
        dp_replica = 0
        if tensor.shape[0] < dp_size or tensor.shape[0] % dp_size:
            tensor = tensor.full_tensor()
            offsets = []
            dp_replica = dp_rank
        else:
            tensor = tensor._local_tensor
            offsets = [(prepend, dp_rank, dp_size)]
    if replica_id is None:
        replica_id = (0, tp_rank, dp_replica)
    return ShardedTensor.from_rank_offsets(key, tensor, *prepend_offsets, *offsets, replica_id=replica_id,
                                           prepend_axis_num=prepend, **kwargs)


def _extra_state_offsets(sharded_offsets) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(global shape, global offset) in pieces of a ShardedObject beside tensors with ``sharded_offsets``."""
    if not sharded_offsets:
        return (1,), (0,)
    ordered = sorted(sharded_offsets, key=itemgetter(0))
    axes = [axis for axis, _, _ in ordered]
    if axes != list(range(len(axes))):
        raise ValueError(f"sharded offsets must cover axes 0..n-1 for an object, got {sharded_offsets}")
    return tuple(f for _, _, f in ordered), tuple(o for _, o, _ in ordered)


def make_sharded_object_for_checkpoint(obj: Any, key: str, sharded_offsets: Iterable[Tuple[int, int, int]] = (),
                                       replica_id=None, **kwargs) -> ShardedObject:
    """A ShardedObject placed like tensors with ``sharded_offsets`` (one piece per layer / expert), replicated over
    TP and DP (replica id ``(0, tp rank, dp rank)`` by default)."""
    if replica_id is None:
        tp_rank, _, dp_rank, _ = _tp_dp_ranks(None, None)
        replica_id = (0, tp_rank, dp_rank)
    shape, offset = _extra_state_offsets(tuple(sharded_offsets))
    return ShardedObject(key, obj, shape, offset, replica_id, **kwargs)


def make_sharded_tensors_for_checkpoint(state_dict: StateDict, prefix: str,
                                        tensor_parallel_layers_axis_map: Optional[Dict[str, int]] = None,
                                        sharded_offsets: Iterable[Tuple[int, int, int]] = (),
                                        extra_state_suffix: str = "_extra_state", tp_group=None,
                                        dp_cp_group=None) -> ShardedStateDict:
    """``{prefix + name: ShardedTensor | ShardedObject}`` for a module's own ``state_dict``: the names in
    ``tensor_parallel_layers_axis_map`` split over TP along their axis, ``*_extra_state`` as objects, the rest
    replicated."""
    axis_map = tensor_parallel_layers_axis_map or {}
    sharded_offsets = tuple(sharded_offsets)
    groups = dict(tp_group=tp_group, dp_cp_group=dp_cp_group)
    out = {}
    for name, value in state_dict.items():
        key = f"{prefix}{name}"
        if name.endswith(extra_state_suffix):
            tp_rank, _, dp_rank, _ = _tp_dp_ranks(tp_group, dp_cp_group)
            replica = (0, tp_rank, dp_rank)
            out[key] = make_sharded_object_for_checkpoint(value, key, sharded_offsets, replica)
        elif name in axis_map:
            out[key] = make_tp_sharded_tensor_for_checkpoint(value, key, axis_map[name],
                                                             prepend_offsets=sharded_offsets, **groups)
        else:
            out[key] = make_sharded_tensor_for_checkpoint(value, key, prepend_offsets=sharded_offsets, **groups)
    return out

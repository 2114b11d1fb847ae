"""The seven tensor/sequence-parallel communication mappings as autograd functions.

Each mapping is a pair of conjugate collectives over the tensor-parallel group: what the forward does,
the backward undoes for gradients. With ``t`` the TP size and ``X_i`` rank ``i``'s tensor:

=====================================  ============================  ==================================
mapping                                forward                       backward
=====================================  ============================  ==================================
copy_to_tensor_model_parallel_region   Y_i = X                       dX = sum_i dY_i (all-reduce)
reduce_from_tensor_model_parallel_...  Y = sum_i X_i (all-reduce)    dX_i = dY
scatter_to_tensor_model_parallel_...   Y_i = X[..., chunk i]         dX = concat_last(dY_i) (all-gather)
gather_from_tensor_model_parallel_...  Y = concat_last(X_i)          dX_i = dY[..., chunk i]
scatter_to_sequence_parallel_region    Y_i = X[chunk i, ...]         dX = concat_first(dY_i)
gather_from_sequence_parallel_region   Y = concat_first(X_i)         dX_i = (sum_j dY_j)[chunk i] (reduce-
                                                                     scatter), or dY[chunk i] if the grad
                                                                     is not TP-partial
reduce_scatter_to_sequence_parallel_.  Y_i = (sum_j X_j)[chunk i]    dX = concat_first(dY_i)
=====================================  ============================  ==================================

All are identities when t == 1. Each class also has Megatron's ``symbolic(graph, input_)`` (what tracing /
ONNX export records): the forward computation. Sequence-parallel mappings split the first (sequence) dimension of
``[s, b, h]`` activations.
"""
from __future__ import annotations

import torch

from megatron.core.fake_process_group import is_fake_process_group
from megatron.core.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from megatron.core.tensor_parallel.utils import split_tensor_along_last_dim
from megatron.core.utils import all_gather_into_tensor, reduce_scatter_tensor


def _group_size_rank(group):
    """(group, size, rank) of ``group``, or of parallel_state's TP group when None (whose getters also honour the
    rank overrides of offline tools)."""
    if group is None:
        return get_tensor_model_parallel_group(), get_tensor_model_parallel_world_size(), \
            get_tensor_model_parallel_rank()
    return group, torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def _reduce(input_: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) across the TP group."""
    group, world_size, _ = _group_size_rank(group)
    if world_size == 1:
        return input_
    input_ = input_.contiguous()
    torch.distributed.all_reduce(input_, group=group)
    return input_


def _split_along_last_dim(input_: torch.Tensor, group=None) -> torch.Tensor:
    _, world_size, rank = _group_size_rank(group)
    if world_size == 1:
        return input_
    input_list = split_tensor_along_last_dim(input_, world_size)
    return input_list[rank].contiguous()


def _split_along_first_dim(input_: torch.Tensor, group=None) -> torch.Tensor:
    _, world_size, rank = _group_size_rank(group)
    if world_size == 1:
        return input_
    dim_size = input_.size(0)
    if dim_size % world_size != 0:
        raise RuntimeError(
            f"First dimension of the tensor ({dim_size}) should be divisible by tensor parallel size ({world_size}); "
            "with --sequence-parallel the sequence length must be a multiple of --tensor-model-parallel-size"
        )
    local_dim_size = dim_size // world_size
    offset = rank * local_dim_size
    return input_[offset:offset + local_dim_size].contiguous()


def _gather_along_last_dim(input_: torch.Tensor, group=None) -> torch.Tensor:
    group, world_size, _ = _group_size_rank(group)
    if world_size == 1:
        return input_
    input_ = input_.contiguous()
    tensor_list = [torch.empty_like(input_) for _ in range(world_size)]
    torch.distributed.all_gather(tensor_list, input_, group=group)
    return torch.cat(tensor_list, dim=-1).contiguous()


def _gather_along_first_dim(input_: torch.Tensor, group=None) -> torch.Tensor:
    group, world_size, _ = _group_size_rank(group)
    if world_size == 1:
        return input_
    dim_size = list(input_.size())
    dim_size[0] = dim_size[0] * world_size
    output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
    all_gather_into_tensor(output, input_.contiguous(), group=group)
    return output


def _reduce_scatter_along_first_dim(input_: torch.Tensor, group=None) -> torch.Tensor:
    group, world_size, _ = _group_size_rank(group)
    if world_size == 1:
        return input_
    dim_size = list(input_.size())
    if dim_size[0] % world_size != 0:
        raise RuntimeError(
            f"First dimension of the tensor ({dim_size[0]}) should be divisible by tensor parallel size ({world_size})"
        )
    dim_size[0] = dim_size[0] // world_size
    output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
    reduce_scatter_tensor(output, input_.contiguous(), group=group)
    return output


def _reduce_scatter_along_last_dim(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over the group, each rank keeping its block of the last dimension."""
    group, world_size, _ = _group_size_rank(group)
    if world_size == 1:
        return input_
    blocks = torch.stack(split_tensor_along_last_dim(input_, world_size), dim=0).contiguous()
    output = blocks.new_empty(blocks.shape[1:])
    reduce_scatter_tensor(output.unsqueeze(0), blocks, group=group)
    return output


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def symbolic(graph, input_, group=None):
        return input_

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def symbolic(graph, input_, group=None):
        return _reduce(input_, group)

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _reduce(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def symbolic(graph, input_, group=None):
        return _split_along_last_dim(input_, group)

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _split_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def symbolic(graph, input_, group=None):
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def symbolic(graph, input_, group=None):
        return _split_along_first_dim(input_, group)

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _split_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def symbolic(graph, input_, tensor_parallel_output_grad=True, group=None):
        return _gather_along_first_dim(input_, group)

    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad=True, group=None):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        ctx.group = group
        return _gather_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        # If the consumer of the gathered tensor is tensor-parallel, each rank holds a partial gradient
        # that must be summed before splitting; otherwise the gradient is already complete.
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_along_first_dim(grad_output, ctx.group), None, None
        return _split_along_first_dim(grad_output, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def symbolic(graph, input_, group=None):
        return _reduce_scatter_along_first_dim(input_, group)

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _reduce_scatter_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group), None


class _AllGatherLastDim(torch.autograd.Function):
    """Gather along the last dimension; backward: reduce-scatter of the gradient along it."""

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce_scatter_along_last_dim(grad_output, ctx.group), None


class _ReduceScatterLastDim(torch.autograd.Function):
    """Reduce-scatter along the last dimension; backward: gather of the gradient along it."""

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _reduce_scatter_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group), None


def all_gather_last_dim_from_tensor_parallel_region(input_, group=None):
    """``[..., h/t]`` on each of the ``t`` ranks -> ``[..., h]`` (the gradient is summed and split back)."""
    return _AllGatherLastDim.apply(input_, group)


def reduce_scatter_last_dim_to_tensor_parallel_region(input_, group=None):
    """``[..., h]`` partial sums -> this rank's ``[..., h/t]`` block of their sum (the gradient is gathered)."""
    return _ReduceScatterLastDim.apply(input_, group)


def all_to_all_sp2hp(input_, group=None):
    """Sequence-split to hidden-split over the TP group: ``[tokens/t, h]`` (any leading shape, flattened) ->
    ``[tokens, h/t]`` (rank ``r`` gets hidden block ``r`` of every rank's tokens, in rank order)."""
    group, world_size, _ = _group_size_rank(group)
    input_ = input_.reshape(-1, input_.shape[-1])
    if world_size == 1:
        return input_
    blocks = torch.split(input_, input_.shape[-1] // world_size, dim=1)
    return all_to_all(group, torch.cat(blocks, dim=0))


def all_to_all_hp2sp(input_, group=None):
    """Inverse of :func:`all_to_all_sp2hp`: ``[tokens, h/t]`` -> ``[tokens/t, h]``."""
    group, world_size, _ = _group_size_rank(group)
    input_ = input_.reshape(-1, input_.shape[-1])
    if world_size == 1:
        return input_
    exchanged = all_to_all(group, input_)
    return torch.cat(torch.split(exchanged, exchanged.shape[0] // world_size, dim=0), dim=1)


def copy_to_tensor_model_parallel_region(input_, group=None):
    """Identity forward; all-reduce of the gradient over the TP group (``group``, default parallel_state's)."""
    return _CopyToModelParallelRegion.apply(input_, group)


def reduce_from_tensor_model_parallel_region(input_, group=None):
    return _ReduceFromModelParallelRegion.apply(input_, group)


def scatter_to_tensor_model_parallel_region(input_, group=None):
    return _ScatterToModelParallelRegion.apply(input_, group)


def gather_from_tensor_model_parallel_region(input_, group=None):
    return _GatherFromModelParallelRegion.apply(input_, group)


def scatter_to_sequence_parallel_region(input_, group=None):
    return _ScatterToSequenceParallelRegion.apply(input_, group)


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=None):
    return _GatherFromSequenceParallelRegion.apply(input_, tensor_parallel_output_grad, group)


def reduce_scatter_to_sequence_parallel_region(input_, group=None):
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with (possibly uneven) row splits; the backward exchanges the gradient back (splits
    swapped)."""

    @staticmethod
    def forward(ctx, input_, group, output_split_sizes, input_split_sizes):
        ctx.group, ctx.output_split_sizes, ctx.input_split_sizes = group, output_split_sizes, input_split_sizes
        input_ = input_.contiguous()
        if output_split_sizes is None:
            output = torch.empty_like(input_)
        else:
            output = input_.new_empty((sum(output_split_sizes),) + tuple(input_.shape[1:]))
        if input_.shape[0] == 0 and is_fake_process_group():
            # --fake-process-group: the peers' token counts are copies of this rank's, so a rank can expect rows
            # while sending none, which torch's fake backend refuses; nothing moves anyway: zeros of the right shape.
            return output.zero_()
        torch.distributed.all_to_all_single(output, input_, output_split_sizes=output_split_sizes,
                                            input_split_sizes=input_split_sizes, group=group)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        return _AllToAll.apply(grad_output.contiguous(), ctx.group, ctx.input_split_sizes,
                               ctx.output_split_sizes), None, None, None


def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
    """Autograd-aware all-to-all of the rows of ``input_`` over ``group``: rank ``i`` sends its
    ``input_split_sizes[j]`` rows to rank ``j`` and receives ``output_split_sizes_[j]`` rows from it (equal splits
    when None)."""
    world_size = torch.distributed.get_world_size(group) if group is not None else 1
    if world_size == 1:
        return input_
    output_splits = list(output_split_sizes_) if output_split_sizes_ is not None else None
    input_splits = list(input_split_sizes) if input_split_sizes is not None else None
    return _AllToAll.apply(input_, group, output_splits, input_splits)

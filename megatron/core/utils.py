"""Small utilities shared by the whole library (megatron.core.utils)."""
from __future__ import annotations

import math
from typing import Callable

import torch

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
    """Print on global rank 0 only (or always, without torch.distributed or under --fake-process-group, where this
    process is the only one)."""
    from megatron.core.fake_process_group import is_fake_process_group

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_rank() != 0) or is_fake_process_group():
        print(message, flush=True)


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Init method based on N(0, sigma)."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int,
                              multiplier: float = 2.0) -> Callable[[torch.Tensor], torch.Tensor]:
    """Init method based on N(0, sigma / sqrt(multiplier * num_layers)), for output projections (multiplier 2:
    two residual branches per transformer layer; 1 for hybrid models, whose layers have one each)."""
    std = sigma / math.sqrt(multiplier * num_layers)

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

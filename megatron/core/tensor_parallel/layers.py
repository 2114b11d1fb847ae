"""Tensor-parallel linear and embedding layers (megatron.core.tensor_parallel.layers).

Column parallelism: ``Y = X A + b`` with ``A = [A_1, ..., A_t]`` split by output columns; rank ``i`` holds
``A_i`` (stored transposed as ``F.linear`` weights, shape ``[out/t, in]``) and computes ``Y_i = X A_i + b_i``
without communication. The input gradient ``dX = sum_i dY_i A_i^T`` needs an all-reduce.

Row parallelism: ``A = [A_1; ...; A_t]`` split by input rows (weight ``[out, in/t]``); rank ``i`` holds the
matching slice ``X_i`` of the input and ``Y = sum_i X_i A_i + b`` needs an all-reduce of the partial outputs.

A column-parallel layer followed by a row-parallel one (the MLP, attention) therefore needs one all-reduce
in forward and one in backward. With sequence parallelism the input of the column layer is sharded along
the sequence and all-gathered inside the GEMM's autograd function, and the row layer's all-reduce becomes
a reduce-scatter along the sequence.

Vocabulary-parallel embedding: the table ``[V, h]`` is split into ``t`` contiguous row ranges; each rank
looks up the ids it owns, zeroes the rest, and an all-reduce sums the partial embeddings.
"""
from __future__ import annotations

import math
import os
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from megatron.core import device, parallel_state
from megatron.core.device import param_device, weights_on_meta
from megatron.core.fp8_utils import Fp8Meta, fp8_dgrad, fp8_forward, fp8_recipe_from_config, fp8_wgrad
from megatron.core.utils import log_once
from megatron.core.wgrad_compute import accumulate_into_main_grad as _accumulate_into_main_grad
from megatron.core.wgrad_compute import add_into_main_grad as _add_into_main_grad
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.parallel_state import (
    get_global_memory_buffer,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.tensor_parallel.utils import VocabUtility
from megatron.core.utils import (all_gather_into_tensor, divide, make_tp_sharded_tensor_for_checkpoint,
                                 make_sharded_tensors_for_checkpoint, reduce_scatter_tensor)

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


def param_is_not_tensor_parallel_duplicate(param, tp_group=None) -> bool:
    """True for parameters that are split across TP ranks, or for the copy held by rank 0 of ``tp_group``
    (parallel_state's TP group when None)."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    if tp_group is not None:
        return torch.distributed.get_rank(group=tp_group) == 0
    return get_tensor_model_parallel_rank() == 0


def set_tensor_model_parallel_attributes(tensor, is_parallel: bool, dim: int, stride: int) -> None:
    values = {"tensor_model_parallel": is_parallel, "partition_dim": dim, "partition_stride": stride}
    for attribute, value in values.items():  # setting the same values again (a reset_parameters) is fine
        assert getattr(tensor, attribute, value) == value, f"tensor already has the attribute {attribute}"
        setattr(tensor, attribute, value)


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor) -> None:
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


def copy_tensor_model_parallel_attributes(destination_tensor, source_tensor) -> None:
    # ``allreduce`` (False on expert-parallel parameters) travels with them too: the optimizer's grad norm
    # reduces expert pieces over the expert model-parallel group.
    for attribute in (*_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS, "allreduce"):
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


def _linear_sharded_state_dict(module, prefix, sharded_offsets, metadata, axis_map):
    """A tensor-parallel layer's sharded state: its state dict with ``axis_map``'s tensors split over TP (the rest,
    e.g. a row-parallel bias or FP8 scaling state, replicated) plus megatron-core's empty ``_extra_state`` object."""
    dp_cp_group = (metadata or {}).get("dp_cp_group")
    tp_group = getattr(module, "tp_group", None) or (metadata or {}).get("tp_group")
    state = module.state_dict(prefix="", keep_vars=True)
    state["_extra_state"] = None  # megatron-core's linear layers always carry one (no FP8 metadata here)
    return make_sharded_tensors_for_checkpoint(state, prefix, {k: v for k, v in axis_map.items() if k in state},
                                               sharded_offsets, tp_group=tp_group, dp_cp_group=dp_cp_group)


def tp_size_and_rank(tp_group=None):
    """(size, rank) of ``tp_group``, or of parallel_state's TP group when None."""
    if tp_group is None:
        return get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    return torch.distributed.get_world_size(tp_group), torch.distributed.get_rank(tp_group)


def _initialize_affine_weight_gpu(weight, init_method, partition_dim, stride=1):
    """Initialise this rank's shard directly, drawing from the TP-rank-specific generator."""
    set_tensor_model_parallel_attributes(tensor=weight, is_parallel=True, dim=partition_dim, stride=stride)
    with get_cuda_rng_tracker().fork():
        init_method(weight)


def _initialize_affine_weight_cpu(weight, output_size, input_size, per_partition_size, partition_dim, init_method,
                                  stride=1, return_master_weight=False, *, params_dtype=torch.float32, tp_group=None):
    """Initialise the full fp32 master weight, then keep this rank's slices.

    The full weight depends only on the seed, so any TP size starts from the same model. With ``stride``
    ``s`` the partition dimension is cut into ``t * s`` chunks and rank ``i`` takes chunks ``i, i+t, ...``
    (used when one GEMM computes several interleaved outputs).
    """
    set_tensor_model_parallel_attributes(tensor=weight, is_parallel=True, dim=partition_dim, stride=stride)
    master_weight = torch.empty(output_size, input_size, dtype=torch.float, requires_grad=False)
    init_method(master_weight)
    master_weight = master_weight.to(dtype=params_dtype)

    per_partition_per_stride_size = divide(per_partition_size, stride)
    weight_list = torch.split(master_weight, per_partition_per_stride_size, dim=partition_dim)
    world_size, rank = tp_size_and_rank(tp_group)
    my_weight_list = weight_list[rank::world_size]
    with torch.no_grad():
        weight.data.copy_(torch.cat(my_weight_list, dim=partition_dim))
    if return_master_weight:
        return master_weight
    return None


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding whose table is split along the vocabulary across TP ranks. Returns one tensor."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: Callable,
                 config: ModelParallelConfig, reduce_scatter_embeddings: bool = False, tp_group=None):
        super().__init__()
        if reduce_scatter_embeddings:
            raise NotImplementedError("reduce_scatter_embeddings=True is not implemented: the embedding all-reduces, "
                                      "and the sequence-parallel scatter follows it")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_group = tp_group
        self.tensor_model_parallel_size, tp_rank = tp_size_and_rank(tp_group)
        (self.vocab_start_index, self.vocab_end_index) = VocabUtility.vocab_range_from_global_vocab_size(
            self.num_embeddings, tp_rank, self.tensor_model_parallel_size
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion

        self.config, self.init_method = config, init_method
        self.weight = Parameter(torch.empty(self.num_embeddings_per_partition, self.embedding_dim,
                                            device=param_device(config), dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        self.reset_parameters()

    def reset_parameters(self):
        """Draw the table (this rank's rows) as the constructor does."""
        if not self.config.perform_initialization or weights_on_meta(self):
            return
        if self.config.use_cpu_initialization:
            _initialize_affine_weight_cpu(self.weight, self.num_embeddings, self.embedding_dim,
                                          self.num_embeddings_per_partition, 0, self.init_method,
                                          params_dtype=self.config.params_dtype, tp_group=self.tp_group)
        else:
            _initialize_affine_weight_gpu(self.weight, self.init_method, partition_dim=0, stride=1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The table split along the vocabulary (TP axis 0); its global shape may differ on load (vocabulary
        padding depends on TP), the overlap is read."""
        weight_key = f"{prefix}weight"
        return {weight_key: make_tp_sharded_tensor_for_checkpoint(
            self.weight, weight_key, 0, prepend_offsets=sharded_offsets, allow_shape_mismatch=True,
            tp_group=getattr(self, "tp_group", None), dp_cp_group=(metadata or {}).get("dp_cp_group"))}

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tensor_model_parallel_size > 1:
            input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            masked_input = input_.clone() - self.vocab_start_index
            masked_input[input_mask] = 0
        else:
            masked_input = input_
        if self.gradient_accumulation_fusion and torch.is_grad_enabled() and self.weight.requires_grad:
            output_parallel = _EmbeddingWithGradAccumulation.apply(masked_input, self.weight)
        else:
            output_parallel = F.embedding(masked_input, self.weight)
        if self.tensor_model_parallel_size > 1:
            output_parallel = output_parallel.masked_fill(input_mask.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)


class _EmbeddingWithGradAccumulation(torch.autograd.Function):
    """``weight[ids]`` whose backward adds the gradient rows straight into ``weight.main_grad`` (when the
    data-parallel wrapper gave the weight one), as ``gradient_accumulation_fusion`` does for linear layers: the
    dense ``[V/tp, h]`` gradient that autograd's embedding backward builds (a zero-filled table, then added to
    main_grad) is never formed, only the ``s*b`` rows that were looked up are touched."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        main_grad = getattr(weight, "main_grad", None)
        if main_grad is None:
            grad_weight = torch.zeros_like(weight)
            grad_weight.index_add_(0, ids.reshape(-1), rows.to(weight.dtype))
            return None, grad_weight
        main_grad.index_add_(0, ids.reshape(-1), rows.to(main_grad.dtype))
        return None, None


class CpuOutputBuffer:
    """The output buffer of one CPU linear layer, kept between calls (an extension: the GPT and BERT heads use it).

    glibc's ``malloc`` serves blocks of 32 MiB and more with ``mmap`` and unmaps them on ``free``, so a
    ``[tokens, vocabulary]`` logits tensor allocated afresh on every step is page-faulted (and zero-filled by the
    kernel) again on every step: for the ``cpu`` preset of ``benchmarks/train_throughput.py`` (2048 tokens x 50304)
    that made the forward GEMM of the output layer take 650-780 ms instead of the 555 ms of the same GEMM writing
    into a live buffer. The layer keeps the storage and writes the next output into it when nothing references the
    previous output any more: the storage's use count is 1 (this object's own reference) once the loss, its
    in-place backward and the layer's backward have released it. While it is still referenced (several
    micro-batches in flight, a caller holding the logits) :meth:`get` returns ``None`` and the caller allocates as
    before. CUDA's caching allocator already reuses blocks, so only CPU outputs of at least ``min_bytes`` use it.
    """

    min_bytes = 32 * 1024 * 1024

    def __init__(self):
        self._storage = None

    @staticmethod
    def _in_use(storage) -> bool:
        return torch._C._storage_Use_Count(storage._cdata) > 1

    def get(self, shape, dtype, device_) -> Optional[torch.Tensor]:
        """An uninitialised tensor of ``shape`` on the kept storage, or ``None`` (GPU, small, or still in use)."""
        if device_.type != "cpu":
            return None
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes:
            return None
        storage = self._storage
        if storage is not None and self._in_use(storage):
            log_once("cpu_output_buffer_busy", "output layer: its kept CPU buffer is still referenced (several "
                     "micro-batches in flight?): allocating a new output tensor for this call")
            return None
        if storage is None or storage.nbytes() < nbytes:
            self._storage = storage = torch.UntypedStorage(nbytes, device=device_)
            log_once("cpu_output_buffer", f"output layer: keeping its {nbytes / 2**20:.0f} MiB CPU output buffer "
                     "between steps (large blocks are returned to the OS on free and page-faulted again)")
        return torch.empty(0, dtype=dtype, device=device_).set_(storage, 0, tuple(shape))


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """``X W^T + b`` whose backward overlaps the input-gradient all-reduce with the weight-gradient GEMM.

    * ``sequence_parallel``: the input arrives sharded along the sequence; forward all-gathers it (and
      backward gathers it again instead of keeping the full copy), the input gradient is reduce-scattered.
    * ``async_grad_allreduce``: the input-gradient all-reduce of a column-parallel layer is launched
      asynchronously before the weight-gradient GEMM and waited for afterwards.
    * ``gradient_accumulation_fusion``: the weight gradient is added straight into ``weight.main_grad``
      (the data-parallel gradient buffer) instead of being returned; apex's fused CUDA kernel is used when
      present, ``addmm_`` otherwise.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, async_grad_allreduce, sequence_parallel,
                fp8_meta=None, output_buffer=None, tp_group=None):
        ctx.save_for_backward(input, weight)
        # The parameter itself, for main_grad: under saved-tensor hooks (activation offloading, save_on_cpu) the
        # weight unpacked in backward is a new tensor object without the parameter's attributes.
        ctx.weight_param = weight if gradient_accumulation_fusion else None
        ctx.tp_group = tp_group
        ctx.fp8_meta = fp8_meta
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.async_grad_allreduce = async_grad_allreduce
        ctx.sequence_parallel = sequence_parallel

        if sequence_parallel:
            world_size, _ = tp_size_and_rank(tp_group)
            dim_size = list(input.size())
            dim_size[0] = dim_size[0] * world_size
            total_input = get_global_memory_buffer().get_tensor(dim_size, input.dtype, "mpu")
            all_gather_into_tensor(total_input, input.contiguous(),
                                   group=tp_group if tp_group is not None else get_tensor_model_parallel_group())
        else:
            total_input = input

        if fp8_meta is not None:
            output, ctx.fp8_saved = fp8_forward(fp8_meta, total_input, weight, bias)
            return output
        out_shape = (*total_input.shape[:-1], weight.shape[0])
        kept = output_buffer.get(out_shape, total_input.dtype, total_input.device) if output_buffer is not None else None
        if total_input.dim() >= 2 and (bias is not None or kept is not None):
            # One GEMM into a tensor of the final shape (the kept buffer, or a new one), starting from the bias when
            # there is one: no separate pass to add it, and the output is not a view (a loss may work in it in place).
            output = kept if kept is not None else torch.empty(out_shape, dtype=total_input.dtype,
                                                               device=total_input.device)
            input_2d, output_2d = total_input.reshape(-1, total_input.shape[-1]), output.view(-1, weight.shape[0])
            if bias is not None:
                torch.addmm(bias, input_2d, weight.t(), out=output_2d)
            else:
                torch.mm(input_2d, weight.t(), out=output_2d)
            return output
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        use_bias = ctx.use_bias
        group = ctx.tp_group if ctx.tp_group is not None else get_tensor_model_parallel_group()

        gather_handle = None
        if ctx.sequence_parallel:
            world_size, _ = tp_size_and_rank(ctx.tp_group)
            dim_size = list(input.size())
            dim_size[0] = dim_size[0] * world_size
            all_gather_buffer = get_global_memory_buffer().get_tensor(dim_size, input.dtype, "mpu")
            gather_handle = all_gather_into_tensor(all_gather_buffer, input.contiguous(),
                                                                     group=group, async_op=True)
            total_input = all_gather_buffer
        else:
            total_input = input

        if ctx.fp8_meta is not None:
            grad_input, fp8_grad_q = fp8_dgrad(ctx.fp8_meta, grad_output, ctx.fp8_saved)
        else:
            grad_input = grad_output.matmul(weight)
        if gather_handle is not None:
            gather_handle.wait()

        # Flatten [s, b, h] to [s*b, h] for the weight-gradient GEMM.
        grad_output = grad_output.contiguous()
        grad_output_2d = grad_output.view(-1, grad_output.shape[-1])
        total_input_2d = total_input.reshape(-1, total_input.shape[-1])

        reduce_handle = None
        if ctx.async_grad_allreduce:
            reduce_handle = torch.distributed.all_reduce(grad_input, group=group, async_op=True)

        sub_grad_input = None
        if ctx.sequence_parallel:
            assert not ctx.async_grad_allreduce
            dim_size = list(input.size())
            sub_grad_input = torch.empty(dim_size, dtype=input.dtype, device=grad_input.device, requires_grad=False)
            reduce_handle = reduce_scatter_tensor(sub_grad_input, grad_input.contiguous(),
                                                                    group=group, async_op=True)

        grad_weight = None
        if ctx.needs_input_grad[1] and ctx.fp8_meta is not None:
            grad_weight = fp8_wgrad(ctx.fp8_meta, fp8_grad_q, grad_output_2d, ctx.fp8_saved, total_input_2d)
            if ctx.gradient_accumulation_fusion:
                _add_into_main_grad(ctx.weight_param, grad_weight)
                grad_weight = None
        elif ctx.needs_input_grad[1]:
            if ctx.gradient_accumulation_fusion:
                _accumulate_into_main_grad(ctx.weight_param, total_input_2d, grad_output_2d)
            else:
                grad_weight = grad_output_2d.t().matmul(total_input_2d)
        grad_bias = grad_output_2d.sum(dim=0) if use_bias else None

        if reduce_handle is not None:
            reduce_handle.wait()
        if ctx.sequence_parallel:
            return sub_grad_input, grad_weight, grad_bias, None, None, None, None, None, None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


_WARNED_DEVICE_MAX_CONNECTIONS = False


def linear_with_grad_accumulation_and_async_allreduce(input, weight, bias, gradient_accumulation_fusion,
                                                      async_grad_allreduce, sequence_parallel, fp8_meta=None,
                                                      output_buffer: Optional[CpuOutputBuffer] = None, tp_group=None):
    """Functional form of :class:`LinearWithGradAccumulationAndAsyncCommunication` (``output_buffer``: an
    extension, see :class:`CpuOutputBuffer`)."""
    global _WARNED_DEVICE_MAX_CONNECTIONS
    if (async_grad_allreduce or sequence_parallel) and device.on_gpu() and not _WARNED_DEVICE_MAX_CONNECTIONS:
        if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
            warnings.warn(
                "When using sequence parallelism it is recommended to set the environment variable "
                "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup"
            )
            _WARNED_DEVICE_MAX_CONNECTIONS = True
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        input, weight, bias, gradient_accumulation_fusion, async_grad_allreduce, sequence_parallel, fp8_meta,
        output_buffer, tp_group
    )


class LinearWithFrozenWeight(torch.autograd.Function):
    """``y = x W^T (+ b)`` for a weight that does not train: only ``W`` is saved (not the input), backward returns
    ``dx = dy W`` (all-reduced over ``tp_group`` with ``allreduce_dgrad``) and no weight or bias gradient."""

    @staticmethod
    def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad, ctx.tp_group = allreduce_dgrad, tp_group
        output = torch.matmul(input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        (weight,) = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None


def linear_with_frozen_weight(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                              tp_group=None, grad_output_buffer=None, wgrad_deferral_limit=None,
                              async_grad_allreduce=None):
    """The parallel linears' path when ``weight.requires_grad`` is False (megatron-core's signature): with
    ``sequence_parallel`` the input is first gathered along the sequence (its gradient reduce-scattered back).
    ``gradient_accumulation_fusion`` has nothing to accumulate here; the wgrad-deferral arguments must stay None."""
    if grad_output_buffer is not None or wgrad_deferral_limit is not None:
        raise ValueError("linear_with_frozen_weight: grad_output_buffer / wgrad_deferral_limit apply to the trainable "
                         "path only")
    if async_grad_allreduce is not None:
        allreduce_dgrad = async_grad_allreduce
    group = tp_group if tp_group is not None else get_tensor_model_parallel_group()
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=group)
    return LinearWithFrozenWeight.apply(input, weight, bias, allreduce_dgrad, group)


def _fp8_meta_for(config) -> Optional[Fp8Meta]:
    """The FP8 scaling state of a new linear layer when the config asks for FP8 (else None)."""
    recipe = fp8_recipe_from_config(config)
    if recipe is None:
        return None
    try:
        group = parallel_state.get_amax_reduction_group()
        if getattr(config, "context_parallel_size", 1) > 1:  # CP ranks see different tokens: reduce over them too
            group = parallel_state.get_amax_reduction_group(with_context_parallel=True)
    except AssertionError as e:
        raise RuntimeError("FP8 linear layers reduce their amaxes over the amax reduction group: call "
                           "parallel_state.initialize_model_parallel(..., use_fp8=True) before building the model "
                           "(the training scripts do this for --fp8-format)") from e
    return Fp8Meta(recipe, amax_group=group)


def _reset_parallel_linear(layer, partition_dim: int) -> None:
    """A column- (``partition_dim`` 0) or row-parallel (1) layer's ``reset_parameters``: this rank's slice of the
    weight drawn as the constructor draws it (the full master weight with --use-cpu-initialization, else the
    TP-rank generator), a zero bias."""
    config = layer.config
    if not config.perform_initialization or weights_on_meta(layer):
        return
    if layer.weight is not None:
        per_partition = layer.weight.shape[partition_dim]
        if config.use_cpu_initialization:
            layer.master_weight = _initialize_affine_weight_cpu(
                layer.weight, layer.output_size, layer.input_size, per_partition, partition_dim, layer.init_method,
                stride=layer.stride, return_master_weight=layer.keep_master_weight_for_test,
                params_dtype=config.params_dtype, tp_group=layer.tp_group)
        else:
            _initialize_affine_weight_gpu(layer.weight, layer.init_method, partition_dim=partition_dim,
                                          stride=layer.stride)
    if layer.bias is not None:
        with torch.no_grad():
            layer.bias.zero_()


class ColumnParallelLinear(torch.nn.Module):
    """``Y = XA + b`` with ``A`` split along its output dimension. Returns ``(output, bias_or_None)``."""

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig, init_method: Callable,
                 bias: bool = True, gather_output: bool = False, stride: int = 1,
                 keep_master_weight_for_test: bool = False, skip_bias_add: bool = False,
                 skip_weight_param_allocation: bool = False, embedding_activation_buffer=None,
                 grad_output_buffer=None, is_expert: bool = False, tp_comm_buffer_name: Optional[str] = None,
                 disable_grad_reduce: bool = False, tp_group=None, reuse_cpu_output_buffer: bool = False):
        super().__init__()
        if embedding_activation_buffer is not None or grad_output_buffer is not None or disable_grad_reduce:
            raise NotImplementedError("ColumnParallelLinear: embedding_activation_buffer / grad_output_buffer "
                                      "(--defer-embedding-wgrad-compute) and disable_grad_reduce are not implemented")
        self.is_expert = is_expert
        self.tp_group = tp_group
        self.input_size = input_size
        # An extension (see CpuOutputBuffer): the model heads keep their vocabulary-sized logits buffer on CPU.
        self.output_buffer = CpuOutputBuffer() if reuse_cpu_output_buffer else None
        self.output_size = output_size
        self.gather_output = gather_output
        world_size, _ = tp_size_and_rank(tp_group)
        self.output_size_per_partition = divide(output_size, world_size)
        self.skip_bias_add = skip_bias_add
        self.config = config

        self.init_method, self.stride, self.keep_master_weight_for_test = init_method, stride, keep_master_weight_for_test
        if not skip_weight_param_allocation:
            self.weight = Parameter(torch.empty(self.output_size_per_partition, self.input_size,
                                                device=param_device(config), dtype=config.params_dtype))
            set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
        else:
            self.weight = None

        if bias:
            self.bias = Parameter(torch.empty(self.output_size_per_partition, device=param_device(config),
                                              dtype=config.params_dtype))
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

        self.async_tensor_model_parallel_allreduce = config.async_tensor_model_parallel_allreduce and world_size > 1
        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel and world_size <= 1:
            warnings.warn(
                f"`sequence_parallel` is set to `True`, but tensor model parallel size is {world_size}. "
                "Disabling sequence parallel."
            )
            self.sequence_parallel = False
        if self.async_tensor_model_parallel_allreduce and self.sequence_parallel:
            raise RuntimeError(
                "`async_tensor_model_parallel_allreduce` and `sequence_parallel` cannot be enabled at the same time."
            )
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.fp8_meta = _fp8_meta_for(config)

    def reset_parameters(self):
        """This rank's columns drawn as the constructor draws them (the meta-device materialisation calls it)."""
        _reset_parallel_linear(self, 0)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Weight and bias split along the output features (TP axis 0)."""
        return _linear_sharded_state_dict(self, prefix, sharded_offsets, metadata, {"weight": 0, "bias": 0})

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None):
        if weight is None:
            if self.weight is None:
                raise RuntimeError(
                    "weight was not supplied to ColumnParallelLinear forward pass and "
                    "skip_weight_param_allocation is True."
                )
            weight = self.weight
        else:
            expected_shape = (self.output_size_per_partition, self.input_size)
            if tuple(weight.shape) != expected_shape:
                raise RuntimeError(
                    f"supplied weight's shape is {tuple(weight.shape)}, not {expected_shape} as expected"
                )

        bias = self.bias if not self.skip_bias_add else None
        if self.async_tensor_model_parallel_allreduce or self.sequence_parallel:
            input_parallel = input_
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_, self.tp_group)

        if not weight.requires_grad and self.fp8_meta is None and self.output_buffer is None:
            output_parallel = linear_with_frozen_weight(
                input_parallel, weight, bias, self.gradient_accumulation_fusion,
                allreduce_dgrad=self.async_tensor_model_parallel_allreduce, sequence_parallel=self.sequence_parallel,
                tp_group=self.tp_group)
        else:
            output_parallel = linear_with_grad_accumulation_and_async_allreduce(
                input=input_parallel, weight=weight, bias=bias,
                gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                async_grad_allreduce=self.async_tensor_model_parallel_allreduce,
                sequence_parallel=self.sequence_parallel, fp8_meta=self.fp8_meta, output_buffer=self.output_buffer,
                tp_group=self.tp_group,
            )
        if self.gather_output:
            if self.sequence_parallel:
                raise RuntimeError("gather_output=True is not supported with sequence parallelism")
            output = gather_from_tensor_model_parallel_region(output_parallel, self.tp_group)
        else:
            output = output_parallel
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias


class RowParallelLinear(torch.nn.Module):
    """``Y = XA + b`` with ``A`` split along its input dimension. Returns ``(output, bias_or_None)``."""

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig, init_method: Callable,
                 bias: bool = True, input_is_parallel: bool = False, stride: int = 1,
                 keep_master_weight_for_test: bool = False, skip_bias_add: bool = False, is_expert: bool = False,
                 tp_comm_buffer_name: Optional[str] = None, tp_group=None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.is_expert = is_expert
        self.tp_group = tp_group
        world_size, _ = tp_size_and_rank(tp_group)
        self.input_size_per_partition = divide(input_size, world_size)
        self.skip_bias_add = skip_bias_add
        self.config = config
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel and not self.input_is_parallel:
            raise RuntimeError("To enable `sequence_parallel`, `input_is_parallel` must be `True`")

        self.init_method, self.stride, self.keep_master_weight_for_test = init_method, stride, keep_master_weight_for_test
        self.weight = Parameter(torch.empty(self.output_size, self.input_size_per_partition,
                                            device=param_device(config), dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)

        if bias:
            self.bias = Parameter(torch.empty(self.output_size, device=param_device(config),
                                              dtype=config.params_dtype))
            # The bias is replicated; with sequence parallelism each rank sees a different part of the
            # sequence, so its gradient must be all-reduced over the TP group.
            setattr(self.bias, "sequence_parallel", self.sequence_parallel)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        self.fp8_meta = _fp8_meta_for(config)

    def reset_parameters(self):
        """This rank's rows drawn as the constructor draws them (the meta-device materialisation calls it)."""
        _reset_parallel_linear(self, 1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Weight split along the input features (TP axis 1); the bias is replicated."""
        return _linear_sharded_state_dict(self, prefix, sharded_offsets, metadata, {"weight": 1})

    def forward(self, input_: torch.Tensor):
        if self.input_is_parallel:
            input_parallel = input_
        else:
            assert not self.sequence_parallel
            input_parallel = scatter_to_tensor_model_parallel_region(input_, self.tp_group)
        if not self.weight.requires_grad and self.fp8_meta is None:
            output_parallel = linear_with_frozen_weight(input_parallel, self.weight, None,
                                                        self.gradient_accumulation_fusion, allreduce_dgrad=False,
                                                        sequence_parallel=False, tp_group=self.tp_group)
        else:
            output_parallel = linear_with_grad_accumulation_and_async_allreduce(
                input=input_parallel, weight=self.weight, bias=None,
                gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                async_grad_allreduce=False, sequence_parallel=False, fp8_meta=self.fp8_meta, tp_group=self.tp_group,
            )
        if self.sequence_parallel:
            output_ = reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)
        else:
            output_ = reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)
        if not self.skip_bias_add:
            output = output_ + self.bias if self.bias is not None else output_
            output_bias = None
        else:
            output = output_
            output_bias = self.bias
        return output, output_bias


class InitializedLinear(torch.nn.Linear):
    """``torch.nn.Linear`` replicated on every rank whose weight is drawn again with ``init_method`` after torch's
    own initialisation (both draws, as a plain ``nn.Linear`` followed by ``init_method`` makes them), and whose bias
    is zero. ``fp32_master``: draw the weight in fp32 and round it to the layer's dtype."""

    def __init__(self, in_features: int, out_features: int, init_method: Callable, *, bias: bool = True,
                 fp32_master: bool = False, perform_initialization: bool = True, dtype=None, device=None):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, device=device)  # torch's draw
        self.init_method, self.fp32_master, self.perform_initialization = init_method, fp32_master, perform_initialization
        self._draw()

    def _draw(self):
        if weights_on_meta(self):
            return
        with torch.no_grad():
            if self.perform_initialization:
                if self.fp32_master:
                    weight = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
                    self.init_method(weight)
                    self.weight.copy_(weight)
                else:
                    self.init_method(self.weight)
            if self.bias is not None:
                self.bias.zero_()

    def reset_parameters(self):
        super().reset_parameters()
        if hasattr(self, "init_method"):  # not while nn.Linear's constructor runs (the constructor draws next)
            self._draw()


class DuplicatedLinear(torch.nn.Module):
    """``Y = XA + b`` with the whole weight on every tensor-parallel rank (Transformer Engine's
    ``parallel_mode='duplicated'``), applied to the rank's own input: under sequence parallelism each rank
    projects its own tokens and the weight is marked ``sequence_parallel`` so that its gradient is summed over the
    TP group; without it every rank computes the same product. Multi-latent attention's down projections.
    Returns ``(output, bias_or_None)``."""

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig, init_method: Callable,
                 bias: bool = False, skip_bias_add: bool = False, tp_group=None):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = skip_bias_add
        self.tp_group = tp_group  # None: parallel_state's TP group
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        sequence_parallel = config.sequence_parallel and tp_size_and_rank(tp_group)[0] > 1
        self.config, self.init_method = config, init_method
        self.weight = Parameter(torch.empty(output_size, input_size, device=param_device(config),
                                            dtype=config.params_dtype))
        self.reset_parameters()
        set_tensor_model_parallel_attributes(self.weight, False, 0, 1)
        setattr(self.weight, "sequence_parallel", sequence_parallel)
        if bias:
            self.bias = Parameter(torch.zeros(output_size, device=param_device(config), dtype=config.params_dtype))
            set_tensor_model_parallel_attributes(self.bias, False, 0, 1)
            setattr(self.bias, "sequence_parallel", sequence_parallel)
        else:
            self.register_parameter("bias", None)
        self.fp8_meta = _fp8_meta_for(config)

    def reset_parameters(self):
        """The weight drawn in full from the default generator (the same on every TP rank), like a CPU-initialised
        master weight; a zero bias."""
        if weights_on_meta(self):
            return
        if self.config.perform_initialization:
            weight = torch.empty(self.output_size, self.input_size, dtype=torch.float32)
            self.init_method(weight)
            with torch.no_grad():
                self.weight.copy_(weight)
        if getattr(self, "bias", None) is not None:
            with torch.no_grad():
                self.bias.zero_()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The whole weight (and bias) replicated over TP, with megatron-core's empty ``_extra_state`` object."""
        return _linear_sharded_state_dict(self, prefix, sharded_offsets, metadata, {})

    def forward(self, input_: torch.Tensor):
        bias = self.bias if not self.skip_bias_add else None
        output = linear_with_grad_accumulation_and_async_allreduce(
            input=input_, weight=self.weight, bias=bias, gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            async_grad_allreduce=False, sequence_parallel=False, fp8_meta=self.fp8_meta)
        return output, (self.bias if self.skip_bias_add else None)

"""Small utilities shared by the whole library (megatron.core.utils)."""
from __future__ import annotations

import math
from operator import itemgetter
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from megatron.core.global_memory_buffer import GlobalMemoryBuffer  # noqa: F401  (megatron-core's path)
from megatron.core.wgrad_compute import accumulate_into_main_grad as _accumulate_into_main_grad
from megatron.core.straggler_detector import StragglerDetector  # noqa: F401  (megatron-core's path)
from megatron.core.cp_batch import (context_parallel_chunk_indices, get_batch_on_this_cp_rank,  # noqa: F401
                                    get_batch_on_this_hybrid_cp_rank, get_thd_batch_on_this_cp_rank,
                                    thd_partitioned_indices)


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


def prepare_input_tensors_for_wgrad_compute(grad_output, all_gathered_input):
    """``(grad_output, all_gathered_input)`` made contiguous and, when 3-D (``[s, b, h]``), viewed as 2-D
    ``[s * b, h]`` for the wgrad GEMM (megatron-core's helper); 2-D inputs keep their shape."""
    grad_output = grad_output.contiguous()
    all_gathered_input = all_gathered_input.contiguous()
    if grad_output.dim() == 3:
        grad_output = grad_output.view(-1, grad_output.shape[2])
        all_gathered_input = all_gathered_input.view(-1, all_gathered_input.shape[2])
    return grad_output, all_gathered_input


def drain_embedding_wgrad_compute(config, embedding_activation_buffer, grad_output_buffer, weight, tp_group):
    """megatron-core keeps, on the last pipeline stage, each microbatch's input activation of the tied output /
    embedding GEMM (``embedding_activation_buffer``) and its output gradient (``grad_output_buffer``) and computes
    that weight's gradient in the pipeline flush: ``main_grad += sum_i g_i^T @ AllGather_TP(x_i)``.

    Empty the two buffers (equal lengths, microbatch order; both are popped) and, with
    ``config.gradient_accumulation_fusion``, add each microbatch's ``g_i^T @ x_i`` into ``weight.main_grad``
    (``x_i`` all-gathered over ``tp_group`` along dim 0 under ``config.sequence_parallel``). Without gradient
    accumulation fusion the buffers are emptied and nothing is accumulated, as in megatron-core (the weight
    gradient then came through autograd). A Megatron-FSDP parameter (``__fsdp_param__``) gets its ``main_grad``
    from ``get_main_grad()`` first. megatron-core overlaps the next all-gather with the current GEMM on GPUs; here
    they run in turn (same result)."""
    if len(embedding_activation_buffer) != len(grad_output_buffer):
        raise ValueError(f"drain_embedding_wgrad_compute: {len(embedding_activation_buffer)} activations but "
                         f"{len(grad_output_buffer)} output gradients; the two buffers must have equal lengths")
    while embedding_activation_buffer:
        activation = embedding_activation_buffer.pop(0)
        grad_output = grad_output_buffer.pop(0)
        if config.sequence_parallel:
            gathered = torch.empty((activation.shape[0] * tp_group.size(),) + tuple(activation.shape[1:]),
                                   dtype=activation.dtype, device=activation.device)
            all_gather_into_tensor(gathered, activation.contiguous(), group=tp_group)
            activation = gathered
        grad_output, activation = prepare_input_tensors_for_wgrad_compute(grad_output, activation)
        if hasattr(weight, "__fsdp_param__"):
            weight.main_grad = weight.get_main_grad()
        if config.gradient_accumulation_fusion:
            _accumulate_into_main_grad(weight, activation, grad_output)


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


def get_attr_wrapped_model(model, attr: str, allow_none: bool = True, return_model_obj: bool = False):
    """Find ``attr`` on ``model`` or on the first ``.module`` in its wrapper chain that has it (with
    ``allow_none=False``: that has it set to something other than None); return its value, or with
    ``return_model_obj`` the object that holds it."""
    if isinstance(model, list):
        raise RuntimeError("get_attr_wrapped_model does not support lists of model chunks")
    while (not hasattr(model, attr)) if allow_none else getattr(model, attr, None) is None:
        if not hasattr(model, "module"):
            raise RuntimeError(f"couldn't find attribute {attr} on the model or its wrappers")
        model = model.module
    return model if return_model_obj else getattr(model, attr)


def get_mamba_inference_state_config_from_model(model):
    """A :class:`MambaInferenceStateConfig` (layer symbols, per-request conv and SSM state shapes) when the model's
    decoder (through its wrappers) is a hybrid stack with a Mamba layer (``"M"``, the hybrid pattern's symbol);
    None otherwise."""
    from megatron.core.inference.contexts.attention_context.mamba_metadata import MambaInferenceStateConfig

    decoder = get_attr_wrapped_model(model, "decoder")
    layer_type_list = getattr(decoder, "layer_type_list", None)
    if layer_type_list is None or "M" not in layer_type_list:
        return None
    conv_shape, ssm_shape = decoder.mamba_state_shapes_per_request()
    return MambaInferenceStateConfig(layer_type_list=layer_type_list, mamba_conv_states_shape=conv_shape,
                                     mamba_ssm_states_shape=ssm_shape)


def get_model_type(model):
    return get_attr_wrapped_model(model, "model_type")


def get_model_config(model):
    return get_attr_wrapped_model(model, "config", allow_none=False)


def get_model_xattn(model):
    """The model's ``xattn_needed`` (whether it needs cross-attention inputs, e.g. multimodal decoders), looked up
    through its wrappers; False when no layer of the chain defines it."""
    try:
        return get_attr_wrapped_model(model, "xattn_needed")
    except RuntimeError:
        return False


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


# ------------------------------------------------------------------------------------------- versions, decorators
def null_decorator(*args, **kwargs):
    """A decorator that changes nothing (``@null_decorator`` or ``@null_decorator(...)``)."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda func: func


class ExperimentalNotEnabledError(Exception):
    """An experimental feature was used without ``megatron.core.config.set_experimental_flag(True)``."""


def _experimental(kind: str, introduced_with_version: str):
    from megatron.core import config

    def decorator(obj):
        def check(name):
            if not config.is_experimental_enabled():
                raise ExperimentalNotEnabledError(f"{name} is an experimental {kind} (since megatron-core "
                                                  f"{introduced_with_version}): call "
                                                  "megatron.core.config.set_experimental_flag(True) first")

        if isinstance(obj, type):
            original_init = obj.__init__

            def __init__(self, *args, **kwargs):
                check(obj.__name__)
                original_init(self, *args, **kwargs)

            obj.__init__ = __init__
            return obj

        def wrapper(*args, **kwargs):
            check(obj.__name__)
            return obj(*args, **kwargs)

        wrapper.__name__, wrapper.__doc__ = obj.__name__, obj.__doc__
        return wrapper

    return decorator


def experimental_fn(introduced_with_version: str):
    """Decorate a function that raises :class:`ExperimentalNotEnabledError` unless experimental features are on."""
    return _experimental("function", introduced_with_version)


def experimental_cls(introduced_with_version: str):
    """Decorate a class whose instantiation needs experimental features on."""
    return _experimental("class", introduced_with_version)


def deprecated(version: str, removal_version: Optional[str] = None, alternative: Optional[str] = None,
               reason: Optional[str] = None):
    """Decorate a function or class that warns (once per call site) that it is deprecated."""
    import warnings

    def decorator(obj):
        message = f"{obj.__qualname__} is deprecated since {version}"
        if removal_version:
            message += f" and will be removed in {removal_version}"
        if alternative:
            message += f"; use {alternative}"
        if reason:
            message += f" ({reason})"

        def wrapper(*args, **kwargs):
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            return obj(*args, **kwargs)

        wrapper.__name__, wrapper.__doc__, wrapper.__wrapped__ = obj.__name__, obj.__doc__, obj
        return wrapper

    return decorator


def internal_api(obj):
    """Marks an API as internal (no stability promise); changes nothing at run time."""
    obj._internal_api = True
    return obj


def experimental_api(obj):
    """Marks an API as experimental (may change); changes nothing at run time (see :func:`experimental_fn`)."""
    obj._experimental_api = True
    return obj


def _package_version(name: str):
    from importlib import metadata

    from packaging.version import Version

    return Version(metadata.version(name))


def get_torch_version():
    """The installed PyTorch version (``packaging.version.Version``)."""
    from packaging.version import Version

    return Version(torch.__version__.split("+")[0])


def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    from packaging.version import Version

    return get_torch_version() >= Version(version) if check_equality else get_torch_version() > Version(version)


def _optional_version(dist_names, version: str, check_equality: bool) -> bool:
    """Whether one of the optional distributions ``dist_names`` is installed at ``version`` or later (False when
    none is installed: these are the GPU libraries this library runs without)."""
    from importlib import metadata

    from packaging.version import Version

    for name in dist_names:
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            continue
        return installed >= Version(version) if check_equality else installed > Version(version)
    return False


def _optional_get_version(dist_names, what: str):
    from importlib import metadata

    from packaging.version import Version

    for name in dist_names:
        try:
            return Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            continue
    raise ImportError(f"{what} is not installed (this library runs without it)")


_TE, _FA, _MAMBA, _CONV1D = ("transformer_engine", "transformer-engine"), ("flash_attn", "flash-attn"), \
    ("mamba_ssm", "mamba-ssm"), ("causal_conv1d", "causal-conv1d")


def get_te_version():
    return _optional_get_version(_TE, "Transformer Engine")


def is_te_min_version(version: str, check_equality: bool = True) -> bool:
    return _optional_version(_TE, version, check_equality)


def get_fa_version():
    return _optional_get_version(_FA, "flash-attn")


def is_fa_min_version(version: str, check_equality: bool = True) -> bool:
    return _optional_version(_FA, version, check_equality)


def get_mamba_version():
    return _optional_get_version(_MAMBA, "mamba_ssm")


def is_mamba_min_version(version: str, check_equality: bool = True) -> bool:
    return _optional_version(_MAMBA, version, check_equality)


def get_causal_conv1d_version():
    return _optional_get_version(_CONV1D, "causal_conv1d")


def is_causal_conv1d_min_version(version: str, check_equality: bool = True) -> bool:
    return _optional_version(_CONV1D, version, check_equality)


# ------------------------------------------------------------------------------------------- groups, models
def get_tensor_model_parallel_group_if_none(tp_group=None, is_expert: bool = False, check_initialized: bool = True):
    """``tp_group``, or parallel_state's TP group (the expert TP group for experts) when None."""
    if tp_group is not None:
        return tp_group
    from megatron.core import parallel_state

    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)


def get_pg_src_rank(group=None) -> int:
    """Global rank of the first member of ``group`` (0 without torch.distributed)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0
    return torch.distributed.get_global_rank(group, 0) if group is not None else 0


def log_on_each_pipeline_stage(logger, *args, tp_group=None, dp_cp_group=None, **kwargs):
    """``logger.log(*args)`` on the first TP and DP (x CP) rank of every pipeline stage."""
    tp_rank, _, dp_rank, _ = _tp_dp_ranks(tp_group, dp_cp_group)
    if tp_rank == 0 and dp_rank == 0:
        logger.log(*args, **kwargs)


def is_submodule(module: torch.nn.Module, parent_module: torch.nn.Module, strict: bool = True) -> bool:
    """Whether ``module`` is ``parent_module`` or one of its descendants (``strict``: a proper descendant)."""
    for child in parent_module.modules():
        if child is module and (child is not parent_module or not strict):
            return True
    return False


def unwrap_model(model, module_instances=None):
    """Strip wrappers (DDP, Float16Module: anything with ``.module``; only ``module_instances`` when given) from a
    model or a list of model chunks."""
    return_list = isinstance(model, list)
    chunks = model if return_list else [model]
    unwrapped = []
    for chunk in chunks:
        while hasattr(chunk, "module") and (module_instances is None or isinstance(chunk, module_instances)):
            chunk = chunk.module
        unwrapped.append(chunk)
    return unwrapped if return_list else unwrapped[0]


def to_local_if_dtensor(tensor):
    """The local shard of a DTensor; any other tensor as it is."""
    return tensor._local_tensor if _is_dtensor(tensor) else tensor


def get_full_tensor_if_necessary(tensor):
    """A DTensor's local shard, or its full value when some rank of its mesh would hold an empty shard."""
    from torch.distributed.tensor import Shard

    for dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard) and tensor.device_mesh.shape[dim] > tensor.shape[placement.dim]:
            return tensor.full_tensor()
    return tensor._local_tensor


def get_data_parallel_group_if_dtensor(tensor, data_parallel_group=None):
    """The process group a DTensor is sharded over (its mesh's single dimension), else ``data_parallel_group``."""
    if not _is_dtensor(tensor):
        return data_parallel_group
    mesh = tensor.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"a DTensor on a {mesh.ndim}-dimensional mesh has no single data-parallel group")
    return mesh.get_group()


def check_param_hashes_across_dp_replicas(model, cross_check: bool = False) -> bool:
    """Whether every parameter is bit-identical on all data-parallel replicas (one all-gather of sha256 digests
    over parallel_state's DP group); mismatches are printed. ``cross_check``: compare all ranks' digests, not
    only with rank 0's."""
    import hashlib

    from megatron.core import parallel_state

    chunks = model if isinstance(model, list) else [model]
    digests = []
    for i, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            data = to_local_if_dtensor(param.data).detach().cpu().contiguous()
            digests.append((f"{i}.{name}", hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()))
    group = parallel_state.get_data_parallel_group()
    everyone = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, digests, group=group)
    mine, ok = dict(digests), True
    references = everyone if cross_check else everyone[:1]
    for rank, theirs in enumerate(references):
        for name, digest in theirs:
            if mine.get(name) != digest:
                print(f"parameter {name} differs from data-parallel rank {rank}'s", flush=True)
                ok = False
    return ok


class WrappedTensor:
    """Holds a tensor so that a callee can drop the caller's last reference (``unwrap`` then ``clear``)."""

    def __init__(self, tensor: torch.Tensor):
        self._wrapper = [tensor]

    def unwrap(self) -> torch.Tensor:
        return self._wrapper[0]

    def clear(self) -> None:
        self._wrapper[0] = None


# ------------------------------------------------------------------------------------------- multi-tensor ops
def local_multi_tensor_applier(op, noop_flag_buffer, tensor_lists, *args):
    """apex's ``multi_tensor_applier`` interface without apex: ``op(2048, noop_flag_buffer, tensor_lists, *args)``."""
    return op(2048 * 32, noop_flag_buffer, tensor_lists, *args)


def local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """The L2 norm of all tensors of ``tensor_lists[0]`` (fp32, a one-element tensor) and, with ``per_tensor``,
    each tensor's norm."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1), (torch.zeros(0) if per_tensor else None)
    norms = torch.stack([t.detach().float().norm(2) for t in tensors])
    total = norms.pow(2).sum().sqrt().reshape(1)
    return total, (norms if per_tensor else None)


def local_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``tensor_lists[1][i] = tensor_lists[0][i] * scale`` for every i."""
    for source, target in zip(tensor_lists[0], tensor_lists[1]):
        target.copy_(source * scale)


def is_using_quantization_scales(config) -> bool:
    """Whether the config trains with FP8 (or FP4) scaling state."""
    return getattr(config, "fp8", None) is not None or getattr(config, "fp4", None) is not None


def deprecate_inference_params(inference_context, inference_params):
    """megatron-core renamed ``inference_params`` to ``inference_context``: the one that is given."""
    if inference_context is None and inference_params is not None:
        return inference_params
    return inference_context


def nvtx_range_push(msg: str = None, suffix: str = None) -> None:
    """Open an NVTX range on CUDA (nothing elsewhere)."""
    if torch.cuda.is_available():
        torch.cuda.nvtx.range_push(msg if suffix is None else f"{msg}.{suffix}")


def nvtx_range_pop(msg: str = None, suffix: str = None) -> None:
    if torch.cuda.is_available():
        torch.cuda.nvtx.range_pop()


def nvtx_decorator(message: str = None, color=None):
    """Run the decorated function inside an NVTX range on CUDA."""
    def decorator(func):
        def wrapper(*args, **kwargs):
            nvtx_range_push(message or func.__qualname__)
            try:
                return func(*args, **kwargs)
            finally:
                nvtx_range_pop()

        wrapper.__name__, wrapper.__doc__ = func.__name__, func.__doc__
        return wrapper

    return decorator


def get_asyncio_loop():
    """The running asyncio event loop, or a new one set as current."""
    import asyncio

    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        return loop


def trace_async_exceptions(func):
    """Decorate a coroutine function so that an exception is printed with its traceback before propagating."""
    import functools
    import traceback

    @functools.wraps(func)
    async def wrapper(*args, **kwargs):
        try:
            return await func(*args, **kwargs)
        except Exception:
            traceback.print_exc()
            raise

    return wrapper

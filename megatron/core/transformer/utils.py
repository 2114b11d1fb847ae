"""Helpers of the transformer modules (megatron-core's ``megatron.core.transformer.utils``): masks, activations, and
the default sharded state of a module.

``sharded_state_dict_default(module, prefix, sharded_offsets, metadata)`` is what a module without its own
``sharded_state_dict`` declares: its own tensors as :class:`ShardedTensor` s replicated over TP and DP (replica id
``(0, tp rank, dp rank)``), except that a parameter marked tensor-parallel (``tensor_model_parallel`` with
``partition_dim``) is split along that axis, ``_extra_state`` entries as :class:`ShardedObject` s; then each child
the same way (a child with its own ``sharded_state_dict`` — inside a ``ModuleList`` too — declares itself). ``sharded_offsets`` — ``(axis, offset, fragments)`` triples — become prepended global
axes (the layer index of a stacked ``decoder.layers.*`` tensor, the expert index).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.activations import erf_gelu, openai_gelu  # noqa: F401  (megatron-core's path)
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.utils import apply_prefix_mapping
from megatron.core.fusions.fused_layer_norm import param_device
from megatron.core.fusions.fused_softmax import attention_mask_func  # noqa: F401  (megatron-core's path)
from megatron.core.transformer.transformer_config import is_layer_window_attention  # noqa: F401  (megatron-core's path)
from megatron.core.utils import (make_sharded_object_for_checkpoint, make_sharded_tensor_for_checkpoint,  # noqa: F401
                                 make_sharded_tensors_for_checkpoint, make_tp_sharded_tensor_for_checkpoint)


def get_default_causal_mask(sq: int) -> torch.Tensor:
    """``[sq, sq]`` boolean mask, True above the diagonal (masked)."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def get_sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    """``[sq, skv]`` boolean mask (True = masked) of causal attention limited to ``window_size = (left, right)``
    positions; queries are aligned with the last ``sq`` keys."""
    left, right = window_size
    q = torch.arange(skv - sq, skv).unsqueeze(1)
    k = torch.arange(skv).unsqueeze(0)
    masked = k > q + min(right, 0) if right is not None and right >= 0 else k > q
    if left is not None and left >= 0:
        masked = masked | (k < q - left)
    return masked


def get_linear_layer(rows, columns, init_method, perform_initialization=True, config=None):
    """A replicated ``torch.nn.Linear(rows, columns)`` with ``init_method`` weights and a zero bias (``config``
    gives the dtype, the device and whether to initialise)."""
    kwargs = {}
    if config is not None:
        kwargs = {"dtype": config.params_dtype, "device": param_device(config)}
        perform_initialization = config.perform_initialization
    return tensor_parallel.InitializedLinear(rows, columns, init_method, perform_initialization=perform_initialization,
                                             **kwargs)


def gelu_impl(x):
    """OpenAI's tanh approximation of GeLU."""
    return openai_gelu(x)


def ensure_metadata_has_dp_cp_group(metadata: Optional[dict]) -> dict:
    """``metadata`` with ``dp_cp_group`` set (parallel_state's DP x CP group unless given)."""
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise TypeError(f"sharded_state_dict metadata must be a dict, got {type(metadata).__name__}")
    if "dp_cp_group" not in metadata:
        metadata["dp_cp_group"] = (parallel_state.get_data_parallel_group(with_context_parallel=True)
                                   if parallel_state.is_initialized() else None)
    return metadata


def sharded_state_dict_default(module: torch.nn.Module, prefix: str = "",
                               sharded_offsets: Tuple[Tuple[int, int, int], ...] = (),
                               metadata: Optional[dict] = None, tp_group=None) -> ShardedStateDict:
    """``module.sharded_state_dict(...)`` when it has one, else the default of the module docstring."""
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    if hasattr(module, "sharded_state_dict"):
        return module.sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
    # A plain module: its own tensors, then its children the same way (a ModuleList of MegatronModules keeps their
    # declarations).
    return own_and_children_sharded_state_dict(module, prefix, sharded_offsets, metadata, tp_group)


def own_and_children_sharded_state_dict(module: torch.nn.Module, prefix: str, sharded_offsets, metadata: dict,
                                        tp_group=None) -> ShardedStateDict:
    """``module``'s own parameters and persistent buffers (split over TP along ``partition_dim`` when marked
    tensor-parallel, replicated otherwise), then each child's :func:`sharded_state_dict_default`. The TP group is
    ``tp_group``, else ``metadata['tp_group']`` (a model built from a pg_collection sets it), else parallel_state's."""
    if tp_group is None:
        tp_group = metadata.get("tp_group")
    own = {}
    module._save_to_state_dict(own, "", keep_vars=True)
    axis_map = {name: t.partition_dim for name, t in own.items()
                if getattr(t, "tensor_model_parallel", False) and getattr(t, "partition_dim", -1) >= 0}
    out = make_sharded_tensors_for_checkpoint(own, prefix, axis_map, sharded_offsets, tp_group=tp_group,
                                              dp_cp_group=metadata["dp_cp_group"])
    for name, child in module.named_children():
        out.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata, tp_group))
    return out


def apply_sharded_keys_map(sharded_state_dict: ShardedStateDict, prefix: str, keys_map: dict) -> ShardedStateDict:
    """Rename the checkpoint keys under ``prefix`` by a layer spec's ``sharded_state_dict_keys_map`` ({old key
    prefix: new key prefix}, relative to ``prefix``); returns the dict."""
    if keys_map:
        apply_prefix_mapping(sharded_state_dict, {f"{prefix}{old}": f"{prefix}{new}" for old, new in keys_map.items()})
    return sharded_state_dict


def set_model_to_sequence_parallel(model, set_to: bool = False, exclude_modules=None) -> None:
    """Turn sequence parallelism on or off in a built model (e.g. off for inference): ``model.config.sequence_parallel``
    and every ``sequence_parallel`` / ``scatter_to_sequence_parallel`` / ``reduce_scatter_embeddings`` attribute of
    the model's modules (the last one not for learned absolute positions) become ``set_to``; the modules in
    ``exclude_modules`` and everything below them keep theirs."""
    attrs = ["sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings"]
    if getattr(model, "position_embedding_type", None) == "learned_absolute":
        attrs.remove("reduce_scatter_embeddings")
    model.config.sequence_parallel = set_to
    excluded = {id(m) for m in (exclude_modules or [])}

    def visit(module):
        if id(module) in excluded:
            return
        for attr in attrs:
            if hasattr(module, attr):
                setattr(module, attr, set_to)
        for child in module._modules.values():
            if child is not None:
                visit(child)

    visit(model)

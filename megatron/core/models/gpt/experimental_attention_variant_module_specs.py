"""megatron-core's specs for the experimental attention variants: Gated DeltaNet layers (Qwen3-Next,
:mod:`megatron.core.ssm.gated_delta_net`) mixed with standard attention, DeepSeek sparse attention
(:mod:`megatron.core.transformer.experimental_attention_variant.dsa`) inside multi-latent attention, and a block
spec that picks per layer the attention (``linear_attention_freq``) and the MLP (``moe_layer_freq``) independently.

Patterns: ``get_linear_attention_pattern`` gives 1 (GDN) / 0 (standard attention) per layer: an int ``N`` makes every
``N``-th layer (1-based) standard attention, a list is the pattern; ``get_moe_layer_pattern`` gives 1 (MoE) / 0
(dense): an int ``N`` makes layers ``0, N, 2N, ...`` (0-based) MoE. The block spec holds the layers of one pipeline
stage (megatron-core's slicing). Where megatron-core's functions need Transformer Engine (its default backend), this
library's layers are used (:class:`~megatron.core.models.backends.LocalSpecProvider`): the input norm of a GDN or
standard-attention layer and the pre-MLP norm of a dense layer are then modules of their own, saved under the keys
Transformer Engine's fused layers use (``self_attention.in_proj.layer_norm_weight`` ...). Unlike megatron-core 0.16.1,
``get_experimental_attention_variant_module_spec`` also returns the DSA spec for ``"dsa"``.
"""
from __future__ import annotations

import dataclasses

from typing import List, Optional

from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec, get_mla_self_attention_spec,
                                                      get_mlp_module_spec_for_backend)
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.transformer.experimental_attention_variant.dsa import (DSAIndexer, DSAIndexerSubmodules,
                                                                          DSAttention, DSAttentionSubmodules)
from megatron.core.transformer.fusions import get_bias_dropout_add
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import IdentityOp, ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (TransformerLayer, TransformerLayerSubmodules,
                                                          get_transformer_layer_offset)

__all__ = ["get_gated_delta_net_module_spec", "get_dsa_module_spec_for_backend",
           "get_experimental_attention_variant_module_spec",
           "get_transformer_block_with_experimental_attention_variant_spec", "is_linear_attention_variant",
           "get_moe_layer_pattern", "get_linear_attention_pattern"]

_LINEAR_ATTENTION_VARIANTS = ("gated_delta_net",)


def _backend(backend: Optional[BackendSpecProvider]) -> BackendSpecProvider:
    return backend if backend is not None else LocalSpecProvider()


def _fused_or_plain_column(backend: BackendSpecProvider):
    fused = backend.column_parallel_layer_norm_linear() if backend.fuse_layernorm_and_linear() else None
    return fused if fused is not None else backend.column_parallel_linear()


def get_gated_delta_net_module_spec(config, backend: BackendSpecProvider = None) -> ModuleSpec:
    """The GDN layer's spec (``metainfo["fuse_input_layernorm"]``: whether ``in_proj`` carries the layer's input
    norm)."""
    backend = _backend(backend)
    return ModuleSpec(module=GatedDeltaNet,
                      submodules=GatedDeltaNetSubmodules(
                          in_proj=_fused_or_plain_column(backend),
                          out_norm=backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False),
                          out_proj=backend.row_parallel_linear()),
                      metainfo={"fuse_input_layernorm": backend.fuse_layernorm_and_linear()})


def get_dsa_module_spec_for_backend(config, backend: BackendSpecProvider = None) -> ModuleSpec:
    """Multi-latent attention (:func:`get_mla_self_attention_spec`) whose core attention is :class:`DSAttention`
    (the indexer's linears duplicated, its key norm a LayerNorm)."""
    if not config.multi_latent_attention:
        raise ValueError("DeepSeek sparse attention needs multi-latent attention (--multi-latent-attention)")
    if config.qk_l2_norm:
        raise ValueError("DeepSeek sparse attention does not support qk_l2_norm")
    backend = _backend(backend)
    from megatron.core.tensor_parallel import DuplicatedLinear

    indexer = ModuleSpec(module=DSAIndexer, submodules=DSAIndexerSubmodules(
        linear_wq_b=DuplicatedLinear, linear_wk=DuplicatedLinear,
        k_norm=backend.layer_norm(rms_norm=False, for_qk=True), linear_weights_proj=DuplicatedLinear))
    mla = get_mla_self_attention_spec(config.qk_layernorm)
    core = ModuleSpec(module=DSAttention, submodules=DSAttentionSubmodules(indexer=indexer))
    return ModuleSpec(module=mla.module, params=dict(mla.params),
                      submodules=dataclasses.replace(mla.submodules, core_attention=core),
                      metainfo={"fuse_input_layernorm": False})


def get_experimental_attention_variant_module_spec(config, backend: BackendSpecProvider = None) -> ModuleSpec:
    """The attention spec of ``config.experimental_attention_variant`` (``gated_delta_net`` or ``dsa``)."""
    variant = config.experimental_attention_variant
    if variant == "gated_delta_net":
        return get_gated_delta_net_module_spec(config, backend)
    if variant == "dsa":
        return get_dsa_module_spec_for_backend(config, backend)
    raise ValueError(f"Invalid experimental attention variant: {variant}")


def is_linear_attention_variant(experimental_attention_variant: Optional[str]) -> bool:
    """Whether the variant is a linear attention (mixed with standard attention by ``linear_attention_freq``)."""
    return experimental_attention_variant in _LINEAR_ATTENTION_VARIANTS


def get_moe_layer_pattern(config) -> List[int]:
    """1 (MoE) / 0 (dense) per layer from ``config.moe_layer_freq`` (module docstring)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    if isinstance(freq, (list, tuple)):
        if len(freq) != config.num_layers:
            raise ValueError(f"moe_layer_freq lists {len(freq)} layers; the model has {config.num_layers}")
        return list(freq)
    raise ValueError(f"Invalid moe_layer_freq: {type(freq)}, {freq}")


def get_linear_attention_pattern(config) -> List[int]:
    """1 (linear attention) / 0 (standard attention) per layer from ``config.linear_attention_freq``."""
    freq = config.linear_attention_freq
    if isinstance(freq, int):
        return [0 if (i + 1) % freq == 0 else 1 for i in range(config.num_layers)]
    if isinstance(freq, (list, tuple)):
        if len(freq) != config.num_layers:
            raise ValueError(f"linear_attention_freq lists {len(freq)} layers; the model has {config.num_layers}")
        return list(freq)
    if freq is None:
        if is_linear_attention_variant(config.experimental_attention_variant):
            raise ValueError(f"Linear attention type {config.experimental_attention_variant} is specified but "
                             "linear_attention_freq is None: set it to give the linear / standard attention pattern")
        return [0] * config.num_layers
    raise ValueError(f"Invalid linear_attention_freq: {type(freq)}, {freq}")


def _standard_attention_spec(config) -> ModuleSpec:
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm,
                                    multi_latent_attention=config.multi_latent_attention).submodules.self_attention
    return ModuleSpec(module=spec.module, params=dict(spec.params), submodules=spec.submodules,
                      metainfo={"fuse_input_layernorm": False})


def _layer_spec(config, backend, attention: ModuleSpec, mlp: ModuleSpec, moe: bool) -> ModuleSpec:
    norm = backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False)
    keys = {}
    if not attention.metainfo.get("fuse_input_layernorm") and attention.module is GatedDeltaNet:
        keys["input_layernorm."] = "self_attention.in_proj.layer_norm_"
    elif not attention.metainfo.get("fuse_input_layernorm") and attention.module is not MLASelfAttention:
        keys["input_layernorm."] = "self_attention.linear_qkv.layer_norm_"
    if attention.module is MLASelfAttention and config.qk_layernorm:
        keys.update({"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                     "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"})
    if not moe:
        keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=IdentityOp if attention.metainfo.get("fuse_input_layernorm") else norm,
        self_attention=attention, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=norm, mlp=mlp, mlp_bda=get_bias_dropout_add, sharded_state_dict_keys_map=keys))


def get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage: Optional[int] = None,
                                                                   pp_rank: Optional[int] = None
                                                                   ) -> TransformerBlockSubmodules:
    """The block of this pipeline stage: per layer the experimental or the standard attention and an MoE or a
    dense MLP (module docstring), then the final norm."""
    backend = LocalSpecProvider()
    variant = config.experimental_attention_variant
    if is_linear_attention_variant(variant):
        attention_pattern = get_linear_attention_pattern(config)
    else:
        attention_pattern = [1 if variant is not None else 0] * config.num_layers
    experimental = get_experimental_attention_variant_module_spec(config, backend) if 1 in attention_pattern else None
    standard = _standard_attention_spec(config) if 0 in attention_pattern else None
    moe_pattern = get_moe_layer_pattern(config) if config.num_moe_experts is not None else [0] * config.num_layers
    moe_mlp = (get_moe_module_spec_for_backend(backend, config.num_moe_experts, config.moe_grouped_gemm)
               if 1 in moe_pattern else None)
    dense_mlp = get_mlp_module_spec_for_backend(backend) if 0 in moe_pattern else None
    layers = [_layer_spec(config, backend, experimental if attention_pattern[i] else standard,
                          moe_mlp if moe_pattern[i] else dense_mlp, bool(moe_pattern[i]))
              for i in range(config.num_layers)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=layers[offset:offset + count],
                                      layer_norm=backend.layer_norm(rms_norm=config.normalization == "RMSNorm"))

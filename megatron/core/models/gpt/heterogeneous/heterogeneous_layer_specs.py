"""Layer specs of a heterogeneous GPT (Nemotron-NAS / Llama-Nemotron, :class:`HeterogeneousTransformerConfig`):
one :class:`TransformerLayer` spec per block of ``config.per_block_parameters``, local (non-Transformer-Engine)
modules.

Per block: the attention is ``IdentityOp`` when ``no_op`` (and then so are its input norm and bias-dropout-add),
:class:`ColumnParallelLinearGathered` when ``replace_with_linear``, else a causal :class:`SelfAttention`
(``ColumnParallelLinear`` qkv, :class:`DotProductAttention`, ``RowParallelLinear`` projection, q/k norms with
``config.qk_layernorm``); the MLP likewise (``no_op`` / ``replace_with_linear`` / an :class:`MLP`). The block's own
``num_query_groups`` and ``ffn_hidden_size`` reach its layer through ``config.get_config_for_layer`` (the
transformer block builds each layer with it). Norms follow ``config.normalization`` (LayerNorm / RMSNorm).

Checkpoint names are megatron-core's for this spec: a block with a grouped-query attention stores its input norm
as ``self_attention.linear_qkv.layer_norm_*``, one with a linear attention as ``self_attention.layer_norm_*``;
the pre-MLP norm likewise as ``mlp.linear_fc1.layer_norm_*`` / ``mlp.layer_norm_*`` (the names of Transformer
Engine's fused norm + linear modules); blocks that set neither keep ``input_layernorm.`` / ``pre_mlp_layernorm.``.
"""
from __future__ import annotations

from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.heterogeneous.heterogeneous_config import (AttentionConfig,
                                                                          HeterogeneousTransformerConfig, MLPConfig,
                                                                          TransformerBlockConfig)
from megatron.core.transformer.heterogeneous.linear_replacements import ColumnParallelLinearGathered
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.norms import FusedLayerNorm
from megatron.core.transformer.spec_utils import IdentityFuncOp, IdentityOp, ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (TransformerLayer, TransformerLayerSubmodules,
                                                         get_transformer_layer_offset)


def _layer_norm(part: AttentionConfig | MLPConfig):
    """The norm before an attention / MLP (the config's normalization); none before a no-op."""
    return IdentityOp if part.no_op else FusedLayerNorm


def _attention_spec(attention: AttentionConfig, qk_layernorm: bool):
    if attention.no_op:
        return ModuleSpec(module=IdentityOp)
    if attention.replace_with_linear:
        return ModuleSpec(module=ColumnParallelLinearGathered, params={"tp_comm_buffer_name": "linear_attn"})
    qk_norm = FusedLayerNorm if qk_layernorm else IdentityOp
    return ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                         core_attention=DotProductAttention,
                                                         linear_proj=RowParallelLinear, q_layernorm=qk_norm,
                                                         k_layernorm=qk_norm))


def _mlp_spec(mlp: MLPConfig):
    if mlp.no_op:
        return ModuleSpec(module=IdentityOp)
    if mlp.replace_with_linear:
        return ModuleSpec(module=ColumnParallelLinearGathered, params={"tp_comm_buffer_name": "linear_mlp"})
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                           linear_fc2=RowParallelLinear))


def _sharded_state_dict_keys_map(block: TransformerBlockConfig) -> dict:
    """The checkpoint renames of the block's norms (module docstring)."""
    mapping = {}
    if block.attention.num_query_groups is not None:
        mapping["input_layernorm."] = "self_attention.linear_qkv.layer_norm_"
    if block.attention.replace_with_linear:
        mapping["input_layernorm."] = "self_attention.layer_norm_"
    if block.mlp.ffn_hidden_size is not None:
        mapping["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    if block.mlp.replace_with_linear:
        mapping["pre_mlp_layernorm."] = "mlp.layer_norm_"
    return mapping


def get_gpt_heterogeneous_layer_spec(config: HeterogeneousTransformerConfig, use_te: bool = False,
                                     vp_stage: Optional[int] = None,
                                     pp_rank: Optional[int] = None) -> TransformerBlockSubmodules:
    """The block spec of this pipeline stage (``pp_rank``, default parallel_state's) and virtual chunk
    (``vp_stage``): the layer specs of its global layers ``[offset, offset + layers to build)`` and the final
    norm. ``use_te=True`` (Transformer Engine modules) is not available here."""
    if use_te:
        from megatron.core.transformer.te_support import transformer_engine_layers_unavailable

        transformer_engine_layers_unavailable()
    layer_specs = [
        ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=_layer_norm(block.attention),
            self_attention=_attention_spec(block.attention, config.qk_layernorm),
            self_attn_bda=IdentityFuncOp if block.attention.no_op else get_bias_dropout_add,
            pre_mlp_layernorm=_layer_norm(block.mlp),
            mlp=_mlp_spec(block.mlp),
            mlp_bda=IdentityFuncOp if block.mlp.no_op else get_bias_dropout_add,
            sharded_state_dict_keys_map=_sharded_state_dict_keys_map(block)))
        for block in config.per_block_parameters]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=layer_specs[offset:offset + count], layer_norm=FusedLayerNorm)

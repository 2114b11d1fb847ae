"""Layer and block specs of megatron-core's T5Model (``megatron.core.models.T5.t5_spec``).

Encoder layer: pre-LN bidirectional self-attention (mask type ``arbitrary``: the padding mask is given) + MLP.
Decoder layer: pre-LN causal self-attention, then pre-LN cross-attention (queries from the decoder stream,
keys/values from the encoder output, ``linear_q`` ``h -> heads*kv``, ``linear_kv`` ``h -> 2*heads*kv`` holding
``[k_h | v_h]`` per head), then pre-LN MLP. Each residual branch is bias-dropout-add.

The block helpers give each stack a final LayerNorm (``final_layernorm``), as Megatron's legacy T5 and
megatron-core's Transformer-Engine specs do (megatron-core's local helpers name ``TENorm`` and lose the final
norm when Transformer Engine is absent; we build the norm every time).
"""
from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import (
    CrossAttention,
    CrossAttentionSubmodules,
    SelfAttention,
    SelfAttentionSubmodules,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.norms import FusedLayerNorm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import (LOCAL_NORM_KEYS_MAP, TransformerLayer,
                                                         TransformerLayerSubmodules)


def _self_attention(mask_type) -> ModuleSpec:
    return ModuleSpec(module=SelfAttention, params={"attn_mask_type": mask_type},
                      submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                         core_attention=DotProductAttention,
                                                         linear_proj=RowParallelLinear))


def _mlp() -> ModuleSpec:
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                           linear_fc2=RowParallelLinear))


def encoder_model_with_local_spec() -> ModuleSpec:
    """The T5 encoder layer from megatron.core's own modules."""
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=FusedLayerNorm,
        self_attention=_self_attention(AttnMaskType.arbitrary),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=FusedLayerNorm,
        mlp=_mlp(),
        mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=dict(LOCAL_NORM_KEYS_MAP)))


def decoder_model_with_local_spec() -> ModuleSpec:
    """The T5 decoder layer (self-attention, cross-attention, MLP) from megatron.core's own modules."""
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=FusedLayerNorm,
        self_attention=_self_attention(AttnMaskType.causal),
        self_attn_bda=get_bias_dropout_add,
        pre_cross_attn_layernorm=FusedLayerNorm,
        cross_attention=ModuleSpec(module=CrossAttention, params={"attn_mask_type": AttnMaskType.arbitrary},
                                   submodules=CrossAttentionSubmodules(linear_q=ColumnParallelLinear,
                                                                       linear_kv=ColumnParallelLinear,
                                                                       core_attention=DotProductAttention,
                                                                       linear_proj=RowParallelLinear)),
        cross_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=FusedLayerNorm,
        mlp=_mlp(),
        mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=dict(LOCAL_NORM_KEYS_MAP)))


def get_t5_encoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    layer_spec = encoder_model_with_local_spec()
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=FusedLayerNorm)


def get_t5_decoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    layer_spec = decoder_model_with_local_spec()
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=FusedLayerNorm)


def _transformer_engine_unavailable(*unused, **unused_kw):
    from megatron.core.transformer.te_support import transformer_engine_layers_unavailable

    transformer_engine_layers_unavailable()


encoder_model_with_transformer_engine_default_spec = _transformer_engine_unavailable
decoder_model_with_transformer_engine_default_spec = _transformer_engine_unavailable
get_t5_encoder_with_transformer_engine_block_spec = _transformer_engine_unavailable
get_t5_decoder_with_transformer_engine_block_spec = _transformer_engine_unavailable

"""``mamba_stack_spec``: the layers of a hybrid model built from this library's own modules (megatron-core's spec is
Transformer Engine's; the modules and their state-dict names are the same, the norms are separate modules).

``M`` MambaLayer(norm, MambaMixer(in_proj column parallel, out_proj row parallel)); ``*`` TransformerLayer with
causal self-attention only; ``-`` TransformerLayer with a dense MLP only; ``E`` MoETransformerLayer with an MoE MLP
only; ``final_norm`` the config's normalization.
"""
from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.norms import FusedLayerNorm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import LOCAL_NORM_KEYS_MAP, MoETransformerLayer, TransformerLayer, \
    TransformerLayerSubmodules, default_layer_submodules


def _attention_only() -> TransformerLayerSubmodules:
    full = default_layer_submodules(AttnMaskType.causal)
    return TransformerLayerSubmodules(input_layernorm=full.input_layernorm, self_attention=full.self_attention,
                                      self_attn_bda=full.self_attn_bda,
                                      sharded_state_dict_keys_map=_norm_keys("input_layernorm."))


def _mlp_only(mlp, fused_norm: bool = True) -> TransformerLayerSubmodules:
    """An MLP-only layer; a dense MLP's pre-norm is stored fused into ``linear_fc1`` (Transformer Engine's name), an
    MoE layer's stays ``pre_mlp_layernorm`` (a separate module in megatron-core's spec too)."""
    return TransformerLayerSubmodules(pre_mlp_layernorm=FusedLayerNorm, mlp=mlp, mlp_bda=get_bias_dropout_add,
                                      sharded_state_dict_keys_map=_norm_keys("pre_mlp_layernorm.") if fused_norm
                                      else {})


def _norm_keys(norm: str) -> dict:
    """The entry of the local layer's norm-to-fused-name map (LOCAL_NORM_KEYS_MAP) for ``norm``."""
    return {norm: LOCAL_NORM_KEYS_MAP[norm]}


def get_mamba_stack_spec(moe_grouped_gemm: bool = False) -> ModuleSpec:
    """The local hybrid stack spec (``moe_grouped_gemm``: GroupedMLP experts for ``E`` layers)."""
    dense_mlp = default_layer_submodules(AttnMaskType.causal).mlp
    return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=FusedLayerNorm,
            mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear,
                                                                                out_proj=RowParallelLinear)),
            mamba_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"})),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=_attention_only()),
        mlp_layer=ModuleSpec(module=TransformerLayer, submodules=_mlp_only(dense_mlp)),
        moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=_mlp_only(get_moe_module_spec(
            use_te=False, moe_grouped_gemm=moe_grouped_gemm), fused_norm=False)),
        final_norm=FusedLayerNorm))


mamba_stack_spec = get_mamba_stack_spec()

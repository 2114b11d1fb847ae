"""Layer specs for megatron-core's GPTModel (``get_gpt_layer_local_spec()``, ``get_gpt_decoder_block_spec()``)."""
from __future__ import annotations

from typing import List, Optional

from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec, get_moe_module_spec_for_backend
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.multi_token_prediction import get_gpt_mtp_block_spec  # noqa: F401  (megatron-core)
from megatron.core.transformer.multi_token_prediction import (MultiTokenPredictionBlockSubmodules,
                                                              get_mtp_layer_spec_for_backend,
                                                              get_mtp_num_layers_to_build)
from megatron.core.transformer.norms import FusedLayerNorm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import (LOCAL_NORM_KEYS_MAP, MLA_NORM_KEYS_MAP, TransformerLayer,
                                                          default_layer_submodules)


def get_mla_self_attention_spec(qk_layernorm=False) -> ModuleSpec:
    """Multi-latent attention (causal) with megatron.core's own layers: duplicated down projections,
    column-parallel up projections, the latent norms with ``qk_layernorm``."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, DuplicatedLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import IdentityOp

    norm = FusedLayerNorm if qk_layernorm else IdentityOp
    return ModuleSpec(module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=MLASelfAttentionSubmodules(
                          linear_q_proj=ColumnParallelLinear, linear_q_down_proj=DuplicatedLinear,
                          linear_q_up_proj=ColumnParallelLinear, linear_kv_down_proj=DuplicatedLinear,
                          linear_kv_up_proj=ColumnParallelLinear, core_attention=DotProductAttention,
                          linear_proj=RowParallelLinear, q_layernorm=norm, kv_layernorm=norm))


def get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                             multi_latent_attention=False, fp8=None, moe_use_legacy_grouped_gemm=False,
                             normalization=None, qk_l2_norm=False) -> ModuleSpec:
    """Causal self-attention (multi-latent with ``multi_latent_attention``) + MLP (or, with ``num_experts``, an MoE
    MLP) built from megatron.core's own layers. The norms follow ``config.normalization`` (``normalization`` is
    accepted for megatron-core's signature, as the deprecated ``fp8``)."""
    if qk_l2_norm:
        raise ValueError("qk_l2_norm (--qk-l2-norm) is not implemented by this library's layer spec")
    # qk_layernorm is read from config.qk_layernorm by the attention (the same local norms either way).
    submodules = default_layer_submodules(AttnMaskType.causal)
    if multi_latent_attention:
        submodules.self_attention = get_mla_self_attention_spec(qk_layernorm)
        # Checkpoint keys as megatron-core's Transformer Engine MLA spec writes them (MLA_NORM_KEYS_MAP).
        submodules.sharded_state_dict_keys_map = dict(MLA_NORM_KEYS_MAP)
        if num_experts is None:
            submodules.sharded_state_dict_keys_map["pre_mlp_layernorm."] = LOCAL_NORM_KEYS_MAP["pre_mlp_layernorm."]
    if num_experts is not None:
        submodules.mlp = get_moe_module_spec(False, num_experts, moe_grouped_gemm)
    return ModuleSpec(module=TransformerLayer, submodules=submodules)


def get_mlp_module_spec(use_te: Optional[bool] = True, num_experts: Optional[int] = None,
                        moe_grouped_gemm: Optional[bool] = False, fp8: Optional[str] = None,
                        moe_use_legacy_grouped_gemm: Optional[bool] = False,
                        use_te_op_fuser: Optional[bool] = False) -> ModuleSpec:
    """The MLP of a GPT layer with this library's layers (:func:`get_mlp_module_spec_for_backend`). ``use_te``
    (megatron-core's default) / ``use_te_op_fuser`` ask for Transformer Engine layers, which this library does not
    build: a clear error says so. ``fp8`` is deprecated in megatron-core and ignored."""
    if use_te or use_te_op_fuser:
        from megatron.core.transformer.te_support import transformer_engine_layers_unavailable

        transformer_engine_layers_unavailable()
    return get_mlp_module_spec_for_backend(LocalSpecProvider(), num_experts, moe_grouped_gemm,
                                           moe_use_legacy_grouped_gemm)


def get_mlp_module_spec_for_backend(backend: BackendSpecProvider, num_experts: Optional[int] = None,
                                    moe_grouped_gemm: Optional[bool] = False,
                                    moe_use_legacy_grouped_gemm: Optional[bool] = False,
                                    use_te_op_fuser: Optional[bool] = False,
                                    use_te_activation_func: bool = False) -> ModuleSpec:
    """The dense MLP (the backend's column-parallel fc1, or its fused norm + linear, and row-parallel fc2), or with
    ``num_experts`` the MoE MLP (:func:`get_moe_module_spec_for_backend`). ``use_te_op_fuser`` (Transformer Engine's
    fused MLP) and an activation module are not built by this library: refused."""
    if use_te_op_fuser:
        raise ValueError("use_te_op_fuser: Transformer Engine's fused MLP is not built by this library")
    if num_experts is not None:
        return get_moe_module_spec_for_backend(backend, num_experts, moe_grouped_gemm, moe_use_legacy_grouped_gemm,
                                               use_te_activation_func)
    if use_te_activation_func and backend.activation_func() is not None:
        raise ValueError("use_te_activation_func: this library's MLPs apply config.activation_func themselves")
    fc1 = (backend.column_parallel_layer_norm_linear() if backend.fuse_layernorm_and_linear()
           else backend.column_parallel_linear())
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=backend.row_parallel_linear()))


def get_gpt_mtp_block_spec_for_backend(config, spec, backend: BackendSpecProvider, vp_stage=None, pp_rank=None):
    """The MTP block of this pipeline stage from ``backend``'s classes: ``mtp_num_layers`` depths around the
    decoder's last layer spec (``spec``: a layer ``ModuleSpec`` or a ``TransformerBlockSubmodules``); None where no
    depth is built (no MTP, or not the last stage)."""
    if get_mtp_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank) == 0:
        return None
    last = spec.layer_specs[-1] if isinstance(spec, TransformerBlockSubmodules) else spec
    if not isinstance(last, ModuleSpec):
        raise ValueError(f"get_gpt_mtp_block_spec_for_backend: expected a layer ModuleSpec, got {type(spec).__name__}")
    return MultiTokenPredictionBlockSubmodules(
        layer_specs=[get_mtp_layer_spec_for_backend(last, backend)] * config.mtp_num_layers)


def get_gpt_decoder_layer_specs(config, use_transformer_engine: bool = False, normalization=None,
                                qk_l2_norm=False, vp_stage=None, pp_rank=None) -> List[ModuleSpec]:
    """One layer spec per global layer of the model: MoE where ``config.moe_layer_freq`` says so, dense
    elsewhere."""
    if use_transformer_engine:
        from megatron.core.transformer.te_support import transformer_engine_layers_unavailable

        transformer_engine_layers_unavailable()
    mla = config.multi_latent_attention
    dense = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, multi_latent_attention=mla)
    moe = get_gpt_layer_local_spec(config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm,
                                   multi_latent_attention=mla)
    return [moe if config.is_moe_layer(i + 1) else dense for i in range(config.num_layers)]


def get_gpt_decoder_block_spec(config, use_transformer_engine: bool = False, normalization=None,
                               qk_l2_norm=False, vp_stage=None) -> TransformerBlockSubmodules:
    """The block's spec: :func:`get_gpt_decoder_layer_specs` for every global layer (TransformerBlock builds the
    ones of its pipeline stage) and the final norm."""
    specs = get_gpt_decoder_layer_specs(config, use_transformer_engine, normalization, qk_l2_norm)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=FusedLayerNorm)  # the final norm


def get_gpt_layer_with_transformer_engine_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False):
    """Transformer Engine layers: raises a clear error when TE is missing (and TE layers are not built yet)."""
    from megatron.core.transformer.te_support import transformer_engine_layers_unavailable

    transformer_engine_layers_unavailable()

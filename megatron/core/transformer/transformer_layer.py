"""One transformer layer: norm -> attention -> bias-dropout-add -> norm -> MLP -> bias-dropout-add.

``ParallelTransformerLayer`` (Megatron's legacy API) and megatron-core's ``TransformerLayer`` (spec-built) are
one class with megatron-core's submodule names (``input_layernorm``, ``self_attention``,
``pre_cross_attn_layernorm``, ``cross_attention``, ``pre_mlp_layernorm``, ``mlp``); the legacy class saves and
loads Megatron's legacy names through the one table of :mod:`megatron.core.transformer.legacy_names`.
"""
from __future__ import annotations

from abc import ABC
from dataclasses import dataclass, field
from typing import Dict, Union

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.legacy_names import install_legacy_state_dict_names
from megatron.core.transformer.attention import ParallelAttention, SelfAttention
from megatron.core.transformer.enums import AttnMaskType, AttnType, LayerType
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add, get_bias_dropout_add_func
from megatron.core.transformer.mlp import MLP, ParallelMLP
from megatron.core.transformer.module import GraphableMegatronModule, MegatronModule
from megatron.core.transformer.norms import FusedLayerNorm, get_norm
from megatron.core.transformer.spec_utils import IdentityFuncOp, IdentityOp, ModuleSpec, build_module
from megatron.core.transformer.utils import apply_sharded_keys_map
from megatron.core.utils import make_viewless_tensor

@dataclass
class TransformerLayerSubmodules:
    input_layernorm: Union[ModuleSpec, type] = IdentityOp
    self_attention: Union[ModuleSpec, type] = IdentityOp
    self_attn_bda: Union[ModuleSpec, type] = IdentityFuncOp
    pre_cross_attn_layernorm: Union[ModuleSpec, type] = IdentityOp
    cross_attention: Union[ModuleSpec, type] = IdentityOp
    cross_attn_bda: Union[ModuleSpec, type] = IdentityFuncOp
    pre_mlp_layernorm: Union[ModuleSpec, type] = IdentityOp
    mlp: Union[ModuleSpec, type] = IdentityOp
    mlp_bda: Union[ModuleSpec, type] = IdentityFuncOp
    # Renames of checkpoint-key prefixes (megatron-core's local specs store the norms under the names of
    # Transformer Engine's fused norm + linear modules).
    sharded_state_dict_keys_map: Dict[str, str] = field(default_factory=dict)


# The local layer's norms on disk: Transformer Engine fuses them into the next linear layer (megatron-core's
# local GPT / BERT / T5 specs map them the same way).
LOCAL_NORM_KEYS_MAP = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                       "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
# Multi-latent attention layers (Transformer Engine's spec): the input norm stays a module of its own, the latent
# norms are fused into the up projections, and the pre-MLP norm into a dense MLP's fc1 (an MoE layer keeps it).
MLA_NORM_KEYS_MAP = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                     "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}


def get_transformer_layer_offset(config, vp_stage=None, pp_rank=None) -> int:
    """Global index of the first layer of pipeline stage ``pp_rank`` (default: parallel_state's) and virtual
    chunk ``vp_stage`` (default: parallel_state's current one) for ``config``'s even split (megatron-core's
    function): ``pp_rank * L / pp`` without virtual stages, ``vp_stage * L / vpp + pp_rank * L / (pp * vpp)``
    with them; 0 without pipeline parallelism."""
    from megatron.core import parallel_state

    pp = config.pipeline_model_parallel_size
    if pp <= 1:
        return 0
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    vpp = config.virtual_pipeline_model_parallel_size
    if vpp is None:
        return pp_rank * (config.num_layers // pp)
    if vp_stage is None:
        vp_stage = parallel_state.get_virtual_pipeline_model_parallel_rank() or 0
    return vp_stage * (config.num_layers // vpp) + pp_rank * (config.num_layers // (pp * vpp))


class DropPath(torch.nn.Module):
    """Stochastic depth: drop the whole residual branch of a sample with probability ``drop_prob``."""

    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, hidden_state):
        if self.drop_prob == 0.0 or not self.training:
            return hidden_state
        keep_prob = 1 - self.drop_prob
        # activations are [s, b, h]: one draw per sample (dim 1)
        shape = (1,) + (hidden_state.shape[1],) + (1,) * (hidden_state.ndim - 2)
        random_tensor = keep_prob + torch.rand(shape, dtype=hidden_state.dtype, device=hidden_state.device)
        random_tensor.floor_()
        return hidden_state.div(keep_prob) * random_tensor


class BaseTransformerLayer(ABC):
    """The common parent of transformer-layer classes (megatron-core's marker): a spec whose module derives from it
    is a per-layer spec, repeated for every layer of a block."""

    def __init__(self):
        pass


class ParallelTransformerLayer(GraphableMegatronModule, BaseTransformerLayer):
    """``ParallelTransformerLayer(config, layer_number, layer_type, self_attn_mask_type, drop_path_rate)``; a
    :class:`GraphableMegatronModule` (megatron-core's base of TransformerLayer; no CUDA graphs here).

    ``forward(hidden_states [s, b, h], attention_mask, encoder_output=None, enc_dec_attn_mask=None,
    ..., inference_params=None, rotary_pos_emb=None) -> [s, b, h]``.
    """

    def __init__(self, config, layer_number, layer_type=LayerType.encoder, self_attn_mask_type=AttnMaskType.padding,
                 drop_path_rate=0.0, *, naming: str = "legacy", submodules: TransformerLayerSubmodules = None,
                 hidden_dropout=None, pg_collection=None):
        super().__init__(config=config)
        # megatron-core's pg_collection: handed to the spec-built attention and MLP (None: parallel_state's groups).
        self.pg_collection = pg_collection
        if layer_type not in (LayerType.encoder, LayerType.decoder):
            raise NotImplementedError(f"layer type {layer_type} (retro) is not implemented")
        self.layer_number = layer_number
        self.layer_type = layer_type
        self.apply_residual_connection_post_layernorm = config.apply_residual_connection_post_layernorm
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        self.bias_dropout_fusion = config.bias_dropout_fusion
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0.0 else None
        h = config.hidden_size

        # megatron-core specs choose the bias-dropout-add of each residual branch (self_attn_bda, cross_attn_bda,
        # mlp_bda): factories ``bda(training, fused) -> f((x, bias), residual, prob)``. The legacy layer has none.
        self._spec_bda = None
        if submodules is None:  # Megatron's legacy layer: fixed classes
            has_cross = layer_type == LayerType.decoder
            self.input_layernorm = get_norm(config)
            self.self_attention = ParallelAttention(config, layer_number, attention_type=AttnType.self_attn,
                                                    attn_mask_type=self_attn_mask_type, naming=naming)
            if has_cross:
                self.pre_cross_attn_layernorm = get_norm(config)
                self.cross_attention = ParallelAttention(config, layer_number, attention_type=AttnType.cross_attn,
                                                         naming=naming)
            self.pre_mlp_layernorm = get_norm(config)
            self.mlp = ParallelMLP(config, naming=naming)
            if naming == "legacy":  # Megatron's legacy checkpoint names, at the state-dict boundary only
                install_legacy_state_dict_names(self, "decoder_layer" if has_cross else "encoder_layer")
        else:  # megatron-core: classes from the spec
            eps = config.layernorm_epsilon
            has_cross = submodules.cross_attention not in (None, IdentityOp)
            self.input_layernorm = build_module(submodules.input_layernorm, config=config, hidden_size=h, eps=eps)
            groups = {} if pg_collection is None else {"pg_collection": pg_collection}
            self.self_attention = build_module(submodules.self_attention, config=config, layer_number=layer_number,
                                               **groups)
            if has_cross:
                self.pre_cross_attn_layernorm = build_module(submodules.pre_cross_attn_layernorm, config=config,
                                                             hidden_size=h, eps=eps)
                self.cross_attention = build_module(submodules.cross_attention, config=config,
                                                    layer_number=layer_number, **groups)
            self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, config=config, hidden_size=h, eps=eps)
            self.mlp = build_module(submodules.mlp, config=config, **_mlp_kwargs(submodules.mlp, layer_number,
                                                                                 pg_collection))
            self._spec_bda = {"self_attention": build_module(submodules.self_attn_bda),
                              "cross_attention": build_module(submodules.cross_attn_bda),
                              "mlp": build_module(submodules.mlp_bda)}
        self.has_cross_attention = has_cross
        self.sharded_state_dict_keys_map = dict(LOCAL_NORM_KEYS_MAP if submodules is None
                                                else submodules.sharded_state_dict_keys_map)
        from megatron.core.transformer.moe.moe_layer import BaseMoELayer

        self.recompute_mlp = config.recomputes("moe" if isinstance(self.mlp, BaseMoELayer) else "mlp")
        self.recompute_layernorm = config.recomputes("layernorm")

    def _norm(self, norm, x):
        """A norm of the layer; under selective recompute with ``layernorm`` listed only its input is kept and the
        norm runs again in backward (its fp32 statistics are not stored)."""
        if not (self.recompute_layernorm and self.training and torch.is_grad_enabled()) or isinstance(norm, IdentityOp):
            return norm(x)
        return tensor_parallel.checkpoint(norm, False, x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None):
        """The default (every submodule's) with the spec's ``sharded_state_dict_keys_map`` applied to the keys."""
        return apply_sharded_keys_map(super().sharded_state_dict(prefix, sharded_offsets, metadata), prefix,
                                      self.sharded_state_dict_keys_map)

    def _mlp_forward(self, layernorm_output):
        """The MLP (dense or MoE); under selective recompute with ``mlp`` / ``moe`` listed, only its input is kept
        and the forward runs again in backward (the MoE dispatch and combine collectives too, on every rank)."""
        if not (self.recompute_mlp and self.training and torch.is_grad_enabled()):
            return self.mlp(layernorm_output)

        def run(x):
            out, bias = self.mlp(x)
            # A bias returned as-is would be the parameter itself: return a copy, which recompute differentiates.
            return out if bias is None else (out, bias.clone())

        result = tensor_parallel.checkpoint(run, False, layernorm_output)
        return (result, None) if torch.is_tensor(result) else result

    def _bias_dropout_add(self, x, bias, residual, branch: str):
        if self._spec_bda is not None and self.drop_path is None:
            bda = self._spec_bda[branch](self.training, self.bias_dropout_fusion)
            return bda((x, bias), residual, self.hidden_dropout)
        if self.drop_path is None:
            bda = get_bias_dropout_add_func(self.training, self.bias_dropout_fusion, on_cuda=x.is_cuda)
            return bda(x, bias, residual, self.hidden_dropout)
        out = x + bias if bias is not None else x
        out = torch.nn.functional.dropout(out, p=self.hidden_dropout, training=self.training)
        return residual + self.drop_path(out)

    def forward(self, hidden_states, attention_mask, encoder_output=None, enc_dec_attn_mask=None,
                retriever_input=None, retriever_output=None, retriever_attn_mask=None, inference_params=None,
                rotary_pos_emb=None):
        if retriever_input is not None or retriever_output is not None:
            raise NotImplementedError("retro layers are not implemented")
        hidden_states, _ = self._forward_attention(hidden_states, attention_mask, context=encoder_output,
                                                   context_mask=enc_dec_attn_mask, rotary_pos_emb=rotary_pos_emb,
                                                   inference_params=inference_params)
        return self._forward_mlp(hidden_states)

    def _forward_attention(self, hidden_states, attention_mask=None, context=None, context_mask=None,
                           rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None,
                           inference_context=None, packed_seq_params=None, sequence_len_offset=None, *,
                           inference_params=None):
        """The attention half of the layer (megatron-core's split): ``x + attn(norm(x))`` (then the cross
        attention of a decoder layer); returns ``(hidden_states, context)``. The other arguments of megatron-core's
        signature (precomputed cos / sin, attention bias, a sequence offset) are refused; packed sequences
        (``packed_seq_params``) go to the self attention."""
        for name, value in (("rotary_pos_cos", rotary_pos_cos), ("rotary_pos_sin", rotary_pos_sin),
                            ("attention_bias", attention_bias), ("sequence_len_offset", sequence_len_offset)):
            if value is not None:
                raise NotImplementedError(f"transformer layer: {name} is not supported")
        inference_params = inference_params if inference_params is not None else inference_context
        # Self attention (absent, IdentityOp, in the MLP-only layers of hybrid models).
        if isinstance(self.self_attention, IdentityOp):
            layernorm_input = hidden_states
        else:
            layernorm_output = self._norm(self.input_layernorm, hidden_states)
            # The mask by keyword, as megatron-core passes it (a linear replacement takes other positionals).
            packed = {} if packed_seq_params is None else {"packed_seq_params": packed_seq_params}
            attention_output, attention_bias = self.self_attention(
                layernorm_output, attention_mask=attention_mask, inference_params=inference_params,
                rotary_pos_emb=rotary_pos_emb, **packed)
            residual = layernorm_output if self.apply_residual_connection_post_layernorm else hidden_states
            layernorm_input = self._bias_dropout_add(attention_output, attention_bias, residual, "self_attention")
        if self.has_cross_attention:
            if packed_seq_params is not None:
                raise NotImplementedError("transformer layer: packed sequences (packed_seq_params) with cross "
                                          "attention are not supported")
            layernorm_output = self._norm(self.pre_cross_attn_layernorm, layernorm_input)
            attention_output, attention_bias = self.cross_attention(layernorm_output, context_mask, context)
            residual = layernorm_output if self.apply_residual_connection_post_layernorm else layernorm_input
            layernorm_input = self._bias_dropout_add(attention_output, attention_bias, residual, "cross_attention")
        return layernorm_input, context

    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None):
        """The MLP half: ``x + mlp(pre_mlp_norm(x))`` (the residual is the norm's output with
        ``apply_residual_connection_post_layernorm``), as a tensor that is not a view."""
        if padding_mask is not None:
            raise NotImplementedError("transformer layer: padding_mask is not supported")
        if isinstance(self.mlp, IdentityOp):  # the attention-only layers of hybrid models
            return make_viewless_tensor(inp=hidden_states, requires_grad=hidden_states.requires_grad,
                                        keep_graph=True)
        layernorm_output = self._norm(self.pre_mlp_layernorm, hidden_states)
        mlp_output, mlp_bias = self._mlp_forward(layernorm_output)
        residual = layernorm_output if self.apply_residual_connection_post_layernorm else hidden_states
        output = self._bias_dropout_add(mlp_output, mlp_bias, residual, "mlp")
        # Pipeline schedules free stage outputs by swapping .data, which needs a tensor that is not a view.
        return make_viewless_tensor(inp=output, requires_grad=output.requires_grad, keep_graph=True)


def _mlp_kwargs(spec, layer_number, pg_collection) -> dict:
    """MoE layers want their layer number (per-layer loss logging) and the process groups; a dense MLP its TP
    group (megatron-core passes ``tp_group=pg_collection.tp``)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    module = spec.module if isinstance(spec, ModuleSpec) else spec
    if isinstance(module, type) and issubclass(module, MoELayer):
        return {"layer_number": layer_number, **({} if pg_collection is None else {"pg_collection": pg_collection})}
    if pg_collection is not None and isinstance(module, type) and issubclass(module, MLP):
        return {"tp_group": pg_collection.tp}
    return {}


class NoopTransformerLayer(MegatronModule, BaseTransformerLayer):
    """Stands in for the zero layers of a standalone-embedding stage: returns a copy of its input so that the
    stage's output is not the received tensor itself."""

    def __init__(self, layer_number):
        super().__init__()
        self.layer_number = layer_number

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states.clone()


class TransformerLayer(ParallelTransformerLayer):
    """megatron-core: ``TransformerLayer(config, submodules, layer_number=1, hidden_dropout=None, pg_collection=None,
    vp_stage=None)``; ``forward(hidden_states, attention_mask, context=None, context_mask=None, rotary_pos_emb=None,
    inference_params=None) -> (hidden_states, context)``. ``layer_number`` is global (1-based), so ``vp_stage``
    (the virtual pipeline chunk) is only recorded."""

    def __init__(self, config, submodules: TransformerLayerSubmodules = None, layer_number: int = 1,
                 hidden_dropout=None, pg_collection=None, vp_stage=None):
        if submodules is None:
            submodules = default_layer_submodules(AttnMaskType.padding)
        super().__init__(config, layer_number, naming="mcore", submodules=submodules, hidden_dropout=hidden_dropout,
                         pg_collection=pg_collection)
        self.vp_stage = vp_stage

    def forward(self, hidden_states, attention_mask, context=None, context_mask=None, rotary_pos_emb=None,
                inference_params=None, packed_seq_params=None):
        if packed_seq_params is None:
            output = super().forward(hidden_states, attention_mask, encoder_output=context,
                                     enc_dec_attn_mask=context_mask, inference_params=inference_params,
                                     rotary_pos_emb=rotary_pos_emb)
            return output, context
        hidden_states, _ = self._forward_attention(hidden_states, attention_mask, context=context,
                                                   context_mask=context_mask, rotary_pos_emb=rotary_pos_emb,
                                                   inference_params=inference_params,
                                                   packed_seq_params=packed_seq_params)
        return self._forward_mlp(hidden_states), context


class MoETransformerLayer(TransformerLayer):
    """A :class:`TransformerLayer` whose MLP is a mixture of experts (megatron-core's class for MoE layers, e.g. in
    hybrid stacks); it computes exactly as a TransformerLayer and marks itself ``is_moe_layer``."""

    def __init__(self, *args, **kwargs):
        self.is_moe_layer = True
        super().__init__(*args, **kwargs)


def default_layer_submodules(attn_mask_type) -> TransformerLayerSubmodules:
    """The local (non-Transformer-Engine) layer: our norms, SelfAttention, MLP."""
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return TransformerLayerSubmodules(
        input_layernorm=FusedLayerNorm,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": attn_mask_type},
                                  submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                                     core_attention=DotProductAttention,
                                                                     linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=FusedLayerNorm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=dict(LOCAL_NORM_KEYS_MAP),
    )

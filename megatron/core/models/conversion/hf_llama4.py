"""Hugging Face Llama 4 text models (``Llama4ForCausalLM``, config ``llama4_text``) <-> megatron-core ``GPTModel``.

Attention, norms, embeddings and head map as every Llama-style decoder's (:mod:`.hf_layers`, no biases, no q/k norm
weights). The MLP of layer i (``model.layers.{i}.feed_forward.``) is a mixture of experts when ``i`` is in
``moe_layers`` (``interleave_moe_layer_step`` 2 = Megatron's ``--moe-layer-freq ([0,1]*24)``), else a dense MLP of
width ``intermediate_size_mlp`` (``--ffn-hidden-size``):

=========================================  ==============================================================
``feed_forward.router.weight``             ``mlp.router.weight`` (sigmoid of the top-1 logit = ``--moe-router-score-function
                                           sigmoid --moe-router-topk 1``)
``feed_forward.experts.gate_up_proj``      expert e's ``linear_fc1 [2I, h]`` = ``G[e]^T`` (input-major, gate half first)
``[E, h, 2I]``
``feed_forward.experts.down_proj``         expert e's ``linear_fc2 [h, I]`` = ``D[e]^T``
``[E, I, h]``
``feed_forward.shared_expert.{gate,up,     ``mlp.shared_experts.linear_fc1 = [gate; up]``, ``linear_fc2`` (ungated,
down}_proj``                               width ``intermediate_size``)
``feed_forward.{gate,up,down}_proj``       dense ``mlp.linear_fc1`` / ``linear_fc2``
=========================================  ==============================================================

The routing weight multiplies the expert's input (``--moe-apply-probs-on-input``); RoPE rotates adjacent channel pairs
(``--rotary-interleaved``) with the checkpoint's ``llama3`` scaling if any; the layers with ``no_rope_layers[i] == 0``
have no RoPE (``--no-rope-freq``: ``4`` for Hugging Face's default pattern, else a 0/1 list); ``use_qk_norm`` is the
weightless QK L2 norm, which Hugging Face applies in the RoPE layers only (``qk_l2_norm_rope_layers_only``; Megatron's
``--qk-l2-norm`` normalises every layer). Not implemented, and the identity up to 8192 tokens: chunked attention
(``attention_chunk_size`` 8192) and the NoPE layers' temperature tuning (``floor_scale`` 8192).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.models.conversion.hf import rope_theta, rope_scaling_to_hf, rope_scaling_to_megatron
from megatron.core.models.conversion.hf_layers import (decoder_from_hf, decoder_to_hf, experts_from_hf, experts_to_hf,
                                                       gated_mlp_from_hf, gated_mlp_to_hf)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.vocab_padding import vocab_size_with_padding


def _moe_layers(hf_config):
    layers = getattr(hf_config, "moe_layers", None)
    if layers is None:
        step = getattr(hf_config, "interleave_moe_layer_step", 1)
        layers = list(range(step - 1, hf_config.num_hidden_layers, step))
    return set(layers)


def _uses_rope(hf_config):
    """Per layer (0-based): 1 = RoPE, 0 = NoPE, Hugging Face's ``no_rope_layers``."""
    layers = getattr(hf_config, "no_rope_layers", None)
    if not layers:
        interval = getattr(hf_config, "no_rope_layer_interval", 4)
        layers = [int((i + 1) % interval != 0) for i in range(hf_config.num_hidden_layers)]
    return list(layers)


def _as_layer_freq(flags, num_layers):
    """A 0/1 per-layer list of NoPE layers as ``--no-rope-freq``'s int form N when it is ``[0]*(N-1)+[1]`` repeated,
    else the list (None: all zero)."""
    if not any(flags):
        return None
    for n in range(1, num_layers + 1):
        if num_layers % n == 0 and flags == ([0] * (n - 1) + [1]) * (num_layers // n):
            return n
    return list(flags)


def config_to_megatron(hf_config, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1,
                       **config_kwargs) -> TransformerConfig:
    """TransformerConfig computing what ``Llama4ForCausalLM`` computes (module docstring)."""
    if getattr(hf_config, "hidden_act", "silu") != "silu" or getattr(hf_config, "attention_bias", False):
        raise ValueError("llama4_text with a hidden_act other than silu or attention_bias has no Megatron equivalent")
    if getattr(hf_config, "num_experts_per_tok", 1) != 1:
        raise ValueError("llama4_text routes each token to one expert (its routing weight scales the expert's "
                         f"input); num_experts_per_tok {hf_config.num_experts_per_tok} is not supported")
    n = hf_config.num_hidden_layers
    moe = _moe_layers(hf_config)
    no_rope = _as_layer_freq([1 - u for u in _uses_rope(hf_config)], n)
    qk_norm = bool(getattr(hf_config, "use_qk_norm", False))
    kwargs = dict(
        num_layers=n, hidden_size=hf_config.hidden_size, num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads, kv_channels=hf_config.head_dim,
        ffn_hidden_size=hf_config.intermediate_size_mlp, layernorm_epsilon=hf_config.rms_norm_eps,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        num_moe_experts=hf_config.num_local_experts if moe else None, moe_router_topk=1,
        moe_ffn_hidden_size=hf_config.intermediate_size,
        moe_shared_expert_intermediate_size=hf_config.intermediate_size, moe_router_score_function="sigmoid",
        moe_apply_probs_on_input=True,
        moe_layer_freq=1 if moe == set(range(n)) else [int(i in moe) for i in range(n)],
        qk_l2_norm=qk_norm, qk_l2_norm_rope_layers_only=qk_norm and no_rope is not None, no_rope_freq=no_rope,
        position_embedding_type="rope", rotary_interleaved=True, rotary_base=rope_theta(hf_config),
        hidden_dropout=0.0, attention_dropout=getattr(hf_config, "attention_dropout", 0.0),
        tensor_model_parallel_size=tensor_model_parallel_size, init_method_std=hf_config.initializer_range,
        bias_gelu_fusion=False, max_position_embeddings=hf_config.max_position_embeddings,
        padded_vocab_size=vocab_size_with_padding(hf_config.vocab_size, make_vocab_size_divisible_by,
                                                  tensor_model_parallel_size, log=False),
        untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", False),
        **rope_scaling_to_megatron(hf_config))
    if not moe:
        for key in [k for k in kwargs if k.startswith("moe_")]:
            del kwargs[key]
    kwargs.update(config_kwargs)
    return TransformerConfig(**kwargs)


def _feed_forward_from_hf(moe_layers):
    def convert(sd, layer, src, dst, out):
        ff, mlp = src + "feed_forward.", dst + "mlp."
        if layer not in moe_layers:
            gated_mlp_from_hf(sd, ff, mlp, out)
            return
        out[mlp + "router.weight"] = sd[ff + "router.weight"].clone()
        experts_from_hf(sd[ff + "experts.gate_up_proj"].transpose(1, 2), sd[ff + "experts.down_proj"].transpose(1, 2),
                        mlp, out)
        gated_mlp_from_hf(sd, ff + "shared_expert.", mlp + "shared_experts.", out)
    return convert


def _feed_forward_to_hf(moe_layers):
    def convert(sd, layer, src, dst, out):
        ff, mlp = dst + "feed_forward.", src + "mlp."
        if layer not in moe_layers:
            gated_mlp_to_hf(sd, mlp, ff, out)
            return
        out[ff + "router.weight"] = sd[mlp + "router.weight"].clone()
        fc1, fc2, _, _ = experts_to_hf(sd, mlp, sd[mlp + "router.weight"].shape[0])
        out[ff + "experts.gate_up_proj"] = fc1.transpose(1, 2).contiguous()
        out[ff + "experts.down_proj"] = fc2.transpose(1, 2).contiguous()
        gated_mlp_to_hf(sd, mlp + "shared_experts.", ff + "shared_expert.", out)
    return convert


def to_megatron(hf_state_dict: Dict[str, torch.Tensor], hf_config, padded_vocab_size: int) -> Dict[str, torch.Tensor]:
    return decoder_from_hf(hf_state_dict, hf_config, padded_vocab_size, _feed_forward_from_hf(_moe_layers(hf_config)))


def to_hf(state_dict: Dict[str, torch.Tensor], hf_config) -> Dict[str, torch.Tensor]:
    return decoder_to_hf(state_dict, hf_config, _feed_forward_to_hf(_moe_layers(hf_config)))


def config_to_hf(config: TransformerConfig) -> Optional[Tuple[str, dict]]:
    """``('llama4_text', Llama4TextConfig fields)`` of a Llama-4-shaped TransformerConfig (interleaved RoPE, sigmoid
    top-1 routing on the expert input with an ungated shared expert of the experts' width), else None."""
    if not (config.num_moe_experts and config.moe_apply_probs_on_input and config.moe_router_topk == 1
            and config.moe_router_score_function == "sigmoid" and config.rotary_interleaved
            and config.normalization == "RMSNorm" and config.gated_linear_unit and config.activation_func is F.silu
            and not config.add_bias_linear and not config.add_qkv_bias and not config.qk_layernorm
            and config.position_embedding_type == "rope" and not config.moe_shared_expert_gate
            and config.moe_shared_expert_intermediate_size == config.moe_ffn_hidden_size
            and config.moe_router_topk_scaling_factor in (None, 1.0) and config.rotary_percent == 1.0):
        return None
    n = config.num_layers
    moe_layers = [i for i in range(n) if config.is_moe_layer(i + 1)]
    no_rope = [config.is_no_rope_layer(i + 1) for i in range(n)]
    if config.qk_l2_norm and any(no_rope) and not config.qk_l2_norm_rope_layers_only:
        return None  # Hugging Face Llama 4 does not normalise its NoPE layers
    return "llama4_text", dict(
        hidden_size=config.hidden_size, num_hidden_layers=n, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, head_dim=config.kv_channels,
        intermediate_size=config.moe_ffn_hidden_size, intermediate_size_mlp=config.ffn_hidden_size,
        num_local_experts=config.num_moe_experts, num_experts_per_tok=1, moe_layers=moe_layers,
        no_rope_layers=[int(not x) for x in no_rope], use_qk_norm=config.qk_l2_norm,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.layernorm_epsilon,
        rope_parameters=dict(rope_theta=float(config.rotary_base), **rope_scaling_to_hf(config)),
        tie_word_embeddings=not config.untie_embeddings_and_output_weights)

"""Hugging Face gpt-oss (``GptOssForCausalLM``) <-> megatron-core ``GPTModel`` state dicts and configs.

Attention, norms, embeddings and head map as every Llama-style decoder's (:mod:`.hf_layers`, with q/k/v/o biases);
gpt-oss adds (``model.layers.{i}.`` -> ``decoder.layers.{i}.``):

==============================================  ================================================================
``self_attn.sinks [heads]``                     ``self_attention.core_attention.softmax_offset`` (``--softmax-type
                                                learnable``)
``mlp.router.{weight,bias}``                    ``mlp.router.{weight,bias}`` (top-k of the logits, softmax over the k
                                                = Megatron's default routing)
``mlp.experts.gate_up_proj [E, h, 2F]``         expert e's ``linear_fc1 [2F, h]`` = ``[G[e][:, 0::2]^T; G[e][:, 1::2]^T]``
(input-major, gate and linear **interleaved**)  (Megatron keeps the gate half, then the linear half)
``mlp.experts.gate_up_proj_bias [E, 2F]``       ``linear_fc1.bias = [B[e][0::2]; B[e][1::2]]``
``mlp.experts.down_proj [E, F, h]`` / bias      ``linear_fc2.weight = D[e]^T`` / ``linear_fc2.bias`` (scaled with the
``[E, h]``                                      expert's output by its routing weight)
==============================================  ================================================================

The config: ``--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value <swiglu_limit>`` (HF ``_apply_gate``:
``min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1)``), ``--window-size <sliding_window - 1>,0`` on the
layers whose ``layer_types`` entry is ``sliding_attention`` (``--window-attn-skip-freq 2`` for the alternating
pattern, else a 0/1 list), YaRN RoPE from ``rope_parameters`` (factor, original context, betas; ``truncate=False`` =
a fractional correction range) and linear biases everywhere (no ``--disable-bias-linear``).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megatron.core.models.conversion.hf import rope_theta, rope_scaling_of
from megatron.core.models.conversion.hf_layers import decoder_from_hf, decoder_to_hf, experts_from_hf, experts_to_hf
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.vocab_padding import vocab_size_with_padding

QUICK_GELU_ALPHA = 1.702


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``[g0, l0, g1, l1, ...]`` along ``dim`` -> ``[g0, g1, ...; l0, l1, ...]``."""
    index = [slice(None)] * t.dim()
    index[dim] = slice(0, None, 2)
    gate = t[tuple(index)]
    index[dim] = slice(1, None, 2)
    return torch.cat([gate, t[tuple(index)]], dim=dim)


def _interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of :func:`_deinterleave`."""
    gate, linear = torch.chunk(t, 2, dim=dim)
    return torch.stack([gate, linear], dim=dim + 1).flatten(dim, dim + 1)


def window_layers(hf_config):
    """``--window-attn-skip-freq`` of ``layer_types``: 2 for gpt-oss's sliding/full alternation, else a 0/1 list."""
    types = list(getattr(hf_config, "layer_types", None) or [])
    pattern = [1 if t == "sliding_attention" else 0 for t in types]
    if pattern == [1 if i % 2 == 0 else 0 for i in range(len(pattern))]:
        return 2
    return pattern


def _yarn_fields(hf_config) -> dict:
    scaling = rope_scaling_of(hf_config)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return dict(position_embedding_type="rope")
    if kind != "yarn":
        raise ValueError(f"gpt_oss with {kind!r} RoPE scaling is not supported (YaRN or none)")
    return dict(position_embedding_type="yarn", rotary_scaling_factor=float(scaling["factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                beta_fast=float(scaling.get("beta_fast", 32.0)), beta_slow=float(scaling.get("beta_slow", 1.0)),
                mscale=float(scaling.get("mscale") or 1.0), mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
                yarn_correction_range_round_to_int=bool(scaling.get("truncate", True)))


def config_to_megatron(hf_config, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1,
                       **config_kwargs) -> TransformerConfig:
    """TransformerConfig computing what ``GptOssForCausalLM`` computes (module docstring)."""
    from megatron.core.activations import quick_gelu

    alpha = getattr(hf_config, "swiglu_alpha", QUICK_GELU_ALPHA)
    if abs(alpha - QUICK_GELU_ALPHA) > 1e-9:
        raise ValueError(f"gpt_oss with swiglu_alpha {alpha}: Megatron's --quick-geglu uses {QUICK_GELU_ALPHA}")
    if not getattr(hf_config, "attention_bias", True):
        raise ValueError("gpt_oss without attention_bias: Megatron's linear biases (attention, router, experts) go "
                         "together")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    window = getattr(hf_config, "sliding_window", None)
    kwargs = dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads, num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim, ffn_hidden_size=hf_config.intermediate_size,
        moe_ffn_hidden_size=hf_config.intermediate_size, num_moe_experts=hf_config.num_local_experts,
        moe_router_topk=hf_config.num_experts_per_tok, layernorm_epsilon=hf_config.rms_norm_eps,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=quick_gelu, glu_linear_offset=1.0,
        activation_func_clamp_value=float(hf_config.swiglu_limit), add_bias_linear=True, softmax_type="learnable",
        window_size=(window - 1, 0) if window else None, window_attn_skip_freq=window_layers(hf_config) if window
        else None, hidden_dropout=0.0, attention_dropout=getattr(hf_config, "attention_dropout", 0.0),
        tensor_model_parallel_size=tensor_model_parallel_size, init_method_std=hf_config.initializer_range,
        bias_gelu_fusion=False, padded_vocab_size=vocab_size_with_padding(
            hf_config.vocab_size, make_vocab_size_divisible_by, tensor_model_parallel_size, log=False),
        max_position_embeddings=hf_config.max_position_embeddings, rotary_base=rope_theta(hf_config),
        untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", False),
        **_yarn_fields(hf_config))
    kwargs.update(config_kwargs)
    return TransformerConfig(**kwargs)


def _sinks_and_moe_from_hf(sd, layer, src, dst, out):
    mlp = src + "mlp."
    out[dst + "self_attention.core_attention.softmax_offset"] = sd[src + "self_attn.sinks"].clone()
    out[dst + "mlp.router.weight"] = sd[mlp + "router.weight"].clone()
    out[dst + "mlp.router.bias"] = sd[mlp + "router.bias"].clone()
    fc1 = _deinterleave(sd[mlp + "experts.gate_up_proj"], 2).transpose(1, 2)      # [E, 2F, h]
    fc2 = sd[mlp + "experts.down_proj"].transpose(1, 2)                           # [E, h, F]
    experts_from_hf(fc1, fc2, dst + "mlp.", out, fc1_bias=_deinterleave(sd[mlp + "experts.gate_up_proj_bias"], 1),
                    fc2_bias=sd[mlp + "experts.down_proj_bias"])


def _sinks_and_moe_to_hf(sd, layer, src, dst, out):
    mlp = dst + "mlp."
    out[dst + "self_attn.sinks"] = sd[src + "self_attention.core_attention.softmax_offset"].clone()
    out[mlp + "router.weight"] = sd[src + "mlp.router.weight"].clone()
    out[mlp + "router.bias"] = sd[src + "mlp.router.bias"].clone()
    fc1, fc2, b1, b2 = experts_to_hf(sd, src + "mlp.", sd[src + "mlp.router.weight"].shape[0])
    out[mlp + "experts.gate_up_proj"] = _interleave(fc1.transpose(1, 2), 2).contiguous()
    out[mlp + "experts.gate_up_proj_bias"] = _interleave(b1, 1).contiguous()
    out[mlp + "experts.down_proj"] = fc2.transpose(1, 2).contiguous()
    out[mlp + "experts.down_proj_bias"] = b2.clone()


def to_megatron(hf_state_dict: Dict[str, torch.Tensor], hf_config, padded_vocab_size: int) -> Dict[str, torch.Tensor]:
    """``GptOssForCausalLM`` state dict (dequantised: the Hub's MXFP4 ``*_blocks`` / ``*_scales`` are refused) ->
    megatron-core GPTModel state dict."""
    if any(k.endswith(("_blocks", "_scales")) for k in hf_state_dict):
        raise ValueError("the checkpoint holds MXFP4-quantised experts (*_blocks / *_scales): dequantise it first "
                         "(transformers: from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True)) and "
                         "save_pretrained)")
    return decoder_from_hf(hf_state_dict, hf_config, padded_vocab_size, _sinks_and_moe_from_hf)


def to_hf(state_dict: Dict[str, torch.Tensor], hf_config) -> Dict[str, torch.Tensor]:
    return decoder_to_hf(state_dict, hf_config, _sinks_and_moe_to_hf)


def config_to_hf(config: TransformerConfig) -> Optional[Tuple[str, dict]]:
    """``('gpt_oss', GptOssConfig fields)`` of a gpt-oss-shaped TransformerConfig (quick GeGLU with offset 1 and a
    clamp, learnable sinks, every layer MoE with biases, RMSNorm, RoPE or YaRN), else None."""
    from megatron.core.activations import quick_gelu

    if not (config.activation_func is quick_gelu and config.gated_linear_unit and config.glu_linear_offset == 1.0
            and config.activation_func_clamp_value is not None and config.softmax_type == "learnable"
            and config.num_moe_experts and config.moe_layer_freq == 1 and config.add_bias_linear
            and config.normalization == "RMSNorm" and config.position_embedding_type in ("rope", "yarn")
            and not config.moe_shared_expert_intermediate_size and not config.moe_router_pre_softmax
            and config.moe_router_score_function == "softmax" and not config.qk_layernorm
            and config.moe_ffn_hidden_size == config.ffn_hidden_size and not config.rotary_interleaved):
        return None
    window = config.window_size
    if window is not None and (window[1] != 0 or window[0] < 0):
        return None  # Hugging Face windows look back a bounded number of tokens only
    layer_types = ["sliding_attention" if window is not None and config.is_window_attention_layer(i + 1)
                   else "full_attention" for i in range(config.num_layers)]
    rope = dict(rope_type="default", rope_theta=float(config.rotary_base))
    if config.position_embedding_type == "yarn":
        rope.update(rope_type="yarn", factor=config.rotary_scaling_factor,
                    original_max_position_embeddings=config.original_max_position_embeddings,
                    beta_fast=config.beta_fast, beta_slow=config.beta_slow,
                    truncate=bool(config.yarn_correction_range_round_to_int))
        if config.mscale != 1.0 or config.mscale_all_dim not in (0.0, None):
            return None  # Hugging Face gpt-oss's YaRN has the default attention factor
    return "gpt_oss", dict(
        hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_query_groups,
        head_dim=config.kv_channels, intermediate_size=config.ffn_hidden_size,
        num_local_experts=config.num_moe_experts, num_experts_per_tok=config.moe_router_topk,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.layernorm_epsilon,
        sliding_window=(window[0] + 1) if window is not None else None, layer_types=layer_types,
        swiglu_limit=config.activation_func_clamp_value, rope_parameters=rope, attention_bias=True,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights)

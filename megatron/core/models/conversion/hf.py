"""Conversion between our model state dicts and Hugging Face ``transformers`` checkpoints (GPT-2 and Llama; the
mixture-of-experts models Mixtral and Qwen2-MoE, whose attention is Llama's, are in :mod:`.hf_moe`).

Our side is the full (TP=1, PP=1) state dict of the legacy ``GPTModel`` (Megatron checkpoint key names) or,
with ``key_format='mcore'``, of megatron-core's ``GPTModel``; use :mod:`megatron.core.models.conversion.tp` to
split it for tensor parallelism. What changes between the two sides:

* fused QKV: Hugging Face stores Q, K, V as separate blocks (GPT-2: one ``c_attn`` of ``[Q; K; V]``, Llama:
  ``q_proj``/``k_proj``/``v_proj``); Megatron interleaves them per query group: ``[q heads of group g; k_g; v_g]``;
* GPT-2's ``Conv1D`` stores weights as ``[in, out]``: transposed relative to ``torch.nn.Linear`` / Megatron;
* swiglu: Megatron's ``dense_h_to_4h`` is ``[gate; up]`` (Llama ``gate_proj``, ``up_proj``);
* the vocabulary is padded (zero rows) to a multiple of ``make_vocab_size_divisible_by * TP``, and trimmed back;
* tied heads: GPT-2 (and Llama with ``tie_word_embeddings``) reuse the input embedding as output layer;
  untied Llama maps ``lm_head`` to ``output_layer``.

The ``*_config_to_megatron`` helpers build the matching :class:`TransformerConfig` (model options included).
Nothing here downloads anything: callers pass state dicts and ``transformers`` config objects (or anything with
the same attribute names).
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F

from megatron.core.models.conversion.keys import legacy_to_mcore, mcore_to_legacy
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.vocab_padding import vocab_size_with_padding

_P = "language_model.encoder.layers."
_EMB = "language_model.embedding."


def _pad_vocab(weight: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    if weight.shape[0] > padded_vocab_size:
        raise ValueError(f"vocabulary of {weight.shape[0]} rows does not fit padded_vocab_size={padded_vocab_size}")
    if weight.shape[0] == padded_vocab_size:
        return weight.clone()
    pad = torch.zeros(padded_vocab_size - weight.shape[0], *weight.shape[1:], dtype=weight.dtype)
    return torch.cat([weight, pad], dim=0)


def _finish(state_dict, key_format):
    if key_format == "legacy":
        return state_dict
    if key_format == "mcore":
        return legacy_to_mcore(state_dict, "gpt")
    raise ValueError(f"key_format must be 'legacy' or 'mcore', got {key_format!r}")


def _to_legacy(state_dict, key_format):
    if key_format == "mcore":
        return mcore_to_legacy(state_dict, "gpt")
    return state_dict


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_query_groups: int) -> torch.Tensor:
    """Separate Q ``[nh*hd, ...]``, K, V ``[ng*hd, ...]`` -> Megatron's fused, group-major QKV rows."""
    hd = q.shape[0] // num_heads
    rest = q.shape[1:]
    q = q.reshape(num_query_groups, (num_heads // num_query_groups) * hd, *rest)
    k = k.reshape(num_query_groups, hd, *rest)
    v = v.reshape(num_query_groups, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_query_groups: int):
    """Inverse of :func:`fuse_qkv`: Megatron's fused QKV rows -> (Q, K, V)."""
    heads_per_group = num_heads // num_query_groups
    hd = qkv.shape[0] // (num_query_groups * (heads_per_group + 2))
    rest = qkv.shape[1:]
    grouped = qkv.reshape(num_query_groups, (heads_per_group + 2) * hd, *rest)
    q, k, v = torch.split(grouped, [heads_per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


# ---------------------------------------------------------------------------------------------- GPT-2

def gpt2_config_to_megatron(hf_config, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1,
                            **config_kwargs) -> TransformerConfig:
    """TransformerConfig (+ model options) computing what ``GPT2LMHeadModel`` computes."""
    if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False) or getattr(hf_config, "reorder_and_upcast_attn", False):
        raise ValueError("GPT-2 variants with scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
    if hf_config.activation_function not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"unsupported GPT-2 activation {hf_config.activation_function!r}")
    kwargs = dict(
        num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd, num_attention_heads=hf_config.n_head,
        ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd, layernorm_epsilon=hf_config.layer_norm_epsilon,
        hidden_dropout=hf_config.resid_pdrop, attention_dropout=hf_config.attn_pdrop,
        tensor_model_parallel_size=tensor_model_parallel_size, init_method_std=hf_config.initializer_range,
    )
    kwargs.update(
        padded_vocab_size=vocab_size_with_padding(hf_config.vocab_size, make_vocab_size_divisible_by,
                                                  tensor_model_parallel_size, log=False),
        max_position_embeddings=hf_config.n_positions, openai_gelu=hf_config.activation_function != "gelu")
    kwargs.update(config_kwargs)
    return TransformerConfig(**kwargs)


def gpt2_hf_to_megatron(hf_state_dict: Dict[str, torch.Tensor], hf_config, padded_vocab_size: int,
                        key_format: str = "legacy") -> Dict[str, torch.Tensor]:
    """``GPT2LMHeadModel`` / ``GPT2Model`` state dict -> our GPTModel state dict (tied output layer)."""
    sd = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in hf_state_dict.items()}
    nh, h = hf_config.n_head, hf_config.n_embd
    out = {
        _EMB + "word_embeddings.weight": _pad_vocab(sd["wte.weight"], padded_vocab_size),
        _EMB + "position_embeddings.weight": sd["wpe.weight"].clone(),
    }
    for i in range(hf_config.n_layer):
        src, dst = f"h.{i}.", f"{_P}{i}."
        out[dst + "input_layernorm.weight"] = sd[src + "ln_1.weight"].clone()
        out[dst + "input_layernorm.bias"] = sd[src + "ln_1.bias"].clone()
        qkv_w = sd[src + "attn.c_attn.weight"].t()           # Conv1D [h, 3h] -> [3h, h] = [Q; K; V]
        q, k, v = torch.chunk(qkv_w, 3, dim=0)
        out[dst + "self_attention.query_key_value.weight"] = fuse_qkv(q, k, v, nh, nh).contiguous()
        q, k, v = torch.chunk(sd[src + "attn.c_attn.bias"], 3, dim=0)
        out[dst + "self_attention.query_key_value.bias"] = fuse_qkv(q, k, v, nh, nh).contiguous()
        out[dst + "self_attention.dense.weight"] = sd[src + "attn.c_proj.weight"].t().contiguous()
        out[dst + "self_attention.dense.bias"] = sd[src + "attn.c_proj.bias"].clone()
        out[dst + "post_attention_layernorm.weight"] = sd[src + "ln_2.weight"].clone()
        out[dst + "post_attention_layernorm.bias"] = sd[src + "ln_2.bias"].clone()
        out[dst + "mlp.dense_h_to_4h.weight"] = sd[src + "mlp.c_fc.weight"].t().contiguous()
        out[dst + "mlp.dense_h_to_4h.bias"] = sd[src + "mlp.c_fc.bias"].clone()
        out[dst + "mlp.dense_4h_to_h.weight"] = sd[src + "mlp.c_proj.weight"].t().contiguous()
        out[dst + "mlp.dense_4h_to_h.bias"] = sd[src + "mlp.c_proj.bias"].clone()
    out["language_model.encoder.final_layernorm.weight"] = sd["ln_f.weight"].clone()
    out["language_model.encoder.final_layernorm.bias"] = sd["ln_f.bias"].clone()
    assert h == out[_EMB + "word_embeddings.weight"].shape[1]
    return _finish(out, key_format)


def gpt2_megatron_to_hf(state_dict: Dict[str, torch.Tensor], hf_config, key_format: str = "legacy") -> Dict[str, torch.Tensor]:
    """Our GPTModel state dict -> ``GPT2LMHeadModel`` state dict (vocabulary trimmed to ``hf_config.vocab_size``)."""
    sd = _to_legacy(state_dict, key_format)
    nh, V = hf_config.n_head, hf_config.vocab_size
    wte = sd[_EMB + "word_embeddings.weight"][:V].clone()
    out = {"transformer.wte.weight": wte, "transformer.wpe.weight": sd[_EMB + "position_embeddings.weight"].clone()}
    for i in range(hf_config.n_layer):
        src, dst = f"{_P}{i}.", f"transformer.h.{i}."
        out[dst + "ln_1.weight"] = sd[src + "input_layernorm.weight"].clone()
        out[dst + "ln_1.bias"] = sd[src + "input_layernorm.bias"].clone()
        q, k, v = split_qkv(sd[src + "self_attention.query_key_value.weight"], nh, nh)
        out[dst + "attn.c_attn.weight"] = torch.cat([q, k, v], dim=0).t().contiguous()
        q, k, v = split_qkv(sd[src + "self_attention.query_key_value.bias"], nh, nh)
        out[dst + "attn.c_attn.bias"] = torch.cat([q, k, v], dim=0).contiguous()
        out[dst + "attn.c_proj.weight"] = sd[src + "self_attention.dense.weight"].t().contiguous()
        out[dst + "attn.c_proj.bias"] = sd[src + "self_attention.dense.bias"].clone()
        out[dst + "ln_2.weight"] = sd[src + "post_attention_layernorm.weight"].clone()
        out[dst + "ln_2.bias"] = sd[src + "post_attention_layernorm.bias"].clone()
        out[dst + "mlp.c_fc.weight"] = sd[src + "mlp.dense_h_to_4h.weight"].t().contiguous()
        out[dst + "mlp.c_fc.bias"] = sd[src + "mlp.dense_h_to_4h.bias"].clone()
        out[dst + "mlp.c_proj.weight"] = sd[src + "mlp.dense_4h_to_h.weight"].t().contiguous()
        out[dst + "mlp.c_proj.bias"] = sd[src + "mlp.dense_4h_to_h.bias"].clone()
    out["transformer.ln_f.weight"] = sd["language_model.encoder.final_layernorm.weight"].clone()
    out["transformer.ln_f.bias"] = sd["language_model.encoder.final_layernorm.bias"].clone()
    out["lm_head.weight"] = wte  # tied
    return out


# ---------------------------------------------------------------------------------------------- Llama

def _rope_theta(hf_config) -> float:
    theta = getattr(hf_config, "rope_theta", None)
    params = getattr(hf_config, "rope_parameters", None) or {}
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    return theta


def _rope_interpolation_factor(hf_config):
    scaling = getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return scaling["factor"]
    raise ValueError(f"RoPE scaling {kind!r} is not supported (only linear position interpolation)")


def llama_config_to_megatron(hf_config, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1,
                             **config_kwargs) -> TransformerConfig:
    """TransformerConfig (+ model options) computing what ``LlamaForCausalLM`` computes."""
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"only silu (swiglu) Llama MLPs are supported, got {hf_config.hidden_act!r}")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    attention_bias, mlp_bias = bool(getattr(hf_config, "attention_bias", False)), bool(getattr(hf_config, "mlp_bias", False))
    if attention_bias != mlp_bias:
        raise ValueError("Llama configs with attention_bias != mlp_bias are not supported (Megatron's "
                         "--disable-bias-linear switches all linear biases together)")
    kwargs = dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        kv_channels=head_dim, ffn_hidden_size=hf_config.intermediate_size, layernorm_epsilon=hf_config.rms_norm_eps,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=attention_bias,
        hidden_dropout=0.0, attention_dropout=getattr(hf_config, "attention_dropout", 0.0),
        tensor_model_parallel_size=tensor_model_parallel_size, init_method_std=hf_config.initializer_range,
        bias_gelu_fusion=False,
    )
    kwargs.update(
        padded_vocab_size=vocab_size_with_padding(hf_config.vocab_size, make_vocab_size_divisible_by,
                                                  tensor_model_parallel_size, log=False),
        max_position_embeddings=hf_config.max_position_embeddings, position_embedding_type="rope",
        rotary_base=_rope_theta(hf_config), rotary_seq_len_interpolation_factor=_rope_interpolation_factor(hf_config),
        untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", False))
    kwargs.update(config_kwargs)
    return TransformerConfig(**kwargs)


def llama_hf_to_megatron(hf_state_dict: Dict[str, torch.Tensor], hf_config, padded_vocab_size: int,
                         key_format: str = "legacy") -> Dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` state dict -> our GPTModel state dict (RMSNorm, swiglu, RoPE, GQA)."""
    sd = hf_state_dict
    nh = hf_config.num_attention_heads
    ng = getattr(hf_config, "num_key_value_heads", None) or nh
    tied = getattr(hf_config, "tie_word_embeddings", False)
    out = {_EMB + "word_embeddings.weight": _pad_vocab(sd["model.embed_tokens.weight"], padded_vocab_size)}
    for i in range(hf_config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"{_P}{i}."
        out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"].clone()
        att = src + "self_attn."
        out[dst + "self_attention.query_key_value.weight"] = fuse_qkv(
            sd[att + "q_proj.weight"], sd[att + "k_proj.weight"], sd[att + "v_proj.weight"], nh, ng).contiguous()
        if att + "q_proj.bias" in sd:
            out[dst + "self_attention.query_key_value.bias"] = fuse_qkv(
                sd[att + "q_proj.bias"], sd[att + "k_proj.bias"], sd[att + "v_proj.bias"], nh, ng).contiguous()
        out[dst + "self_attention.dense.weight"] = sd[att + "o_proj.weight"].clone()
        if att + "o_proj.bias" in sd:
            out[dst + "self_attention.dense.bias"] = sd[att + "o_proj.bias"].clone()
        out[dst + "post_attention_layernorm.weight"] = sd[src + "post_attention_layernorm.weight"].clone()
        mlp = src + "mlp."
        out[dst + "mlp.dense_h_to_4h.weight"] = torch.cat([sd[mlp + "gate_proj.weight"], sd[mlp + "up_proj.weight"]], 0)
        if mlp + "gate_proj.bias" in sd:
            out[dst + "mlp.dense_h_to_4h.bias"] = torch.cat([sd[mlp + "gate_proj.bias"], sd[mlp + "up_proj.bias"]], 0)
        out[dst + "mlp.dense_4h_to_h.weight"] = sd[mlp + "down_proj.weight"].clone()
        if mlp + "down_proj.bias" in sd:
            out[dst + "mlp.dense_4h_to_h.bias"] = sd[mlp + "down_proj.bias"].clone()
    out["language_model.encoder.final_layernorm.weight"] = sd["model.norm.weight"].clone()
    if not tied:
        out["language_model.output_layer.weight"] = _pad_vocab(sd["lm_head.weight"], padded_vocab_size)
    return _finish(out, key_format)


def llama_megatron_to_hf(state_dict: Dict[str, torch.Tensor], hf_config, key_format: str = "legacy") -> Dict[str, torch.Tensor]:
    """Our GPTModel state dict (Llama configuration) -> ``LlamaForCausalLM`` state dict."""
    sd = _to_legacy(state_dict, key_format)
    nh = hf_config.num_attention_heads
    ng = getattr(hf_config, "num_key_value_heads", None) or nh
    V = hf_config.vocab_size
    out = {"model.embed_tokens.weight": sd[_EMB + "word_embeddings.weight"][:V].clone()}
    for i in range(hf_config.num_hidden_layers):
        src, dst = f"{_P}{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"].clone()
        q, k, v = split_qkv(sd[src + "self_attention.query_key_value.weight"], nh, ng)
        out[dst + "self_attn.q_proj.weight"], out[dst + "self_attn.k_proj.weight"] = q.clone(), k.clone()
        out[dst + "self_attn.v_proj.weight"] = v.clone()
        if src + "self_attention.query_key_value.bias" in sd:
            q, k, v = split_qkv(sd[src + "self_attention.query_key_value.bias"], nh, ng)
            out[dst + "self_attn.q_proj.bias"], out[dst + "self_attn.k_proj.bias"] = q.clone(), k.clone()
            out[dst + "self_attn.v_proj.bias"] = v.clone()
        out[dst + "self_attn.o_proj.weight"] = sd[src + "self_attention.dense.weight"].clone()
        if src + "self_attention.dense.bias" in sd:
            out[dst + "self_attn.o_proj.bias"] = sd[src + "self_attention.dense.bias"].clone()
        out[dst + "post_attention_layernorm.weight"] = sd[src + "post_attention_layernorm.weight"].clone()
        gate, up = torch.chunk(sd[src + "mlp.dense_h_to_4h.weight"], 2, dim=0)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate.clone(), up.clone()
        if src + "mlp.dense_h_to_4h.bias" in sd:
            gate, up = torch.chunk(sd[src + "mlp.dense_h_to_4h.bias"], 2, dim=0)
            out[dst + "mlp.gate_proj.bias"], out[dst + "mlp.up_proj.bias"] = gate.clone(), up.clone()
        out[dst + "mlp.down_proj.weight"] = sd[src + "mlp.dense_4h_to_h.weight"].clone()
        if src + "mlp.dense_4h_to_h.bias" in sd:
            out[dst + "mlp.down_proj.bias"] = sd[src + "mlp.dense_4h_to_h.bias"].clone()
    out["model.norm.weight"] = sd["language_model.encoder.final_layernorm.weight"].clone()
    if "language_model.output_layer.weight" in sd:
        out["lm_head.weight"] = sd["language_model.output_layer.weight"][:V].clone()
    else:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out

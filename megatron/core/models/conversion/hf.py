"""Conversion between our model state dicts and Hugging Face ``transformers`` checkpoints: GPT-2 and Llama (Llama 3.1 /
3.2's ``llama3`` RoPE scaling = ``--use-rope-scaling --rope-scaling-factor F``). The other families are in their own
modules (:mod:`.hf_moe`: Mixtral, Qwen2-MoE; :mod:`.hf_qwen`: Qwen2 / Qwen3 / Qwen3-MoE), all on the shared decoder
table of :mod:`.hf_layers` and dispatched by :mod:`.hf_registry`.

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

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.models.conversion.hf_layers import (  # noqa: F401  (fuse_qkv, split_qkv: re-exported)
    decoder_from_hf, decoder_to_hf, fuse_qkv, pad_vocab, split_qkv)
from megatron.core.models.conversion.keys import legacy_to_mcore, mcore_to_legacy
from megatron.core.transformer.rotary import LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.vocab_padding import vocab_size_with_padding

_P = "language_model.encoder.layers."
_EMB = "language_model.embedding."


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
        _EMB + "word_embeddings.weight": pad_vocab(sd["wte.weight"], padded_vocab_size),
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


def gpt2_config_to_hf(config: TransformerConfig) -> Optional[Tuple[str, dict]]:
    """``('gpt2', GPT2Config fields)`` of a GPT-2-shaped TransformerConfig (LayerNorm, learned positions, GeLU,
    biases, tied embeddings), else None."""
    if not (config.normalization == "LayerNorm" and config.position_embedding_type == "learned_absolute"
            and config.add_bias_linear and not config.untie_embeddings_and_output_weights
            and not config.gated_linear_unit and config.num_moe_experts is None and not config.qk_layernorm
            and (config.openai_gelu or config.activation_func is F.gelu)):
        return None
    return "gpt2", dict(n_positions=config.max_position_embeddings, n_embd=config.hidden_size,
                        n_layer=config.num_layers, n_head=config.num_attention_heads, n_inner=config.ffn_hidden_size,
                        layer_norm_epsilon=config.layernorm_epsilon, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        activation_function="gelu_new" if config.openai_gelu else "gelu")


# ---------------------------------------------------------------------------------------------- Llama

def rope_theta(hf_config) -> float:
    """RoPE's base: ``rope_theta`` (transformers 4) or ``rope_parameters['rope_theta']`` (transformers 5)."""
    theta = getattr(hf_config, "rope_theta", None)
    params = getattr(hf_config, "rope_parameters", None) or {}
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    return theta


def rope_scaling_of(hf_config) -> dict:
    """The Hugging Face config's ``rope_scaling`` / ``rope_parameters`` (transformers 5), ``{}`` when absent."""
    return dict(getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None) or {})


def rope_scaling_to_megatron(hf_config) -> dict:
    """TransformerConfig fields of the checkpoint's RoPE scaling: ``linear`` -> position interpolation
    (``--rotary-seq-len-interpolation-factor``); ``llama3`` (Llama 3.1 / 3.2) -> ``--use-rope-scaling
    --rope-scaling-factor F``, whose low / high frequency factors (1, 4) and original context (8192) are fixed in
    Megatron, so a checkpoint with others is refused."""
    scaling = rope_scaling_of(hf_config)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return {}
    if kind == "linear":
        return dict(rotary_seq_len_interpolation_factor=scaling["factor"])
    if kind == "llama3":
        fixed = dict(low_freq_factor=LLAMA3_LOW_FREQ_FACTOR, high_freq_factor=LLAMA3_HIGH_FREQ_FACTOR,
                     original_max_position_embeddings=LLAMA3_ORIGINAL_CONTEXT)
        other = {k: scaling.get(k) for k, v in fixed.items() if float(scaling.get(k, v)) != float(v)}
        if other:
            raise ValueError(f"llama3 RoPE scaling with {other}: Megatron's --use-rope-scaling fixes "
                             f"{fixed} and only takes --rope-scaling-factor")
        return dict(use_rope_scaling=True, rope_scaling_factor=float(scaling["factor"]))
    raise ValueError(f"RoPE scaling {kind!r} is not supported for this model (linear, llama3)")


def rope_scaling_to_hf(config) -> dict:
    """Inverse of :func:`rope_scaling_to_megatron`: the ``rope_parameters`` entries of a TransformerConfig's RoPE."""
    if config.use_rope_scaling:
        return dict(rope_type="llama3", factor=config.rope_scaling_factor, low_freq_factor=LLAMA3_LOW_FREQ_FACTOR,
                    high_freq_factor=LLAMA3_HIGH_FREQ_FACTOR,
                    original_max_position_embeddings=LLAMA3_ORIGINAL_CONTEXT)
    if config.rotary_seq_len_interpolation_factor not in (None, 1):
        return dict(rope_type="linear", factor=float(config.rotary_seq_len_interpolation_factor))
    return dict(rope_type="default")


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
        rotary_base=rope_theta(hf_config), **rope_scaling_to_megatron(hf_config),
        untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", False))
    kwargs.update(config_kwargs)
    return TransformerConfig(**kwargs)


def llama_style_config_to_hf(config: TransformerConfig) -> Optional[dict]:
    """The Hugging Face config fields every Llama-style family shares (vocabulary excluded), or None when
    ``config`` is not a Llama-style decoder (RMSNorm, RoPE without interleaving or YaRN, a SwiGLU MLP)."""
    if not (config.normalization == "RMSNorm" and config.position_embedding_type == "rope" and
            config.gated_linear_unit and config.activation_func is F.silu and not config.rotary_interleaved
            and config.rotary_percent == 1.0 and not config.layernorm_zero_centered_gamma
            and not config.multi_latent_attention):
        return None
    return dict(hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
                num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_query_groups,
                head_dim=config.kv_channels, intermediate_size=config.ffn_hidden_size,
                max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.layernorm_epsilon,
                rope_parameters=dict(rope_theta=float(config.rotary_base), **rope_scaling_to_hf(config)),
                tie_word_embeddings=not config.untie_embeddings_and_output_weights)


def llama_config_to_hf(config: TransformerConfig) -> Optional[Tuple[str, dict]]:
    """``('llama', LlamaConfig fields)`` of a Llama-shaped TransformerConfig (no biases, q/k norms or experts; Llama
    3.x RoPE scaling included), else None."""
    common = llama_style_config_to_hf(config)
    if common is None or config.add_bias_linear or config.add_qkv_bias or config.qk_layernorm \
            or config.num_moe_experts is not None:
        return None
    return "llama", common


def llama_hf_to_megatron(hf_state_dict: Dict[str, torch.Tensor], hf_config, padded_vocab_size: int,
                         key_format: str = "legacy") -> Dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` state dict -> our GPTModel state dict (RMSNorm, swiglu, RoPE, GQA; q/k/v and MLP biases
    and q/k norms where the checkpoint has them), the tables of :mod:`.hf_layers`."""
    out = decoder_from_hf(hf_state_dict, hf_config, padded_vocab_size)
    return out if key_format == "mcore" else _finish(mcore_to_legacy(out, "gpt"), key_format)


def llama_megatron_to_hf(state_dict: Dict[str, torch.Tensor], hf_config, key_format: str = "legacy") -> Dict[str, torch.Tensor]:
    """Our GPTModel state dict (Llama configuration) -> ``LlamaForCausalLM`` state dict."""
    sd = state_dict if key_format == "mcore" else legacy_to_mcore(_to_legacy(state_dict, key_format), "gpt")
    return decoder_to_hf(sd, hf_config)

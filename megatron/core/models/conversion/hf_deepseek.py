"""Hugging Face DeepSeek-V2 (incl. V2-Lite, ``DeepseekV2ForCausalLM``) and DeepSeek-V3 (``DeepseekV3ForCausalLM``)
<-> megatron-core ``GPTModel`` (multi-latent attention) state dicts and configs.

=====================================================  ============================================================
Hugging Face (``model.layers.{i}.``)                    megatron-core (``decoder.layers.{i}.``)
=====================================================  ============================================================
``self_attn.q_proj`` (no query compression)             ``self_attention.linear_q_proj``
``self_attn.q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``  ``self_attention.linear_q_down_proj`` / ``q_layernorm`` /
                                                        ``linear_q_up_proj``
``self_attn.kv_a_proj_with_mqa`` / ``kv_a_layernorm``   ``self_attention.linear_kv_down_proj`` / ``kv_layernorm`` /
/ ``kv_b_proj``                                         ``linear_kv_up_proj``
``self_attn.o_proj``, ``input_layernorm``,              ``self_attention.linear_proj``, ``input_layernorm``,
``post_attention_layernorm``                            ``pre_mlp_layernorm``
dense layers (``i < first_k_dense_replace``):           ``mlp.linear_fc1 = [gate; up]``, ``mlp.linear_fc2``
``mlp.{gate,up,down}_proj``
``mlp.gate.weight [E, h]``, V3                          ``mlp.router.weight``, ``mlp.router.expert_bias``
``mlp.gate.e_score_correction_bias [E]``
``mlp.experts`` (fused ``gate_up_proj`` / per expert)   ``mlp.experts.*`` (SequentialMLP or GroupedMLP names)
``mlp.shared_experts.{gate,up,down}_proj``              ``mlp.shared_experts.linear_fc1 = [gate; up]``, ``linear_fc2``
V3 MTP depth k: ``model.layers.{L+k-1}.`` ``enorm``,    ``mtp.layers.{k-1}.enorm``, ``hnorm``, ``eh_proj``,
``hnorm``, ``eh_proj``, ``shared_head.norm``, and the   ``final_layernorm`` and ``transformer_layer.*`` as above;
decoder-layer names; ``embed_tokens``, ``shared_head.   the shared embedding / output layer (dropped on import,
head``                                                  written as copies on export)
=====================================================  ============================================================

Every tensor is a plain copy: Megatron's multi-latent attention rotates adjacent rotary pairs, as DeepSeek-V2's
complex RoPE and V3's ``rope_interleave=True`` do; a V3 checkpoint with ``rope_interleave=False`` has its rotary rows
(per query head, and the shared key's) reordered, Megatron row ``2i`` <- row ``i``, ``2i+1`` <- ``i + d_r/2``.

Configuration: ``qk_nope_head_dim`` -> ``--qk-head-dim``, ``qk_rope_head_dim`` -> ``--qk-pos-emb-head-dim``,
``v_head_dim``, ``q_lora_rank``, ``kv_lora_rank``, ``rms_norm_eps`` -> ``--norm-epsilon``, the latent norms on
(``--qk-layernorm``); ``rope_parameters`` yarn -> ``--rotary-scaling-factor`` / ``--mscale`` / ``--mscale-all-dim``
(+ original context and betas), default RoPE -> ``rope_type='rope'``; ``n_routed_experts``, ``num_experts_per_tok``,
``moe_intermediate_size``, ``n_shared_experts x moe_intermediate_size`` -> the shared-expert width,
``first_k_dense_replace`` -> ``--moe-layer-freq [0]*k+[1]*(L-k)``, ``routed_scaling_factor`` ->
``--moe-router-topk-scaling-factor``. V3 routing: sigmoid scores + expert bias, top-k renormalised, groups
``n_group`` / ``topk_group`` scored by their top-2 sum (= Megatron's top ``k // group_topk`` when that is 2). V2:
softmax over all experts, top-k kept as they are (``--moe-router-pre-softmax``); ``group_limited_greedy`` scores a
group by its best expert (= Megatron when ``k // topk_group`` is 1). Router in fp32 (``--moe-router-dtype fp32``)
as Hugging Face computes it. Refused with one line: attention or MLP biases, ``norm_topk_prob=False`` with sigmoid,
top-1 sigmoid routing, group scores Megatron cannot reproduce, RoPE scalings other than yarn, an explicit
``attention_factor``, ``truncate=False``.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.models.conversion.hf import rope_theta, rope_scaling_of
from megatron.core.models.conversion.hf_layers import (embeddings_from_hf, embeddings_to_hf, experts_from_hf,
                                                       experts_to_hf, gated_mlp_from_hf, gated_mlp_to_hf,
                                                       read_hf_experts)
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.vocab_padding import vocab_size_with_padding

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
StateDict = Dict[str, torch.Tensor]

# Hugging Face self_attn.<name> -> MLASelfAttention <name> (plain copies).
_ATTENTION = {"q_proj": "linear_q_proj", "q_a_proj": "linear_q_down_proj", "q_a_layernorm": "q_layernorm",
              "q_b_proj": "linear_q_up_proj", "kv_a_proj_with_mqa": "linear_kv_down_proj",
              "kv_a_layernorm": "kv_layernorm", "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj"}
_MTP = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head.norm": "final_layernorm"}


def _num_experts(hf_config) -> int:
    return getattr(hf_config, "n_routed_experts", None) or hf_config.num_local_experts


def _num_mtp(hf_config) -> int:
    if hf_config.model_type != "deepseek_v3":
        return 0
    return int(getattr(hf_config, "num_mtp_layers", None) or getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


def _rope_to_megatron(hf_config) -> dict:
    scaling = rope_scaling_of(hf_config)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return dict(rope_type="rope", rotary_scaling_factor=1.0)
    if kind != "yarn":
        raise ValueError(f"{hf_config.model_type} RoPE scaling {kind!r} is not supported (default or yarn)")
    if scaling.get("attention_factor") is not None:
        raise ValueError("yarn RoPE with an explicit attention_factor has no Megatron flag (it follows from --mscale "
                         "and --mscale-all-dim)")
    if scaling.get("truncate", True) is False:
        raise ValueError("yarn RoPE with truncate=False: Megatron's multi-latent attention always rounds the "
                         "correction range")
    original = scaling.get("original_max_position_embeddings") or hf_config.max_position_embeddings
    factor = scaling.get("factor") or hf_config.max_position_embeddings / original
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):  # transformers then uses g(factor, 1) as the concentration, no softmax factor
        mscale, mscale_all_dim = 1.0, 0.0
    return dict(rope_type="yarn", rotary_scaling_factor=float(factor), original_max_position_embeddings=int(original),
                mscale=float(mscale), mscale_all_dim=float(mscale_all_dim),
                beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1))


def _routing_to_megatron(hf_config) -> dict:
    k, experts = hf_config.num_experts_per_tok, _num_experts(hf_config)
    groups, group_topk = getattr(hf_config, "n_group", None), getattr(hf_config, "topk_group", None)
    kw = dict(num_moe_experts=experts, moe_router_topk=k, moe_ffn_hidden_size=hf_config.moe_intermediate_size,
              moe_router_dtype="fp32", moe_router_topk_scaling_factor=float(hf_config.routed_scaling_factor))
    if hf_config.n_shared_experts:
        kw["moe_shared_expert_intermediate_size"] = hf_config.n_shared_experts * hf_config.moe_intermediate_size
    if hf_config.model_type == "deepseek_v3":
        if not hf_config.norm_topk_prob or k == 1:
            raise ValueError("DeepSeek-V3 routing without top-k renormalisation (norm_topk_prob=False or one expert "
                             "per token) has no Megatron equivalent: sigmoid routing renormalises the k > 1 scores")
        kw.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
        if groups and groups > 1:
            if k // group_topk != 2:
                raise ValueError(f"DeepSeek-V3 scores a group by its top-2 experts; Megatron by its top "
                                 f"k // group_topk = {k // group_topk}: choose num_experts_per_tok / topk_group = 2")
            kw.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    else:
        kw.update(moe_router_score_function="softmax", moe_router_pre_softmax=True)
        if hf_config.topk_method == "group_limited_greedy" and groups and groups > 1:
            if k // group_topk != 1:
                raise ValueError(f"DeepSeek-V2's group_limited_greedy scores a group by its best expert; Megatron by "
                                 f"its top k // group_topk = {k // group_topk}: choose topk_group = "
                                 "num_experts_per_tok")
            kw.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
        elif hf_config.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 topk_method {hf_config.topk_method!r} is not supported (greedy, "
                             "group_limited_greedy)")
    return kw


def config_to_megatron(hf_config, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1,
                       **config_kwargs) -> MLATransformerConfig:
    """MLATransformerConfig computing what the DeepSeek-V2 / V3 model of ``hf_config`` computes (module docstring)."""
    if hf_config.model_type not in MODEL_TYPES:
        raise ValueError(f"not a DeepSeek model type: {hf_config.model_type!r}")
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise ValueError(f"{hf_config.model_type} with attention_bias / mlp_bias: Megatron's multi-latent attention "
                         "has no projection biases")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"only silu (swiglu) DeepSeek MLPs are supported, got {hf_config.hidden_act!r}")
    layers, dense = hf_config.num_hidden_layers, min(hf_config.first_k_dense_replace or 0, hf_config.num_hidden_layers)
    kwargs = dict(
        num_layers=layers, hidden_size=hf_config.hidden_size, num_attention_heads=hf_config.num_attention_heads,
        ffn_hidden_size=hf_config.intermediate_size, q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank, qk_head_dim=hf_config.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf_config.qk_rope_head_dim, v_head_dim=hf_config.v_head_dim, qk_layernorm=True,
        layernorm_epsilon=hf_config.rms_norm_eps, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False, hidden_dropout=0.0,
        attention_dropout=getattr(hf_config, "attention_dropout", 0.0) or 0.0,
        tensor_model_parallel_size=tensor_model_parallel_size, init_method_std=hf_config.initializer_range,
        padded_vocab_size=vocab_size_with_padding(hf_config.vocab_size, make_vocab_size_divisible_by,
                                                  tensor_model_parallel_size, log=False),
        max_position_embeddings=hf_config.max_position_embeddings, position_embedding_type="rope",
        rotary_base=rope_theta(hf_config), untie_embeddings_and_output_weights=not getattr(
            hf_config, "tie_word_embeddings", False),
        moe_layer_freq=1 if dense == 0 else [0] * dense + [1] * (layers - dense))
    if dense < layers:
        kwargs.update(_routing_to_megatron(hf_config))
    kwargs.update(_rope_to_megatron(hf_config))
    if _num_mtp(hf_config):
        kwargs.update(mtp_num_layers=_num_mtp(hf_config))
    kwargs.update(config_kwargs)
    return MLATransformerConfig(**kwargs)


def config_kwargs_from_weights(hf_config, keys) -> dict:
    """A V3 config announcing MTP layers whose weights the checkpoint lacks (e.g. saved by transformers, which does
    not hold them) converts without MTP."""
    depths = _num_mtp(hf_config)
    if depths and f"model.layers.{hf_config.num_hidden_layers}.eh_proj.weight" not in keys:
        return dict(mtp_num_layers=None)
    return {}


def _rope_rows(w: torch.Tensor, heads: int, d_n: int, d_r: int, to_megatron: bool) -> torch.Tensor:
    """Reorder the rotary rows of each head (``d_n`` plain rows then ``d_r`` rotary ones; ``heads=1, d_n=r_kv`` for
    ``kv_a_proj_with_mqa``) between rotate-half and adjacent pairs."""
    w = w.reshape(heads, d_n + d_r, *w.shape[1:])
    rot = w[:, d_n:]
    half = d_r // 2
    if to_megatron:  # row 2i <- i, row 2i+1 <- i + d_r/2
        rot = torch.stack([rot[:, :half], rot[:, half:]], dim=2).reshape(rot.shape)
    else:
        rot = torch.cat([rot[:, 0::2], rot[:, 1::2]], dim=1)
    return torch.cat([w[:, :d_n], rot], dim=1).reshape(-1, *w.shape[2:])


def _attention(sd: StateDict, src: str, dst: str, hf_config, out: StateDict, to_megatron: bool) -> None:
    """One layer's attention and its input norm, either way (``src`` / ``dst`` are the two sides' layer prefixes)."""
    names = _ATTENTION if to_megatron else {v: k for k, v in _ATTENTION.items()}
    a, b = ("self_attn.", "self_attention.") if to_megatron else ("self_attention.", "self_attn.")
    for name, other in names.items():
        if f"{src}{a}{name}.weight" in sd:
            out[f"{dst}{b}{other}.weight"] = sd[f"{src}{a}{name}.weight"].clone()
    out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"].clone()
    if getattr(hf_config, "rope_interleave", True):
        return
    heads, d_n, d_r = hf_config.num_attention_heads, hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim
    q = "q_proj" if hf_config.q_lora_rank is None else "q_b_proj"
    q_name = f"{dst}{b}{q if not to_megatron else _ATTENTION[q]}.weight"
    kv_name = f"{dst}{b}{'kv_a_proj_with_mqa' if not to_megatron else 'linear_kv_down_proj'}.weight"
    out[q_name] = _rope_rows(out[q_name], heads, d_n, d_r, to_megatron)
    out[kv_name] = _rope_rows(out[kv_name], 1, hf_config.kv_lora_rank, d_r, to_megatron)


def _layer_from_hf(sd: StateDict, src: str, dst: str, hf_config, moe: bool, out: StateDict,
                   grouped_gemm: bool) -> None:
    _attention(sd, src, dst, hf_config, out, True)
    out[dst + "pre_mlp_layernorm.weight"] = sd[src + "post_attention_layernorm.weight"].clone()
    if not moe:
        gated_mlp_from_hf(sd, src + "mlp.", dst + "mlp.", out)
        return
    out[dst + "mlp.router.weight"] = sd[src + "mlp.gate.weight"].clone()
    if src + "mlp.gate.e_score_correction_bias" in sd:
        out[dst + "mlp.router.expert_bias"] = sd[src + "mlp.gate.e_score_correction_bias"].float().clone()
    fc1, fc2 = read_hf_experts(sd, src + "mlp.", _num_experts(hf_config))
    experts_from_hf(fc1, fc2, dst + "mlp.", out, grouped=grouped_gemm)
    if hf_config.n_shared_experts:
        gated_mlp_from_hf(sd, src + "mlp.shared_experts.", dst + "mlp.shared_experts.", out)


def _layer_to_hf(sd: StateDict, src: str, dst: str, hf_config, moe: bool, out: StateDict) -> None:
    _attention(sd, src, dst, hf_config, out, False)
    out[dst + "post_attention_layernorm.weight"] = sd[src + "pre_mlp_layernorm.weight"].clone()
    if not moe:
        gated_mlp_to_hf(sd, src + "mlp.", dst + "mlp.", out)
        return
    out[dst + "mlp.gate.weight"] = sd[src + "mlp.router.weight"].clone()
    if hf_config.model_type == "deepseek_v3":
        bias = sd.get(src + "mlp.router.expert_bias")
        out[dst + "mlp.gate.e_score_correction_bias"] = (bias.float().clone() if bias is not None else
                                                         torch.zeros(_num_experts(hf_config)))
    fc1, fc2, _, _ = experts_to_hf(sd, src + "mlp.", _num_experts(hf_config))
    out[dst + "mlp.experts.gate_up_proj"], out[dst + "mlp.experts.down_proj"] = fc1, fc2
    if hf_config.n_shared_experts:
        gated_mlp_to_hf(sd, src + "mlp.shared_experts.", dst + "mlp.shared_experts.", out)


def _is_moe(hf_config, layer: int) -> bool:
    return layer >= (hf_config.first_k_dense_replace or 0)


def to_megatron(hf_state_dict: StateDict, hf_config, padded_vocab_size: int, grouped_gemm: bool = False) -> StateDict:
    """DeepSeek-V2 / V3 state dict -> megatron-core GPTModel state dict (MTP depths when the checkpoint has them)."""
    sd, out = hf_state_dict, {}
    embeddings_from_hf(sd, hf_config, padded_vocab_size, out)
    layers = hf_config.num_hidden_layers
    for i in range(layers):
        _layer_from_hf(sd, f"model.layers.{i}.", f"decoder.layers.{i}.", hf_config, _is_moe(hf_config, i), out,
                       grouped_gemm)
    depths = _num_mtp(hf_config) if config_kwargs_from_weights(hf_config, sd.keys()) == {} else 0
    for k in range(depths):
        src, dst = f"model.layers.{layers + k}.", f"mtp.layers.{k}."
        for name, ours in _MTP.items():
            out[f"{dst}{ours}.weight"] = sd[f"{src}{name}.weight"].clone()
        # The depth's inner layer copies the decoder's last layer.
        _layer_from_hf(sd, src, dst + "transformer_layer.", hf_config, _is_moe(hf_config, layers - 1), out,
                       grouped_gemm)
    return out


def to_hf(state_dict: StateDict, hf_config) -> StateDict:
    """megatron-core GPTModel state dict -> DeepSeek-V2 / V3 state dict (transformers 5 names; the MTP depths as the
    Hub stores them, with copies of the embedding and the output layer)."""
    sd, out = state_dict, {}
    layers = hf_config.num_hidden_layers
    for i in range(layers):
        _layer_to_hf(sd, f"decoder.layers.{i}.", f"model.layers.{i}.", hf_config, _is_moe(hf_config, i), out)
    embeddings_to_hf(sd, hf_config, out)
    k = 0
    while f"mtp.layers.{k}.eh_proj.weight" in sd:
        src, dst = f"mtp.layers.{k}.", f"model.layers.{layers + k}."
        for name, ours in _MTP.items():
            out[f"{dst}{name}.weight"] = sd[f"{src}{ours}.weight"].clone()
        _layer_to_hf(sd, src + "transformer_layer.", dst, hf_config, _is_moe(hf_config, layers - 1), out)
        out[dst + "embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        out[dst + "shared_head.head.weight"] = out["lm_head.weight"].clone()
        k += 1
    return out


def _rope_to_hf(config) -> dict:
    params = dict(rope_theta=float(config.rotary_base))
    if config.rope_type == "rope":
        return dict(params, rope_type="default")
    return dict(params, rope_type="yarn", factor=config.rotary_scaling_factor,
                original_max_position_embeddings=config.original_max_position_embeddings, beta_fast=config.beta_fast,
                beta_slow=config.beta_slow, mscale=config.mscale, mscale_all_dim=config.mscale_all_dim)


def config_to_hf(config) -> Optional[Tuple[str, dict]]:
    """``('deepseek_v3' | 'deepseek_v2', HF config fields)`` of a DeepSeek-shaped TransformerConfig (multi-latent
    attention with latent norms, SwiGLU, RMSNorm; sigmoid routing with expert bias for V3, pre-softmax for V2), else
    None."""
    if not (getattr(config, "multi_latent_attention", False) and config.qk_layernorm and config.gated_linear_unit
            and config.activation_func is F.silu and config.normalization == "RMSNorm" and not config.add_bias_linear):
        return None
    if config.rope_type == "yarn" and not (config.mscale and config.mscale_all_dim) and config.mscale != 1.0:
        return None  # transformers would take g(factor, 1) as the concentration
    freq = config.moe_layer_freq
    if config.num_moe_experts is None:
        dense = config.num_layers
    elif freq == 1:
        dense = 0
    elif isinstance(freq, list) and freq == [0] * freq.count(0) + [1] * (len(freq) - freq.count(0)):
        dense = freq.count(0)
    else:
        return None  # Hugging Face's DeepSeek models have their dense layers first
    fields = dict(hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
                  num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_attention_heads,
                  intermediate_size=config.ffn_hidden_size, q_lora_rank=config.q_lora_rank,
                  kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_head_dim,
                  qk_rope_head_dim=config.qk_pos_emb_head_dim, v_head_dim=config.v_head_dim,
                  max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.layernorm_epsilon,
                  rope_parameters=_rope_to_hf(config), first_k_dense_replace=dense,
                  tie_word_embeddings=not config.untie_embeddings_and_output_weights, attention_bias=False)
    sigmoid = config.num_moe_experts is not None and config.moe_router_score_function == "sigmoid"
    if config.num_moe_experts is not None:
        shared = config.moe_shared_expert_intermediate_size or 0
        if shared % config.moe_ffn_hidden_size or config.moe_shared_expert_gate:
            return None
        fields.update(n_routed_experts=config.num_moe_experts, num_experts_per_tok=config.moe_router_topk,
                      moe_intermediate_size=config.moe_ffn_hidden_size,
                      n_shared_experts=shared // config.moe_ffn_hidden_size,
                      routed_scaling_factor=config.moe_router_topk_scaling_factor or 1.0,
                      n_group=config.moe_router_num_groups or 1, topk_group=config.moe_router_group_topk or 1)
    if sigmoid:
        if not config.moe_router_enable_expert_bias or config.moe_router_topk == 1 or (
                config.moe_router_num_groups and config.moe_router_topk // config.moe_router_group_topk != 2):
            return None
        return "deepseek_v3", dict(fields, norm_topk_prob=True, num_mtp_layers=config.mtp_num_layers or 0)
    if config.mtp_num_layers or (config.num_moe_experts is not None and not config.moe_router_pre_softmax):
        return None
    if config.moe_router_num_groups:
        fields.update(topk_method="group_limited_greedy")
        if config.moe_router_topk // config.moe_router_group_topk != 1:
            return None
    elif config.num_moe_experts is not None:
        fields.update(topk_method="greedy", n_group=None, topk_group=None)  # (V3's router always groups: 1 there)
    return "deepseek_v2", fields


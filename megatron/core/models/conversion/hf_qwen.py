"""Hugging Face Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``), Qwen3 (``Qwen3ForCausalLM``) and Qwen3-MoE
(``Qwen3MoeForCausalLM``) <-> megatron-core ``GPTModel`` state dicts and configs.

The tensors map as every Llama-style decoder's (:mod:`.hf_layers`); what the family adds:

* Qwen2 / Qwen2.5: biases on q, k and v only = ``--add-qkv-bias --disable-bias-linear``
  (``self_attention.linear_qkv.bias``, group-major like the weight);
* Qwen3: a per-head RMSNorm of the queries and of the keys before RoPE (``self_attn.q_norm`` / ``k_norm``
  ``[head_dim]``) = ``--qk-layernorm`` (``self_attention.q_layernorm`` / ``k_layernorm``); ``head_dim`` need not be
  ``hidden / heads`` (``--kv-channels``);
* Qwen3-MoE: every MLP a mixture of experts (``mlp.gate`` -> ``mlp.router``; ``mlp.experts.gate_up_proj [E, 2F, h]``
  / ``down_proj [E, h, F]``), no shared expert. Routing: softmax over all E, top-k, renormalised over the k when
  ``norm_topk_prob`` (Qwen3-30B-A3B / 235B-A22B; = Megatron's default, the softmax of the top-k logits) or kept as
  they are (= ``--moe-router-pre-softmax``).

Refused with one line: sliding-window attention (``use_sliding_window``), Qwen3 ``attention_bias`` (Megatron has no
attention-only bias besides q/k/v), Qwen3-MoE dense layers (``mlp_only_layers`` / ``decoder_sparse_step > 1``).
"""
from __future__ import annotations

import functools
from typing import Dict, Optional

import torch

from megatron.core.models.conversion.hf import llama_config_to_megatron, llama_style_config_to_hf
from megatron.core.models.conversion.hf_layers import (decoder_from_hf, decoder_to_hf, experts_from_hf,
                                                       experts_to_hf, read_hf_experts)
from megatron.core.transformer.transformer_config import TransformerConfig

MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe")


def _check(hf_config) -> None:
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(f"{hf_config.model_type} with use_sliding_window is not supported (Megatron's GPT attends "
                         "to the whole causal context of every layer)")
    if hf_config.model_type != "qwen2" and getattr(hf_config, "attention_bias", False):
        raise ValueError(f"{hf_config.model_type} with attention_bias (q/k/v/o biases, no MLP bias) has no Megatron "
                         "equivalent")
    if hf_config.model_type == "qwen3_moe" and (getattr(hf_config, "mlp_only_layers", None)
                                                or getattr(hf_config, "decoder_sparse_step", 1) != 1):
        raise ValueError("Qwen3-MoE configurations with dense layers (mlp_only_layers / decoder_sparse_step > 1) are "
                         "not supported: every layer must be a MoE layer")


def num_experts(hf_config) -> int:
    return getattr(hf_config, "num_local_experts", None) or hf_config.num_experts


def config_to_megatron(hf_config, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1,
                       **config_kwargs) -> TransformerConfig:
    """TransformerConfig computing what the Qwen model of ``hf_config`` computes."""
    _check(hf_config)
    kind = hf_config.model_type
    kwargs = dict(add_bias_linear=False, add_qkv_bias=kind == "qwen2", qk_layernorm=kind != "qwen2")
    if kind == "qwen3_moe":
        kwargs.update(num_moe_experts=num_experts(hf_config), moe_router_topk=hf_config.num_experts_per_tok,
                      moe_ffn_hidden_size=hf_config.moe_intermediate_size,
                      moe_router_pre_softmax=not hf_config.norm_topk_prob)
    kwargs.update(config_kwargs)
    return llama_config_to_megatron(hf_config, make_vocab_size_divisible_by, tensor_model_parallel_size, **kwargs)


def _moe_from_hf(sd, layer, src, dst, out, grouped_gemm=False):
    out[dst + "mlp.router.weight"] = sd[src + "mlp.gate.weight"].clone()
    fc1, fc2 = read_hf_experts(sd, src + "mlp.", out[dst + "mlp.router.weight"].shape[0])
    experts_from_hf(fc1, fc2, dst + "mlp.", out, grouped=grouped_gemm)


def _moe_to_hf(sd, layer, src, dst, out):
    out[dst + "mlp.gate.weight"] = sd[src + "mlp.router.weight"].clone()
    fc1, fc2, _, _ = experts_to_hf(sd, src + "mlp.", out[dst + "mlp.gate.weight"].shape[0])
    out[dst + "mlp.experts.gate_up_proj"], out[dst + "mlp.experts.down_proj"] = fc1, fc2


def to_megatron(hf_state_dict: Dict[str, torch.Tensor], hf_config, padded_vocab_size: int,
                grouped_gemm: bool = False) -> Dict[str, torch.Tensor]:
    """Qwen2 / Qwen3 / Qwen3-MoE state dict -> megatron-core GPTModel state dict."""
    _check(hf_config)
    if hf_config.model_type != "qwen3_moe":
        return decoder_from_hf(hf_state_dict, hf_config, padded_vocab_size)
    return decoder_from_hf(hf_state_dict, hf_config, padded_vocab_size, functools.partial(_moe_from_hf,
                                                                                          grouped_gemm=grouped_gemm))


def to_hf(state_dict: Dict[str, torch.Tensor], hf_config) -> Dict[str, torch.Tensor]:
    """megatron-core GPTModel state dict -> Qwen2 / Qwen3 / Qwen3-MoE state dict (transformers 5 names)."""
    if hf_config.model_type != "qwen3_moe":
        return decoder_to_hf(state_dict, hf_config)
    return decoder_to_hf(state_dict, hf_config, _moe_to_hf)


def config_to_hf(config: TransformerConfig) -> Optional[dict]:
    """``(model_type, HF config kwargs)`` of a Qwen-shaped TransformerConfig, or None: Qwen2 = q/k/v biases only,
    Qwen3 = q/k norms (dense), Qwen3-MoE = q/k norms, all-MoE layers without a shared expert."""
    common = llama_style_config_to_hf(config)
    if common is None or config.add_bias_linear or config.use_rope_scaling:
        return None
    moe = config.num_moe_experts is not None
    if moe and (config.moe_shared_expert_intermediate_size or config.moe_layer_freq != 1
                or config.moe_router_score_function != "softmax" or config.moe_router_topk_scaling_factor):
        return None
    if config.add_qkv_bias and not config.qk_layernorm and not moe:
        if config.kv_channels * config.num_attention_heads != config.hidden_size:
            return None  # Qwen2's head size is hidden / heads
        return "qwen2", common
    if config.qk_layernorm and not config.add_qkv_bias:
        if not moe:
            return "qwen3", common
        return "qwen3_moe", dict(common, num_local_experts=config.num_moe_experts,
                                 num_experts_per_tok=config.moe_router_topk,
                                 moe_intermediate_size=config.moe_ffn_hidden_size,
                                 norm_topk_prob=not config.moe_router_pre_softmax)
    return None

"""Hugging Face mixture-of-experts models (Mixtral, Qwen2-MoE) <-> megatron-core ``GPTModel`` state dicts.

Attention, norms, embeddings and the output layer map as Llama's (:mod:`.hf`); every MLP is a MoE layer
(expert parallel size 1 on our side: SequentialMLP names, or GroupedMLP's with ``grouped_gemm``):

=====================================================  ===========================================================
Hugging Face (transformers 5; the Hub's per-expert      megatron-core ``decoder.layers.{i}.``
names are read too)
=====================================================  ===========================================================
``mlp.gate.weight [E, h]``                              ``mlp.router.weight``
(Mixtral on the Hub: ``block_sparse_moe.gate.weight``)
``mlp.experts.gate_up_proj [E, 2F, h]``: expert e's     ``mlp.experts.local_experts.{e}.linear_fc1.weight [2F, h]``
``[gate; up]`` (Hub: ``w1``/``w3``, ``gate_proj``/      (GroupedMLP: ``mlp.experts.weight1 [h, E*2F]``, columns
``up_proj``)                                            ``e*2F .. (e+1)*2F`` = that matrix transposed)
``mlp.experts.down_proj [E, h, F]`` (Hub: ``w2``,       ``...local_experts.{e}.linear_fc2.weight [h, F]``
``down_proj``)                                          (GroupedMLP: ``mlp.experts.weight2 [E*F, h]``)
Qwen2-MoE ``mlp.shared_expert.{gate,up}_proj``          ``mlp.shared_experts.linear_fc1.weight = [gate; up]``
Qwen2-MoE ``mlp.shared_expert.down_proj``               ``mlp.shared_experts.linear_fc2.weight``
Qwen2-MoE ``mlp.shared_expert_gate.weight [1, h]``      ``mlp.shared_experts.gate_weight`` (output scaled by
                                                        ``sigmoid(x . g)``: ``--moe-shared-expert-gate``)
=====================================================  ===========================================================

Routing: Hugging Face takes the softmax over all E experts, then the top k. Renormalised over the k (Mixtral;
Qwen2-MoE with ``norm_topk_prob``) that equals Megatron's default, the softmax over the top-k logits; kept as they
are (Qwen2-MoE's default) it is ``--moe-router-pre-softmax``. Qwen2-MoE's q/k/v biases are ``--add-qkv-bias`` with
no other linear bias. Qwen2-MoE configurations with dense layers (``mlp_only_layers``, ``decoder_sparse_step > 1``)
or sliding-window attention are refused.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megatron.core.models.conversion.hf import (llama_config_to_megatron, llama_hf_to_megatron, llama_megatron_to_hf,
                                                llama_style_config_to_hf)
from megatron.core.models.conversion.hf_layers import read_hf_experts
from megatron.core.transformer.transformer_config import TransformerConfig

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe")


def _shape(hf_config) -> Tuple[int, int, int]:
    """(experts, expert FFN width, top-k) of a Mixtral or Qwen2-MoE config."""
    if hf_config.model_type == "mixtral":
        return hf_config.num_local_experts, hf_config.intermediate_size, hf_config.num_experts_per_tok
    if hf_config.model_type == "qwen2_moe":
        return hf_config.num_experts, hf_config.moe_intermediate_size, hf_config.num_experts_per_tok
    raise ValueError(f"not a mixture-of-experts model type this converter knows: {hf_config.model_type!r} "
                     f"(supported: {', '.join(MOE_MODEL_TYPES)})")


def _shared_width(hf_config) -> int:
    return (getattr(hf_config, "shared_expert_intermediate_size", 0) or 0) if hf_config.model_type == "qwen2_moe" else 0


def _check_qwen2_moe(hf_config) -> None:
    if getattr(hf_config, "mlp_only_layers", None) or getattr(hf_config, "decoder_sparse_step", 1) != 1:
        raise ValueError("Qwen2-MoE configurations with dense layers (mlp_only_layers / decoder_sparse_step > 1) are "
                         "not supported: every layer must be a MoE layer")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("Qwen2-MoE with use_sliding_window is not supported (Megatron's GPT attends to the whole "
                         "causal context)")


def moe_config_to_megatron(hf_config, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1,
                           **config_kwargs) -> TransformerConfig:
    """TransformerConfig computing what ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` computes (dropless)."""
    experts, width, topk = _shape(hf_config)
    kwargs = dict(num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=width)
    if hf_config.model_type == "qwen2_moe":
        _check_qwen2_moe(hf_config)
        kwargs.update(moe_router_pre_softmax=not hf_config.norm_topk_prob, add_qkv_bias=bool(hf_config.qkv_bias))
        if _shared_width(hf_config):
            kwargs.update(moe_shared_expert_intermediate_size=_shared_width(hf_config), moe_shared_expert_gate=True)
    kwargs.update(config_kwargs)
    return llama_config_to_megatron(hf_config, make_vocab_size_divisible_by, tensor_model_parallel_size, **kwargs)


def _hf_experts(sd, prefix: str, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(fc1 [E, 2F, h], fc2 [E, h, F]) of layer ``prefix``: fused, or the Hub's per-expert matrices (Mixtral
    ``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen2-MoE ``mlp.experts.{e}.gate_proj/up_proj/down_proj``)."""
    if prefix + "block_sparse_moe.experts.0.w1.weight" in sd:
        return read_hf_experts(sd, prefix + "block_sparse_moe.", num_experts, "w1", "w3", "w2")
    return read_hf_experts(sd, prefix + "mlp.", num_experts)


def _without_mlps(state_dict, num_layers: int, layer_prefix: str, mlp_keys: Dict[str, Tuple[int, int]]):
    """``state_dict`` without its MoE MLP tensors, with dense placeholders of the given shapes so that the Llama
    mapping (which expects a dense MLP) handles attention, norms and embeddings."""
    out = {k: v for k, v in state_dict.items() if ".mlp." not in k and ".block_sparse_moe." not in k}
    for i in range(num_layers):
        for name, shape in mlp_keys.items():
            out[f"{layer_prefix}{i}.{name}"] = torch.zeros(shape)
    return out


def moe_hf_to_megatron(hf_state_dict: Dict[str, torch.Tensor], hf_config, padded_vocab_size: int,
                       grouped_gemm: bool = False) -> Dict[str, torch.Tensor]:
    """``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` state dict -> megatron-core GPTModel state dict."""
    E, F_, _ = _shape(hf_config)
    L, h = hf_config.num_hidden_layers, hf_config.hidden_size
    dense = _without_mlps(hf_state_dict, L, "model.layers.", {"mlp.gate_proj.weight": (F_, h),
                                                               "mlp.up_proj.weight": (F_, h),
                                                               "mlp.down_proj.weight": (h, F_)})
    out = llama_hf_to_megatron(dense, hf_config, padded_vocab_size, key_format="mcore")
    for i in range(L):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}.mlp."
        for key in [k for k in out if k.startswith(dst)]:
            del out[key]
        gate = hf_state_dict.get(src + "mlp.gate.weight", hf_state_dict.get(src + "block_sparse_moe.gate.weight"))
        out[dst + "router.weight"] = gate.clone()
        fc1, fc2 = _hf_experts(hf_state_dict, src, E)
        if grouped_gemm:
            out[dst + "experts.weight1"] = torch.cat([fc1[e].t() for e in range(E)], dim=1).contiguous()
            out[dst + "experts.weight2"] = torch.cat([fc2[e].t() for e in range(E)], dim=0).contiguous()
        else:
            for e in range(E):
                out[f"{dst}experts.local_experts.{e}.linear_fc1.weight"] = fc1[e].clone()
                out[f"{dst}experts.local_experts.{e}.linear_fc2.weight"] = fc2[e].clone()
        if _shared_width(hf_config):
            shared = src + "mlp.shared_expert."
            out[dst + "shared_experts.linear_fc1.weight"] = torch.cat(
                [hf_state_dict[shared + "gate_proj.weight"], hf_state_dict[shared + "up_proj.weight"]], 0)
            out[dst + "shared_experts.linear_fc2.weight"] = hf_state_dict[shared + "down_proj.weight"].clone()
            out[dst + "shared_experts.gate_weight"] = hf_state_dict[src + "mlp.shared_expert_gate.weight"].clone()
    return out


def moe_megatron_to_hf(state_dict: Dict[str, torch.Tensor], hf_config) -> Dict[str, torch.Tensor]:
    """megatron-core GPTModel state dict (SequentialMLP or GroupedMLP experts) -> transformers 5 names (fused
    ``mlp.experts.gate_up_proj`` / ``down_proj``), vocabulary trimmed to ``hf_config.vocab_size``."""
    E, F_, _ = _shape(hf_config)
    L, h = hf_config.num_hidden_layers, hf_config.hidden_size
    dense = _without_mlps(state_dict, L, "decoder.layers.", {"mlp.linear_fc1.weight": (2 * F_, h),
                                                              "mlp.linear_fc2.weight": (h, F_)})
    out = llama_megatron_to_hf(dense, hf_config, key_format="mcore")
    for i in range(L):
        for name in ("gate_proj", "up_proj", "down_proj"):
            del out[f"model.layers.{i}.mlp.{name}.weight"]
        src, dst = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
        out[dst + "gate.weight"] = state_dict[src + "router.weight"].clone()
        if src + "experts.weight1" in state_dict:
            w1, w2 = state_dict[src + "experts.weight1"], state_dict[src + "experts.weight2"]
            fc1 = torch.stack([c.t() for c in torch.chunk(w1, E, dim=1)])
            fc2 = torch.stack([c.t() for c in torch.chunk(w2, E, dim=0)])
        else:
            fc1 = torch.stack([state_dict[f"{src}experts.local_experts.{e}.linear_fc1.weight"] for e in range(E)])
            fc2 = torch.stack([state_dict[f"{src}experts.local_experts.{e}.linear_fc2.weight"] for e in range(E)])
        out[dst + "experts.gate_up_proj"], out[dst + "experts.down_proj"] = fc1.contiguous(), fc2.contiguous()
        if _shared_width(hf_config):
            gate, up = torch.chunk(state_dict[src + "shared_experts.linear_fc1.weight"], 2, dim=0)
            out[dst + "shared_expert.gate_proj.weight"], out[dst + "shared_expert.up_proj.weight"] = \
                gate.clone(), up.clone()
            out[dst + "shared_expert.down_proj.weight"] = state_dict[src + "shared_experts.linear_fc2.weight"].clone()
            out[dst + "shared_expert_gate.weight"] = state_dict[src + "shared_experts.gate_weight"].clone()
    return out


def config_to_hf(config: TransformerConfig) -> Optional[Tuple[str, dict]]:
    """``(model_type, config fields)`` of a Mixtral- or Qwen2-MoE-shaped TransformerConfig (every layer MoE with
    softmax routing, no q/k norms), else None: a gated shared expert, q/k/v biases or pre-softmax routing make it
    Qwen2-MoE (which needs the gated shared expert), otherwise Mixtral."""
    common = llama_style_config_to_hf(config)
    if (common is None or config.num_moe_experts is None or config.add_bias_linear or config.qk_layernorm
            or config.moe_layer_freq != 1 or config.moe_router_score_function != "softmax"
            or config.moe_router_topk_scaling_factor or config.use_rope_scaling):
        return None
    shared = config.moe_shared_expert_intermediate_size
    if shared or config.add_qkv_bias or config.moe_router_pre_softmax:
        if not (shared and config.moe_shared_expert_gate):
            return None  # Qwen2-MoE's shared expert is gated
        return "qwen2_moe", dict(common, intermediate_size=config.ffn_hidden_size,
                                 moe_intermediate_size=config.moe_ffn_hidden_size, shared_expert_intermediate_size=shared,
                                 num_experts=config.num_moe_experts, num_experts_per_tok=config.moe_router_topk,
                                 norm_topk_prob=not config.moe_router_pre_softmax, qkv_bias=config.add_qkv_bias)
    return "mixtral", dict(common, intermediate_size=config.moe_ffn_hidden_size, num_local_experts=config.num_moe_experts,
                           num_experts_per_tok=config.moe_router_topk)

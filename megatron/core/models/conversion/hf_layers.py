"""The pieces every Llama-style Hugging Face decoder shares, mapped to megatron-core ``GPTModel`` names: the one
table the Llama, Qwen, gpt-oss, Llama 4 and mixture-of-experts bridges build on.

=======================================================  =========================================================
Hugging Face (``model.layers.{i}.``)                      megatron-core ``GPTModel`` (``decoder.layers.{i}.``)
=======================================================  =========================================================
``input_layernorm.weight``                                ``input_layernorm.weight``
``self_attn.{q,k,v}_proj.{weight,bias}``                  ``self_attention.linear_qkv.{weight,bias}``: per query
                                                          group g its query heads, then ``k_g``, then ``v_g``
``self_attn.o_proj.{weight,bias}``                        ``self_attention.linear_proj.{weight,bias}``
``self_attn.{q,k}_norm.weight`` (Qwen3)                   ``self_attention.{q,k}_layernorm.weight``
``post_attention_layernorm.weight``                       ``pre_mlp_layernorm.weight``
``mlp.{gate,up}_proj``, ``mlp.down_proj``                 ``mlp.linear_fc1 = [gate; up]``, ``mlp.linear_fc2``
experts ``[E, 2F, h]`` (``[gate; up]`` rows) and          ``mlp.experts.local_experts.{e}.linear_fc1 [2F, h]`` and
``[E, h, F]``                                             ``...linear_fc2 [h, F]`` (GroupedMLP: ``weight1 [h, E*2F]``
                                                          with expert e's fc1 transposed in its columns, ``weight2
                                                          [E*F, h]``)
``model.embed_tokens``, ``model.norm``, ``lm_head``       ``embedding.word_embeddings`` (zero rows up to the padded
                                                          vocabulary), ``decoder.final_layernorm``, ``output_layer``
                                                          (absent when tied)
=======================================================  =========================================================
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

StateDict = Dict[str, torch.Tensor]


def pad_vocab(weight: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """``weight`` with zero rows appended up to ``padded_vocab_size``."""
    if weight.shape[0] > padded_vocab_size:
        raise ValueError(f"vocabulary of {weight.shape[0]} rows does not fit padded_vocab_size={padded_vocab_size}")
    if weight.shape[0] == padded_vocab_size:
        return weight.clone()
    pad = torch.zeros(padded_vocab_size - weight.shape[0], *weight.shape[1:], dtype=weight.dtype)
    return torch.cat([weight, pad], dim=0)


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


def heads(hf_config) -> Tuple[int, int]:
    """(attention heads, key/value heads) of a Hugging Face config."""
    nh = hf_config.num_attention_heads
    return nh, getattr(hf_config, "num_key_value_heads", None) or nh


# --------------------------------------------------------------------------------------------- attention

def attention_from_hf(sd: StateDict, src: str, dst: str, hf_config, out: StateDict) -> None:
    """Layer ``src`` (``model.layers.{i}.``)'s input norm and attention -> ``dst`` (``decoder.layers.{i}.``)."""
    nh, ng = heads(hf_config)
    att = src + "self_attn."
    out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"].clone()
    for kind in ("weight", "bias"):
        if f"{att}q_proj.{kind}" in sd:
            out[f"{dst}self_attention.linear_qkv.{kind}"] = fuse_qkv(
                sd[f"{att}q_proj.{kind}"], sd[f"{att}k_proj.{kind}"], sd[f"{att}v_proj.{kind}"], nh, ng).contiguous()
        if f"{att}o_proj.{kind}" in sd:
            out[f"{dst}self_attention.linear_proj.{kind}"] = sd[f"{att}o_proj.{kind}"].clone()
    for which in ("q", "k"):
        if f"{att}{which}_norm.weight" in sd:
            out[f"{dst}self_attention.{which}_layernorm.weight"] = sd[f"{att}{which}_norm.weight"].clone()


def attention_to_hf(sd: StateDict, src: str, dst: str, hf_config, out: StateDict) -> None:
    """Inverse of :func:`attention_from_hf` (``src`` our layer prefix, ``dst`` the Hugging Face one)."""
    nh, ng = heads(hf_config)
    att = dst + "self_attn."
    out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"].clone()
    for kind in ("weight", "bias"):
        if f"{src}self_attention.linear_qkv.{kind}" in sd:
            q, k, v = split_qkv(sd[f"{src}self_attention.linear_qkv.{kind}"], nh, ng)
            out[f"{att}q_proj.{kind}"], out[f"{att}k_proj.{kind}"] = q.clone(), k.clone()
            out[f"{att}v_proj.{kind}"] = v.clone()
        if f"{src}self_attention.linear_proj.{kind}" in sd:
            out[f"{att}o_proj.{kind}"] = sd[f"{src}self_attention.linear_proj.{kind}"].clone()
    for which in ("q", "k"):
        if f"{src}self_attention.{which}_layernorm.weight" in sd:
            out[f"{att}{which}_norm.weight"] = sd[f"{src}self_attention.{which}_layernorm.weight"].clone()


# --------------------------------------------------------------------------------------------------- MLPs

def gated_mlp_from_hf(sd: StateDict, src: str, dst: str, out: StateDict) -> None:
    """``{src}{gate,up,down}_proj`` (weights, biases if any) -> ``{dst}linear_fc1 = [gate; up]``, ``linear_fc2``."""
    for kind in ("weight", "bias"):
        if f"{src}gate_proj.{kind}" in sd:
            out[f"{dst}linear_fc1.{kind}"] = torch.cat([sd[f"{src}gate_proj.{kind}"], sd[f"{src}up_proj.{kind}"]], 0)
        if f"{src}down_proj.{kind}" in sd:
            out[f"{dst}linear_fc2.{kind}"] = sd[f"{src}down_proj.{kind}"].clone()


def gated_mlp_to_hf(sd: StateDict, src: str, dst: str, out: StateDict) -> None:
    """Inverse of :func:`gated_mlp_from_hf`."""
    for kind in ("weight", "bias"):
        if f"{src}linear_fc1.{kind}" in sd:
            gate, up = torch.chunk(sd[f"{src}linear_fc1.{kind}"], 2, dim=0)
            out[f"{dst}gate_proj.{kind}"], out[f"{dst}up_proj.{kind}"] = gate.clone(), up.clone()
        if f"{src}linear_fc2.{kind}" in sd:
            out[f"{dst}down_proj.{kind}"] = sd[f"{src}linear_fc2.{kind}"].clone()


def experts_from_hf(fc1: torch.Tensor, fc2: torch.Tensor, dst: str, out: StateDict, grouped: bool = False,
                    fc1_bias: Optional[torch.Tensor] = None, fc2_bias: Optional[torch.Tensor] = None) -> None:
    """Experts ``fc1 [E, 2F or F, h]``, ``fc2 [E, h, F]`` (biases ``[E, 2F]``, ``[E, h]``) -> ``{dst}experts.*``
    (``dst`` = ``decoder.layers.{i}.mlp.``), SequentialMLP names or GroupedMLP's ``weight1`` / ``weight2``."""
    num_experts = fc1.shape[0]
    if grouped:
        if fc1_bias is not None or fc2_bias is not None:
            raise ValueError("GroupedMLP has no expert biases (--moe-grouped-gemm needs --disable-bias-linear)")
        out[dst + "experts.weight1"] = torch.cat([fc1[e].t() for e in range(num_experts)], dim=1).contiguous()
        out[dst + "experts.weight2"] = torch.cat([fc2[e].t() for e in range(num_experts)], dim=0).contiguous()
        return
    for e in range(num_experts):
        base = f"{dst}experts.local_experts.{e}."
        out[base + "linear_fc1.weight"] = fc1[e].clone().contiguous()
        out[base + "linear_fc2.weight"] = fc2[e].clone().contiguous()
        if fc1_bias is not None:
            out[base + "linear_fc1.bias"] = fc1_bias[e].clone()
        if fc2_bias is not None:
            out[base + "linear_fc2.bias"] = fc2_bias[e].clone()


def read_hf_experts(sd: StateDict, prefix: str, num_experts: int, gate: str = "gate_proj", up: str = "up_proj",
                    down: str = "down_proj") -> Tuple[torch.Tensor, torch.Tensor]:
    """``(fc1 [E, 2F, h] = [gate; up] per expert, fc2 [E, h, F])`` under ``prefix`` (``model.layers.{i}.mlp.``):
    transformers 5's fused ``experts.gate_up_proj`` / ``experts.down_proj``, or the per-expert matrices
    ``experts.{e}.{gate,up,down}.weight`` that the Hub's checkpoints (and ``save_pretrained``) hold."""
    if prefix + "experts.gate_up_proj" in sd:
        return sd[prefix + "experts.gate_up_proj"], sd[prefix + "experts.down_proj"]
    base = prefix + "experts."
    fc1 = torch.stack([torch.cat([sd[f"{base}{e}.{gate}.weight"], sd[f"{base}{e}.{up}.weight"]], 0)
                       for e in range(num_experts)])
    fc2 = torch.stack([sd[f"{base}{e}.{down}.weight"] for e in range(num_experts)])
    return fc1, fc2


def experts_to_hf(sd: StateDict, src: str, num_experts: int):
    """Inverse of :func:`experts_from_hf`: ``(fc1 [E, 2F, h], fc2 [E, h, F], fc1 bias [E, 2F] or None, fc2 bias
    [E, h] or None)`` from either expert implementation's names under ``src`` (``decoder.layers.{i}.mlp.``)."""
    if src + "experts.weight1" in sd:
        w1, w2 = sd[src + "experts.weight1"], sd[src + "experts.weight2"]
        fc1 = torch.stack([c.t() for c in torch.chunk(w1, num_experts, dim=1)])
        fc2 = torch.stack([c.t() for c in torch.chunk(w2, num_experts, dim=0)])
        return fc1.contiguous(), fc2.contiguous(), None, None
    base = src + "experts.local_experts."
    fc1 = torch.stack([sd[f"{base}{e}.linear_fc1.weight"] for e in range(num_experts)])
    fc2 = torch.stack([sd[f"{base}{e}.linear_fc2.weight"] for e in range(num_experts)])
    b1 = b2 = None
    if f"{base}0.linear_fc1.bias" in sd:
        b1 = torch.stack([sd[f"{base}{e}.linear_fc1.bias"] for e in range(num_experts)])
        b2 = torch.stack([sd[f"{base}{e}.linear_fc2.bias"] for e in range(num_experts)])
    return fc1.contiguous(), fc2.contiguous(), b1, b2


# ------------------------------------------------------------------------------------ embedding and head

def embeddings_from_hf(sd: StateDict, hf_config, padded_vocab_size: int, out: StateDict,
                       prefix: str = "model.", head: str = "lm_head.weight") -> None:
    """Embedding (padded), final norm and, unless tied, the output layer."""
    out["embedding.word_embeddings.weight"] = pad_vocab(sd[prefix + "embed_tokens.weight"], padded_vocab_size)
    out["decoder.final_layernorm.weight"] = sd[prefix + "norm.weight"].clone()
    if not getattr(hf_config, "tie_word_embeddings", False):
        out["output_layer.weight"] = pad_vocab(sd[head], padded_vocab_size)


def embeddings_to_hf(sd: StateDict, hf_config, out: StateDict, prefix: str = "model.",
                     head: str = "lm_head.weight") -> None:
    """Inverse of :func:`embeddings_from_hf`, the vocabulary trimmed to ``hf_config.vocab_size``; a tied model's
    ``lm_head`` is the embedding."""
    vocab = hf_config.vocab_size
    out[prefix + "embed_tokens.weight"] = sd["embedding.word_embeddings.weight"][:vocab].clone()
    out[prefix + "norm.weight"] = sd["decoder.final_layernorm.weight"].clone()
    out[head] = (sd["output_layer.weight"][:vocab].clone() if "output_layer.weight" in sd
                 else out[prefix + "embed_tokens.weight"])


# ------------------------------------------------------------------------------------------- whole decoder

def dense_mlp_from_hf(sd: StateDict, layer: int, src: str, dst: str, out: StateDict) -> None:
    gated_mlp_from_hf(sd, src + "mlp.", dst + "mlp.", out)


def dense_mlp_to_hf(sd: StateDict, layer: int, src: str, dst: str, out: StateDict) -> None:
    gated_mlp_to_hf(sd, src + "mlp.", dst + "mlp.", out)


def decoder_from_hf(sd: StateDict, hf_config, padded_vocab_size: int,
                    mlp_from_hf: Callable = dense_mlp_from_hf) -> StateDict:
    """A whole Llama-style decoder -> megatron-core names; ``mlp_from_hf(sd, layer, src, dst, out)`` maps each layer's
    MLP (``src`` = ``model.layers.{i}.``, ``dst`` = ``decoder.layers.{i}.``; default: the dense gated MLP)."""
    out: StateDict = {}
    embeddings_from_hf(sd, hf_config, padded_vocab_size, out)
    for i in range(hf_config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        attention_from_hf(sd, src, dst, hf_config, out)
        out[dst + "pre_mlp_layernorm.weight"] = sd[src + "post_attention_layernorm.weight"].clone()
        mlp_from_hf(sd, i, src, dst, out)
    return out


def decoder_to_hf(sd: StateDict, hf_config, mlp_to_hf: Callable = dense_mlp_to_hf) -> StateDict:
    """Inverse of :func:`decoder_from_hf` (``mlp_to_hf(sd, layer, src, dst, out)`` with ``src`` our layer prefix)."""
    out: StateDict = {}
    for i in range(hf_config.num_hidden_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        attention_to_hf(sd, src, dst, hf_config, out)
        out[dst + "post_attention_layernorm.weight"] = sd[src + "pre_mlp_layernorm.weight"].clone()
        mlp_to_hf(sd, i, src, dst, out)
    embeddings_to_hf(sd, hf_config, out)
    return out

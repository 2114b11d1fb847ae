"""Hugging Face ``NemotronForCausalLM`` (Nemotron-Mini-4B, Minitron, Nemotron-4) <-> megatron-core ``GPTModel``.

A Llama-style decoder (:mod:`.hf_layers`) with three differences, all Megatron flags:

* LayerNorm with a bias and a zero-centred weight, ``y = LN(x) * (1 + w) + b`` (``NemotronLayerNorm1P``) =
  ``--normalization LayerNorm --apply-layernorm-1p``: the stored weights are the same numbers on both sides, biases
  included (``input_layernorm.bias``, ``post_attention_layernorm.bias`` -> ``pre_mlp_layernorm.bias``,
  ``model.norm.bias`` -> ``decoder.final_layernorm.bias``);
* a non-gated squared-ReLU MLP (``hidden_act relu2``: ``mlp.up_proj`` -> ``mlp.linear_fc1``, ``down_proj`` ->
  ``linear_fc2``) = ``--squared-relu``;
* RoPE on the first ``partial_rotary_factor`` of each head (rotate-half inside it) = ``--rotary-percent``.

Refused with one line: q/k/v/o biases without MLP biases (Megatron's ``--disable-bias-linear`` switches both), other
activations, RoPE scaling.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from megatron.core.activations import squared_relu
from megatron.core.models.conversion.hf import rope_theta
from megatron.core.models.conversion.hf_layers import decoder_from_hf, decoder_to_hf, heads
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.vocab_padding import vocab_size_with_padding

MODEL_TYPE = "nemotron"
_NORMS = (("model.layers.{i}.input_layernorm.bias", "decoder.layers.{i}.input_layernorm.bias"),
          ("model.layers.{i}.post_attention_layernorm.bias", "decoder.layers.{i}.pre_mlp_layernorm.bias"))


def _partial_rotary(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 0.5)))


def _check(hf_config) -> None:
    if getattr(hf_config, "hidden_act", "relu2") != "relu2":
        raise ValueError(f"Nemotron with hidden_act {hf_config.hidden_act!r}: only relu2 (--squared-relu) is supported")
    if bool(getattr(hf_config, "attention_bias", False)) != bool(getattr(hf_config, "mlp_bias", False)):
        raise ValueError("Nemotron configs with attention_bias != mlp_bias are not supported (Megatron's "
                         "--disable-bias-linear switches all linear biases together)")
    kind = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_type", "default")
    if kind not in (None, "default"):
        raise ValueError(f"Nemotron with RoPE scaling {kind!r} is not supported")


def config_to_megatron(hf_config, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1,
                       **config_kwargs) -> TransformerConfig:
    """TransformerConfig computing what ``NemotronForCausalLM`` computes."""
    _check(hf_config)
    nh, ng = heads(hf_config)
    kwargs = dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size, num_attention_heads=nh,
        num_query_groups=ng, kv_channels=hf_config.head_dim, ffn_hidden_size=hf_config.intermediate_size,
        layernorm_epsilon=hf_config.norm_eps, normalization="LayerNorm", layernorm_zero_centered_gamma=True,
        activation_func=squared_relu, squared_relu=True, gated_linear_unit=False, bias_gelu_fusion=False,
        add_bias_linear=bool(getattr(hf_config, "mlp_bias", False)), hidden_dropout=0.0,
        attention_dropout=getattr(hf_config, "attention_dropout", 0.0), init_method_std=hf_config.initializer_range,
        tensor_model_parallel_size=tensor_model_parallel_size,
        padded_vocab_size=vocab_size_with_padding(hf_config.vocab_size, make_vocab_size_divisible_by,
                                                  tensor_model_parallel_size, log=False),
        max_position_embeddings=hf_config.max_position_embeddings, position_embedding_type="rope",
        rotary_percent=_partial_rotary(hf_config), rotary_base=rope_theta(hf_config),
        untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", False))
    kwargs.update(config_kwargs)
    return TransformerConfig(**kwargs)


_MLP = (("up_proj", "linear_fc1"), ("down_proj", "linear_fc2"))


def _copy_mlp(sd, src: str, dst: str, out, to_hf: bool) -> None:
    for kind in ("weight", "bias"):
        for hf_name, ours in _MLP:
            a, b = (ours, hf_name) if to_hf else (hf_name, ours)
            if f"{src}mlp.{a}.{kind}" in sd:
                out[f"{dst}mlp.{b}.{kind}"] = sd[f"{src}mlp.{a}.{kind}"].clone()


def _mlp_from_hf(sd, layer, src, dst, out) -> None:
    _copy_mlp(sd, src, dst, out, to_hf=False)


def _mlp_to_hf(sd, layer, src, dst, out) -> None:
    _copy_mlp(sd, src, dst, out, to_hf=True)


def to_megatron(hf_state_dict: Dict, hf_config, padded_vocab_size: int) -> Dict:
    """``NemotronForCausalLM`` state dict -> megatron-core ``GPTModel`` names (TP = 1)."""
    _check(hf_config)
    out = decoder_from_hf(hf_state_dict, hf_config, padded_vocab_size, mlp_from_hf=_mlp_from_hf)
    for i in range(hf_config.num_hidden_layers):
        for hf_name, ours in _NORMS:
            out[ours.format(i=i)] = hf_state_dict[hf_name.format(i=i)].clone()
    out["decoder.final_layernorm.bias"] = hf_state_dict["model.norm.bias"].clone()
    return out


def to_hf(state_dict: Dict, hf_config) -> Dict:
    """Inverse of :func:`to_megatron` (vocabulary trimmed to ``hf_config.vocab_size``)."""
    out = decoder_to_hf(state_dict, hf_config, mlp_to_hf=_mlp_to_hf)
    for i in range(hf_config.num_hidden_layers):
        for hf_name, ours in _NORMS:
            out[hf_name.format(i=i)] = state_dict[ours.format(i=i)].clone()
    out["model.norm.bias"] = state_dict["decoder.final_layernorm.bias"].clone()
    return out


def config_to_hf(config: TransformerConfig) -> Optional[Tuple[str, dict]]:
    """``('nemotron', NemotronConfig fields)`` of a Nemotron-shaped TransformerConfig (LayerNorm 1p, squared ReLU,
    RoPE, no experts), or None."""
    if not (config.normalization == "LayerNorm" and config.layernorm_zero_centered_gamma and config.squared_relu
            and not config.gated_linear_unit and config.position_embedding_type == "rope"
            and not config.rotary_interleaved and not config.use_rope_scaling and not config.num_moe_experts
            and not config.hybrid_layer_pattern and not config.add_qkv_bias and not config.qk_layernorm):
        return None
    return MODEL_TYPE, dict(
        hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_query_groups,
        head_dim=config.kv_channels, intermediate_size=config.ffn_hidden_size,
        max_position_embeddings=config.max_position_embeddings, norm_eps=config.layernorm_epsilon,
        hidden_act="relu2", attention_bias=config.add_bias_linear, mlp_bias=config.add_bias_linear,
        rope_parameters=dict(rope_type="default", rope_theta=float(config.rotary_base),
                             partial_rotary_factor=config.rotary_percent),
        tie_word_embeddings=not config.untie_embeddings_and_output_weights, initializer_range=config.init_method_std)

"""Megatron legacy checkpoint key names <-> megatron-core key names (GPT and BERT).

=============================================================  ===========================================
legacy (``megatron.model``, checkpoints)                        megatron-core (``megatron.core.models``)
=============================================================  ===========================================
language_model.embedding.{word,position,tokentype}_embeddings   embedding.{word,position,tokentype}_embeddings
language_model.encoder.layers.{i}.input_layernorm               {decoder|encoder}.layers.{i}.input_layernorm
  ...self_attention.query_key_value                               ...self_attention.linear_qkv
  ...self_attention.dense                                         ...self_attention.linear_proj
  ...post_attention_layernorm                                     ...pre_mlp_layernorm
  ...mlp.dense_h_to_4h / mlp.dense_4h_to_h                        ...mlp.linear_fc1 / mlp.linear_fc2
language_model.encoder.final_layernorm                          {decoder|encoder}.final_layernorm
language_model.output_layer.weight (untied GPT)                 output_layer.weight
word_embeddings.weight (last stage's tied copy,                 output_layer.weight (last stage, tied)
  ``word_embeddings_for_head`` in checkpoints)
language_model.pooler.dense (BERT)                              pooler.dense
lm_head.dense / lm_head.layernorm / lm_head.bias (BERT)         lm_head.dense / lm_head.layer_norm / output_layer.bias
binary_head (BERT)                                              binary_head
=============================================================  ===========================================

GPT's megatron-core block is ``decoder``, BERT's is ``encoder``. Tensor values and layouts are identical.

T5 (``model='t5'``): ``language_model.{encoder,decoder}`` <-> ``{encoder,decoder}``; decoder layers add
``post_attention_layernorm`` <-> ``pre_cross_attn_layernorm``, ``inter_attention.{query,key_value,dense}`` <->
``cross_attention.{linear_q,linear_kv,linear_proj}``, ``post_inter_attention_layernorm`` <-> ``pre_mlp_layernorm``;
``lm_head.bias`` <-> ``lm_head.output_layer.bias``; the last stage's tied copy ``word_embeddings.weight`` <->
``lm_head.output_layer.weight``. megatron-core's duplicate aliases (``position_embeddings.*``, ``output_layer.*``)
are dropped on the way to legacy names.
"""
from __future__ import annotations

from megatron.core.transformer.legacy_names import LEGACY_SUBMODULE_NAMES, install_legacy_state_dict_names  # noqa: F401

# (legacy, mcore) substrings of whole keys of GPT/BERT encoder layers, from the one table (transformer.legacy_names).
_LAYER_RULES = tuple(
    [(f".self_attention.{old}.", f".self_attention.{new}.")
     for new, old in LEGACY_SUBMODULE_NAMES["attention"].items() if new in ("linear_qkv", "linear_proj")]
    + [(f".{old}.", f".{new}.") for new, old in LEGACY_SUBMODULE_NAMES["encoder_layer"].items()]
    + [(f".mlp.{old}.", f".mlp.{new}.") for new, old in LEGACY_SUBMODULE_NAMES["mlp"].items()]
)


# (legacy, mcore) substrings of whole keys of T5 decoder layers (self-attention, cross-attention, norms, MLP).
_DECODER_LAYER_RULES = tuple(
    [(f".self_attention.{old}.", f".self_attention.{new}.")
     for new, old in LEGACY_SUBMODULE_NAMES["attention"].items() if new in ("linear_qkv", "linear_proj")]
    + [(f".{LEGACY_SUBMODULE_NAMES['decoder_layer']['cross_attention']}.{old}.", f".cross_attention.{new}.")
       for new, old in LEGACY_SUBMODULE_NAMES["attention"].items() if new in ("linear_q", "linear_kv", "linear_proj")]
    + [(f".{old}.", f".{new}.") for new, old in LEGACY_SUBMODULE_NAMES["decoder_layer"].items()
       if new != "cross_attention"]
    + [(f".mlp.{old}.", f".mlp.{new}.") for new, old in LEGACY_SUBMODULE_NAMES["mlp"].items()]
)


def _block_name(model: str) -> str:
    if model not in ("gpt", "bert", "t5"):
        raise ValueError(f"model must be 'gpt', 'bert' or 't5', got {model!r}")
    return "decoder" if model == "gpt" else "encoder"


def _t5_legacy_to_mcore_key(key: str) -> str:
    if key.startswith("language_model.embedding."):
        return "embedding." + key[len("language_model.embedding."):]
    for block, rules in (("encoder", _LAYER_RULES), ("decoder", _DECODER_LAYER_RULES)):
        if key.startswith(f"language_model.{block}."):
            key = block + "." + key[len(f"language_model.{block}."):]
            for old, new in rules:
                key = key.replace(old, new)
            return key
    if key == "lm_head.bias":
        return "lm_head.output_layer.bias"
    if key.startswith("word_embeddings."):
        return "lm_head.output_layer." + key[len("word_embeddings."):]
    return key


def _t5_mcore_to_legacy_key(key: str):
    if key.startswith("position_embeddings.") or key.startswith("output_layer."):
        return None  # megatron-core's aliases of embedding.position_embeddings / lm_head.output_layer
    if key.startswith("embedding."):
        return "language_model." + key
    for block, rules in (("encoder", _LAYER_RULES), ("decoder", _DECODER_LAYER_RULES)):
        if key.startswith(block + "."):
            key = f"language_model.{block}." + key[len(block) + 1:]
            for old, new in rules:
                key = key.replace(new, old)
            return key
    if key == "lm_head.output_layer.bias":
        return "lm_head.bias"
    if key.startswith("lm_head.output_layer."):
        return "word_embeddings." + key[len("lm_head.output_layer."):]
    return key


def legacy_to_mcore_key(key: str, model: str = "gpt") -> str:
    block = _block_name(model)
    if model == "t5":
        return _t5_legacy_to_mcore_key(key)
    if key.startswith("language_model.embedding."):
        return "embedding." + key[len("language_model.embedding."):]
    if key.startswith("language_model.encoder."):
        key = block + "." + key[len("language_model.encoder."):]
        for old, new in _LAYER_RULES:
            key = key.replace(old, new)
        return key
    if key.startswith("language_model.output_layer."):
        return "output_layer." + key[len("language_model.output_layer."):]
    if key.startswith("word_embeddings."):
        return "output_layer." + key[len("word_embeddings."):]
    if key.startswith("language_model.pooler."):
        return "pooler." + key[len("language_model.pooler."):]
    if key == "lm_head.bias":
        return "output_layer.bias"
    if key.startswith("lm_head.layernorm."):
        return "lm_head.layer_norm." + key[len("lm_head.layernorm."):]
    return key


def mcore_to_legacy_key(key: str, model: str = "gpt"):
    """The legacy name of ``key`` (``None`` for megatron-core's duplicate T5 aliases)."""
    block = _block_name(model)
    if model == "t5":
        return _t5_mcore_to_legacy_key(key)
    if key.startswith("embedding."):
        return "language_model." + key
    if key.startswith(block + "."):
        key = "language_model.encoder." + key[len(block) + 1:]
        for old, new in _LAYER_RULES:
            key = key.replace(new, old)
        return key
    if key == "output_layer.bias" and model == "bert":
        return "lm_head.bias"
    if key.startswith("output_layer."):
        # GPT with untied embeddings; for the tied copy on the last pipeline stage use word_embeddings.weight.
        return ("language_model.output_layer." if model == "gpt" else "word_embeddings.") + key[len("output_layer."):]
    if key.startswith("pooler."):
        return "language_model." + key
    if key.startswith("lm_head.layer_norm."):
        return "lm_head.layernorm." + key[len("lm_head.layer_norm."):]
    return key


def legacy_to_mcore(state_dict: dict, model: str = "gpt") -> dict:
    return {legacy_to_mcore_key(k, model): v for k, v in state_dict.items()}


def mcore_to_legacy(state_dict: dict, model: str = "gpt") -> dict:
    renamed = ((mcore_to_legacy_key(k, model), v) for k, v in state_dict.items())
    return {k: v for k, v in renamed if k is not None}

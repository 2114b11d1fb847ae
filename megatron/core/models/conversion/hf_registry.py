"""The one dispatch table of the Hugging Face bridges: a ``transformers`` ``model_type`` -> the functions mapping its
config and weights to megatron-core's ``GPTModel`` and back. ``tools/checkpoint/convert.py --loader hf / --saver hf``
and the tests look a family up here; a new family adds one entry (its module under this package states its map).

Every bridge works on megatron-core state-dict names (``decoder.layers.{i}....``) at TP = PP = EP = 1:

* ``config_to_megatron(hf_config, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, **config_kwargs)``
  -> the :class:`TransformerConfig` computing what the Hugging Face model computes;
* ``to_megatron(hf_state_dict, hf_config, padded_vocab_size)`` / ``to_hf(state_dict, hf_config)`` -> the weights;
* ``config_to_hf(config)`` -> ``(model_type, HF config fields without the vocabulary)`` when a TransformerConfig
  (of a model trained here) is of the family, else None: the export of a checkpoint with no Hugging Face config;
* ``config_kwargs_from_weights(hf_config, weight names)`` (optional) -> config overrides the file's weights imply.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple

from megatron.core.models.conversion import (hf, hf_deepseek, hf_gpt_oss, hf_llama4, hf_moe, hf_nemotron,
                                          hf_nemotron_h, hf_qwen)


@dataclasses.dataclass(frozen=True)
class HFBridge:
    model_type: str
    hf_class: str        # the transformers model class a directory of this family loads as
    config_class: str    # its transformers config class
    config_to_megatron: Callable
    to_megatron: Callable
    to_hf: Callable
    config_to_hf: Optional[Callable] = None
    # (hf_config, weight names) -> TransformerConfig overrides the weights imply (e.g. MTP layers the file lacks).
    config_kwargs_from_weights: Optional[Callable] = None


def _mcore(to_megatron, to_hf):
    """The GPT-2 / Llama mappings, which also speak the legacy names, asked for megatron-core names."""
    return (lambda sd, cfg, padded: to_megatron(sd, cfg, padded, key_format="mcore"),
            lambda sd, cfg: to_hf(sd, cfg, key_format="mcore"))


def _moe_to_megatron(sd, cfg, padded):
    return hf_moe.moe_hf_to_megatron(sd, cfg, padded)


_BRIDGES = [
    # hybrid Mamba (MambaModel; config.hybrid_layer_pattern): Nemotron-H, Nemotron-Nano-v2, Nemotron-3. First, so that
    # no decoder family below claims a hybrid config in hf_config_fields.
    HFBridge("nemotron_h", "NemotronHForCausalLM", "NemotronHConfig", hf_nemotron_h.nemotron_h_config_to_megatron,
             hf_nemotron_h.nemotron_h_hf_to_megatron, hf_nemotron_h.nemotron_h_megatron_to_hf,
             hf_nemotron_h.config_to_hf),
    HFBridge("gpt2", "GPT2LMHeadModel", "GPT2Config", hf.gpt2_config_to_megatron,
             *_mcore(hf.gpt2_hf_to_megatron, hf.gpt2_megatron_to_hf), hf.gpt2_config_to_hf),
    HFBridge("llama", "LlamaForCausalLM", "LlamaConfig", hf.llama_config_to_megatron,
             *_mcore(hf.llama_hf_to_megatron, hf.llama_megatron_to_hf), hf.llama_config_to_hf),
    HFBridge("mixtral", "MixtralForCausalLM", "MixtralConfig", hf_moe.moe_config_to_megatron, _moe_to_megatron,
             hf_moe.moe_megatron_to_hf, hf_moe.config_to_hf),
    HFBridge("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", hf_moe.moe_config_to_megatron, _moe_to_megatron,
             hf_moe.moe_megatron_to_hf, hf_moe.config_to_hf),
    HFBridge("qwen2", "Qwen2ForCausalLM", "Qwen2Config", hf_qwen.config_to_megatron, hf_qwen.to_megatron,
             hf_qwen.to_hf, hf_qwen.config_to_hf),
    HFBridge("qwen3", "Qwen3ForCausalLM", "Qwen3Config", hf_qwen.config_to_megatron, hf_qwen.to_megatron,
             hf_qwen.to_hf, hf_qwen.config_to_hf),
    HFBridge("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", hf_qwen.config_to_megatron, hf_qwen.to_megatron,
             hf_qwen.to_hf, hf_qwen.config_to_hf),
    HFBridge("deepseek_v2", "DeepseekV2ForCausalLM", "DeepseekV2Config", hf_deepseek.config_to_megatron,
             hf_deepseek.to_megatron, hf_deepseek.to_hf, hf_deepseek.config_to_hf,
             hf_deepseek.config_kwargs_from_weights),
    HFBridge("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config", hf_deepseek.config_to_megatron,
             hf_deepseek.to_megatron, hf_deepseek.to_hf, hf_deepseek.config_to_hf,
             hf_deepseek.config_kwargs_from_weights),
    HFBridge("gpt_oss", "GptOssForCausalLM", "GptOssConfig", hf_gpt_oss.config_to_megatron, hf_gpt_oss.to_megatron,
             hf_gpt_oss.to_hf, hf_gpt_oss.config_to_hf),
    HFBridge("llama4_text", "Llama4ForCausalLM", "Llama4TextConfig", hf_llama4.config_to_megatron,
             hf_llama4.to_megatron, hf_llama4.to_hf, hf_llama4.config_to_hf),
    HFBridge("nemotron", "NemotronForCausalLM", "NemotronConfig", hf_nemotron.config_to_megatron,
             hf_nemotron.to_megatron, hf_nemotron.to_hf, hf_nemotron.config_to_hf),
]
BRIDGES: Dict[str, HFBridge] = {b.model_type: b for b in _BRIDGES}


def bridge_for(model_type: str) -> HFBridge:
    """The bridge of a Hugging Face ``model_type``; ValueError naming the supported ones."""
    try:
        return BRIDGES[model_type]
    except KeyError:
        raise ValueError(f"no Hugging Face bridge for model type {model_type!r} (supported: "
                         f"{', '.join(sorted(BRIDGES))})") from None


def hf_config_fields(config) -> Optional[Tuple[HFBridge, dict]]:
    """(bridge, HF config fields) of the first family whose ``config_to_hf`` accepts ``config``, or None."""
    for bridge in _BRIDGES:
        if bridge.config_to_hf is None:
            continue
        found = bridge.config_to_hf(config)
        if found is not None:
            model_type, fields = found
            return BRIDGES[model_type], fields
    return None

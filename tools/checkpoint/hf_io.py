"""Hugging Face directories (config.json + model.safetensors) <-> our full state dict, for every family of the
bridge table :mod:`megatron.core.models.conversion.hf_registry` (legacy names for GPT-2 and Llama, megatron-core
names for the others).

The tensor and config mapping is the family's bridge; this module reads and writes the files, and turns the
TransformerConfig into the complete args a training run would have (and back, for a checkpoint trained here).
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Dict, Tuple

import torch

from megatron.core.models.conversion import hf_registry
from megatron.core.models.conversion.keys import legacy_to_mcore, mcore_to_legacy
from megatron.training.arguments.transformer_config import (args_from_transformer_config, complete_args,
                                                            core_transformer_config_from_args)
from tools.checkpoint.legacy_io import ConversionError

# The families the legacy model classes build too: their state dicts keep the legacy names.
_LEGACY_FAMILIES = ("gpt2", "llama")


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ConversionError("--loader hf / --saver hf need the 'transformers' package "
                              "(pip install transformers)") from e
    return transformers


def _read_weights(load_dir: str) -> Dict[str, torch.Tensor]:
    single = os.path.join(load_dir, "model.safetensors")
    index = os.path.join(load_dir, "model.safetensors.index.json")
    from safetensors.torch import load_file
    if os.path.isfile(single):
        return load_file(single)
    if os.path.isfile(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
        out = {}
        for name in files:
            out.update(load_file(os.path.join(load_dir, name)))
        return out
    if os.path.isfile(os.path.join(load_dir, "pytorch_model.bin")):
        return torch.load(os.path.join(load_dir, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    raise ConversionError(f"{load_dir} has no model.safetensors (or .index.json, or pytorch_model.bin)")


def load_hf(load_dir: str, make_divisible_by: int = 128) -> Tuple[Dict[str, torch.Tensor], argparse.Namespace]:
    """(full state dict at TP=1 padding, Megatron args) of a Hugging Face directory of a family of the bridge table
    (megatron.core.models.conversion.hf_registry); GPT-2 and Llama come with the legacy names (the legacy model classes
    build them too), the others with megatron-core's."""
    transformers = _transformers()
    if not os.path.isfile(os.path.join(load_dir, "config.json")):
        raise ConversionError(f"{load_dir}/config.json not found: --load-dir must be a Hugging Face model directory")
    hf_config = transformers.AutoConfig.from_pretrained(load_dir)
    try:
        bridge = hf_registry.bridge_for(hf_config.model_type)
        weights = _read_weights(load_dir)
        overrides = bridge.config_kwargs_from_weights(hf_config, weights.keys()) if bridge.config_kwargs_from_weights \
            else {}
        config = bridge.config_to_megatron(hf_config, make_vocab_size_divisible_by=make_divisible_by, **overrides)
        full = bridge.to_megatron(weights, hf_config, config.padded_vocab_size)
    except ValueError as e:
        raise ConversionError(f"--loader hf {load_dir}: {e}") from e
    legacy = bridge.model_type in _LEGACY_FAMILIES
    if legacy:
        full = mcore_to_legacy(full, "gpt")
    args = args_from_transformer_config(
        config, make_vocab_size_divisible_by=make_divisible_by, use_mcore_models=not legacy, iteration=0,
        consumed_train_samples=0, consumed_valid_samples=0, hf_model_type=hf_config.model_type,
        hf_config=_storable(hf_config.to_dict()), true_vocab_size=hf_config.vocab_size)
    return full, args


def _storable(hf_config: dict) -> dict:
    """The HF config without the entries a checkpoint's args cannot hold (``id2label``'s int keys: Megatron loads
    args with ``weights_only``); transformers fills them back with their defaults."""
    return {k: v for k, v in hf_config.items()
            if not (isinstance(v, dict) and any(not isinstance(key, str) for key in v))}


def _norm_epsilon(args) -> float:
    """--norm-epsilon (dest ``layernorm_epsilon``; checkpoints converted before it existed say ``norm_epsilon``)."""
    return getattr(args, "layernorm_epsilon", getattr(args, "norm_epsilon", 1e-5))


def hf_config_from_args(args, true_vocab_size):
    """The Hugging Face config of a Megatron model: the one it was imported from, else the one of the first family
    of the bridge table whose shape the model's TransformerConfig has."""
    transformers = _transformers()
    family = getattr(args, "hf_model_type", None)
    if getattr(args, "hf_config", None) is not None and family is not None:
        cls = getattr(transformers, hf_registry.bridge_for(family).config_class)
        return cls.from_dict(dict(args.hf_config))
    if true_vocab_size is None:
        raise ConversionError("--saver hf needs --true-vocab-size (the tokenizer's vocabulary size) to drop the "
                              "vocabulary padding")
    if not hasattr(args, "layernorm_epsilon"):
        args.layernorm_epsilon = _norm_epsilon(args)
    try:
        config = core_transformer_config_from_args(complete_args(args))
    except ValueError as e:
        raise ConversionError(f"--saver hf: the checkpoint's args do not describe a model: {e}") from e
    found = hf_registry.hf_config_fields(config)
    if found is None:
        raise ConversionError("--saver hf: no Hugging Face family has this model's shape (families: "
                              f"{', '.join(sorted(hf_registry.BRIDGES))}; see docs/models.md for the flags of each)")
    bridge, fields = found
    return getattr(transformers, bridge.config_class)(vocab_size=true_vocab_size, **fields)


def save_hf(full: Dict[str, torch.Tensor], args, save_dir: str, true_vocab_size=None):
    """Write config.json + model.safetensors (tied output weights are stored once, as transformers does)."""
    from safetensors.torch import save_file

    hf_config = hf_config_from_args(args, true_vocab_size)
    bridge = hf_registry.bridge_for(hf_config.model_type)
    sd = full if getattr(args, "use_mcore_models", False) else legacy_to_mcore(full, "gpt")
    try:
        sd = bridge.to_hf(sd, hf_config)
    except KeyError as e:
        raise ConversionError(f"--saver hf ({bridge.hf_class}): the checkpoint has no tensor {e}") from e
    if getattr(hf_config, "tie_word_embeddings", True):
        sd.pop("lm_head.weight", None)
    os.makedirs(save_dir, exist_ok=True)
    hf_config.save_pretrained(save_dir)
    save_file({k: v.contiguous().clone() for k, v in sd.items()}, os.path.join(save_dir, "model.safetensors"),
              metadata={"format": "pt"})

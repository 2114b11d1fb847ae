"""Hugging Face GPT-2 / Llama / Mixtral / Qwen2-MoE / NemotronH directories (config.json + model.safetensors) <-> our full
state dict (legacy names; megatron-core names for the MoE models).

The tensor mapping is :mod:`megatron.core.models.conversion.hf` (and ``.hf_moe``); this module reads and writes the
files and maps the Hugging Face config to Megatron's args (and back).
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Dict, Tuple

import torch

from megatron.core.models.conversion import hf, hf_moe, hf_nemotron_h
from tools.checkpoint.legacy_io import ConversionError


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


def _args_from_config(config, hf_config, family: str, make_divisible_by: int) -> argparse.Namespace:
    """Megatron args describing the model that ``config`` (a TransformerConfig from conversion.hf) builds."""
    llama = family in ("llama",) + hf_moe.MOE_MODEL_TYPES
    moe = family in hf_moe.MOE_MODEL_TYPES
    groups = getattr(config, "num_query_groups", None) or config.num_attention_heads
    return argparse.Namespace(
        num_layers=config.num_layers, hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads, kv_channels=config.kv_channels,
        group_query_attention=groups != config.num_attention_heads, num_query_groups=groups,
        max_position_embeddings=config.max_position_embeddings, seq_length=config.max_position_embeddings,
        padded_vocab_size=config.padded_vocab_size, make_vocab_size_divisible_by=make_divisible_by,
        normalization="RMSNorm" if llama else "LayerNorm", layernorm_epsilon=config.layernorm_epsilon,
        swiglu=llama, add_bias_linear=config.add_bias_linear, add_qkv_bias=config.add_qkv_bias,
        position_embedding_type="rope" if llama else "learned_absolute",
        rotary_base=getattr(config, "rotary_base", 10000), openai_gelu=getattr(config, "openai_gelu", False),
        untie_embeddings_and_output_weights=config.untie_embeddings_and_output_weights,
        add_position_embedding=not llama, use_mcore_models=False, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None, params_dtype=torch.float32,
        fp16=False, bf16=False, tokenizer_type=None, iteration=0, consumed_train_samples=0,
        consumed_valid_samples=0, hf_model_type=family, hf_config=hf_config.to_dict(),
        true_vocab_size=hf_config.vocab_size,
        num_experts=getattr(config, "num_moe_experts", None),
        moe_router_topk=getattr(config, "moe_router_topk", 2),
        moe_ffn_hidden_size=config.moe_ffn_hidden_size if moe else None,
        moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=config.moe_shared_expert_gate, moe_router_pre_softmax=config.moe_router_pre_softmax,
    )


def load_hf(load_dir: str, make_divisible_by: int = 128) -> Tuple[Dict[str, torch.Tensor], argparse.Namespace]:
    """(full legacy state dict at TP=1 padding, Megatron args) of a GPT-2 or Llama Hugging Face directory."""
    transformers = _transformers()
    if not os.path.isfile(os.path.join(load_dir, "config.json")):
        raise ConversionError(f"{load_dir}/config.json not found: --load-dir must be a Hugging Face model directory")
    hf_config = transformers.AutoConfig.from_pretrained(load_dir)
    weights = _read_weights(load_dir)
    if hf_config.model_type == "gpt2":
        config = hf.gpt2_config_to_megatron(hf_config, make_vocab_size_divisible_by=make_divisible_by)
        full = hf.gpt2_hf_to_megatron(weights, hf_config, config.padded_vocab_size)
    elif hf_config.model_type == "llama":
        config = hf.llama_config_to_megatron(hf_config, make_vocab_size_divisible_by=make_divisible_by)
        full = hf.llama_hf_to_megatron(weights, hf_config, config.padded_vocab_size)
    elif hf_config.model_type in hf_moe.MOE_MODEL_TYPES:
        try:
            config = hf_moe.moe_config_to_megatron(hf_config, make_vocab_size_divisible_by=make_divisible_by)
        except ValueError as e:
            raise ConversionError(f"{load_dir}: {e}") from e
        full = hf_moe.moe_hf_to_megatron(weights, hf_config, config.padded_vocab_size)
    elif hf_config.model_type == hf_nemotron_h.MODEL_TYPE:
        return _load_nemotron_h(load_dir, hf_config, weights, make_divisible_by)
    else:
        raise ConversionError(f"--loader hf supports GPT-2, Llama, Mixtral, Qwen2-MoE and NemotronH models, {load_dir} "
                              f"holds a {hf_config.model_type!r} model")
    args = _args_from_config(config, hf_config, hf_config.model_type, make_divisible_by)
    # MoE layers exist only with megatron-core names
    args.use_mcore_models = hf_config.model_type in hf_moe.MOE_MODEL_TYPES
    return full, args


def _load_nemotron_h(load_dir, hf_config, weights, make_divisible_by):
    """(full MambaModel state dict, Megatron args) of a NemotronH directory."""
    try:
        config = hf_nemotron_h.nemotron_h_config_to_megatron(hf_config, make_vocab_size_divisible_by=make_divisible_by)
    except ValueError as e:
        raise ConversionError(f"{load_dir}: {e}") from e
    full = hf_nemotron_h.nemotron_h_hf_to_megatron(weights, hf_config, config.padded_vocab_size)
    args = _args_from_config(config, hf_config, hf_nemotron_h.MODEL_TYPE, make_divisible_by)
    pattern = hf_nemotron_h.hybrid_pattern(hf_config)
    # id2label has int keys, which Megatron's weights_only loader of common.pt refuses (the args would be dropped)
    args.hf_config = {k: v for k, v in args.hf_config.items() if k not in ("id2label", "label2id")}
    args.__dict__.update(
        use_mcore_models=True, hybrid_layer_pattern=pattern, is_hybrid_model=True, normalization="RMSNorm",
        swiglu=False, squared_relu=True, position_embedding_type="none", add_position_embedding=False,
        mamba_state_dim=config.mamba_state_dim, mamba_head_dim=config.mamba_head_dim,
        mamba_num_groups=config.mamba_num_groups, mamba_num_heads=config.mamba_num_heads,
        init_method_std=config.init_method_std)
    if "E" in pattern:
        args.__dict__.update(
            moe_ffn_hidden_size=config.moe_ffn_hidden_size, moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
            moe_router_topk_scaling_factor=config.moe_router_topk_scaling_factor,
            moe_latent_size=config.moe_latent_size)
    return full, args


def _norm_epsilon(args) -> float:
    """--norm-epsilon (dest ``layernorm_epsilon``; checkpoints converted before it existed say ``norm_epsilon``)."""
    return getattr(args, "layernorm_epsilon", getattr(args, "norm_epsilon", 1e-5))


def hf_config_from_args(args, true_vocab_size):
    """The Hugging Face config of a Megatron model: the one it was imported from, else built from its args."""
    transformers = _transformers()
    family = getattr(args, "hf_model_type", None)
    if getattr(args, "hf_config", None) is not None:
        cls = {"gpt2": transformers.GPT2Config, "mixtral": transformers.MixtralConfig,
               "qwen2_moe": transformers.Qwen2MoeConfig,
               hf_nemotron_h.MODEL_TYPE: transformers.NemotronHConfig}.get(family, transformers.LlamaConfig)
        return cls.from_dict(dict(args.hf_config))
    if true_vocab_size is None:
        raise ConversionError("--saver hf needs --true-vocab-size (the tokenizer's vocabulary size) to drop the "
                              "vocabulary padding")
    if getattr(args, "hybrid_layer_pattern", None):
        return transformers.NemotronHConfig(**hf_nemotron_h.nemotron_h_config_kwargs(args, true_vocab_size))
    heads = args.num_attention_heads
    if getattr(args, "swiglu", False) and getattr(args, "normalization", "LayerNorm") == "RMSNorm" \
            and getattr(args, "position_embedding_type", None) == "rope":
        if getattr(args, "add_bias_linear", True):
            raise ConversionError("--saver hf (Llama): the model has linear biases; pass a model trained with "
                                  "--disable-bias-linear")
        # Attention, norms, positions and embeddings: the same fields for Llama, Mixtral and Qwen2-MoE.
        common = dict(
            vocab_size=true_vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
            num_attention_heads=heads,
            num_key_value_heads=args.num_query_groups if getattr(args, "group_query_attention", False) else heads,
            max_position_embeddings=args.max_position_embeddings, rms_norm_eps=_norm_epsilon(args),
            rope_theta=float(getattr(args, "rotary_base", 10000)),
            tie_word_embeddings=not args.untie_embeddings_and_output_weights)
        experts = getattr(args, "num_experts", None)
        expert_width = getattr(args, "moe_ffn_hidden_size", None) or args.ffn_hidden_size
        shared = getattr(args, "moe_shared_expert_intermediate_size", None)
        qwen = bool(shared or getattr(args, "add_qkv_bias", False) or getattr(args, "moe_router_pre_softmax", False))
        if experts and qwen:
            if not (shared and getattr(args, "moe_shared_expert_gate", False)):
                raise ConversionError("--saver hf: a MoE model with --add-qkv-bias or --moe-router-pre-softmax "
                                      "exports as Qwen2-MoE, which needs a gated shared expert "
                                      "(--moe-shared-expert-intermediate-size N --moe-shared-expert-gate)")
            return transformers.Qwen2MoeConfig(
                intermediate_size=args.ffn_hidden_size, moe_intermediate_size=expert_width,
                shared_expert_intermediate_size=shared, num_experts=experts, num_experts_per_tok=args.moe_router_topk,
                norm_topk_prob=not args.moe_router_pre_softmax, qkv_bias=bool(getattr(args, "add_qkv_bias", False)),
                **common)
        if experts:
            return transformers.MixtralConfig(intermediate_size=expert_width, num_local_experts=experts,
                                              num_experts_per_tok=args.moe_router_topk, **common)
        return transformers.LlamaConfig(intermediate_size=args.ffn_hidden_size, **common)
    if not getattr(args, "swiglu", False) and getattr(args, "normalization", "LayerNorm") == "LayerNorm" \
            and getattr(args, "position_embedding_type", "learned_absolute") == "learned_absolute" \
            and getattr(args, "add_bias_linear", True) and not args.untie_embeddings_and_output_weights:
        return transformers.GPT2Config(
            vocab_size=true_vocab_size, n_positions=args.max_position_embeddings, n_embd=args.hidden_size,
            n_layer=args.num_layers, n_head=heads, n_inner=args.ffn_hidden_size,
            layer_norm_epsilon=_norm_epsilon(args),
            activation_function="gelu_new" if getattr(args, "openai_gelu", False) else "gelu",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    raise ConversionError("--saver hf exports GPT-2 (LayerNorm, learned positions, gelu, biases, tied embeddings) "
                          "and Llama (RMSNorm, RoPE, swiglu, no biases) models; this checkpoint is neither")


def save_hf(full: Dict[str, torch.Tensor], args, save_dir: str, true_vocab_size=None):
    """Write config.json + model.safetensors (tied output weights are stored once, as transformers does)."""
    from safetensors.torch import save_file

    from megatron.core.models.conversion.keys import legacy_to_mcore, mcore_to_legacy

    hf_config = hf_config_from_args(args, true_vocab_size)
    mcore = getattr(args, "use_mcore_models", False)
    if hf_config.model_type == hf_nemotron_h.MODEL_TYPE:
        sd = hf_nemotron_h.nemotron_h_megatron_to_hf(full, hf_config)
    elif hf_config.model_type in hf_moe.MOE_MODEL_TYPES:  # MoE layers have megatron-core names only
        sd = hf_moe.moe_megatron_to_hf(full if mcore else legacy_to_mcore(full, "gpt"), hf_config)
    elif hf_config.model_type == "gpt2":
        sd = hf.gpt2_megatron_to_hf(mcore_to_legacy(full, "gpt") if mcore else full, hf_config)
        sd = {("transformer." + k if not k.startswith(("transformer.", "lm_head.")) else k): v for k, v in sd.items()}
    else:
        sd = hf.llama_megatron_to_hf(mcore_to_legacy(full, "gpt") if mcore else full, hf_config)
    if getattr(hf_config, "tie_word_embeddings", True):
        sd.pop("lm_head.weight", None)
    os.makedirs(save_dir, exist_ok=True)
    hf_config.save_pretrained(save_dir)
    save_file({k: v.contiguous().clone() for k, v in sd.items()}, os.path.join(save_dir, "model.safetensors"),
              metadata={"format": "pt"})

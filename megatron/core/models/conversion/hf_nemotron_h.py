"""Hugging Face ``NemotronHForCausalLM`` (Nemotron-H, Nemotron-Nano-v2, Nemotron-3) <-> megatron-core ``MambaModel``.

The Hugging Face block ``i`` is ``norm`` + ``mixer``, typed by ``layers_block_type`` (``linear_attention`` = ``M``,
``full_attention`` = ``*``, ``mlp`` = ``-``, ``moe`` = ``E``): the hybrid pattern. Weights are copied; only the
attention's q/k/v are fused (Megatron's group-major QKV) and the experts are listed one by one:

==========================================================  =====================================================
Hugging Face (``backbone.`` on disk, ``model.`` in memory)   megatron-core ``decoder.layers.{i}.``
==========================================================  =====================================================
``embeddings.weight``                                        ``embedding.word_embeddings.weight`` (vocab padded)
``layers.{i}.norm.weight``                                   M ``norm.weight``, * ``input_layernorm.weight``,
                                                             - and E ``pre_mlp_layernorm.weight``
``mixer.{in_proj,out_proj}.weight``, ``mixer.conv1d.*``,     ``mixer.`` + the same names (in_proj rows
``mixer.{A_log,D,dt_bias,norm.weight}``                      ``[z; x; B; C; dt]``, conv channels ``[x; B; C]``)
``mixer.{q,k,v}_proj.weight`` / ``mixer.o_proj.weight``      ``self_attention.linear_qkv`` / ``linear_proj``
``mixer.up_proj`` / ``mixer.down_proj``                      ``mlp.linear_fc1`` / ``mlp.linear_fc2``
``mixer.gate.weight``, ``gate.e_score_correction_bias``      ``mlp.router.weight``, ``mlp.router.expert_bias``
``mixer.experts.{e}.{up,down}_proj.weight`` (memory:         ``mlp.experts.local_experts.{e}.linear_fc{1,2}.weight``
                                                             (read also from GroupedMLP's ``weight1`` / ``weight2``)
``experts.up_proj [E, F, in]``, ``down_proj [E, in, F]``)
``mixer.shared_experts.{up,down}_proj.weight``               ``mlp.shared_experts.linear_fc{1,2}.weight``
``mixer.fc{1,2}_latent_proj.weight``                         ``mlp.fc{1,2}_latent_proj.weight``
``norm_f.weight`` / ``lm_head.weight``                       ``decoder.final_norm.weight`` / ``output_layer.weight``
==========================================================  =====================================================

Numerics: the MLPs use ``relu2`` (``--squared-relu``); routing is sigmoid + expert bias, renormalised over the
top k, times ``routed_scaling_factor`` (``--moe-router-topk-scaling-factor``); Hugging Face's attention has no
position embedding (``--position-embedding-type none``). Two differences are refused or bridged: grouped
routing with ``n_group > 1`` (Hugging Face scores a group by its top two, Megatron by its top ``k / groups``) is
refused, and transformers 5 clamps ``Δ >= time_step_min`` where Megatron does not clamp, so a configuration built
from Megatron's flags sets ``time_step_min`` to 1e-9 (the clamp then never binds). The gated group norm's epsilon
is fixed at 1e-5 in Megatron (Hugging Face uses ``layer_norm_epsilon``).
"""
from __future__ import annotations

import re
from typing import Dict

import torch

from megatron.core.activations import squared_relu
from megatron.core.models.conversion.hf_layers import experts_from_hf, experts_to_hf, fuse_qkv, pad_vocab, split_qkv
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.vocab_padding import vocab_size_with_padding

MODEL_TYPE = "nemotron_h"
BLOCK_SYMBOLS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
# transformers' older names of the block types (remote-code configs)
_LEGACY_BLOCKS = {"mamba": "M", "attention": "*"}
EXPORT_TIME_STEP_MIN = 1e-9
_MIXER = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias", "norm.weight", "out_proj.weight")
_FUSED_EXPERTS = re.compile(r"^layers\.(\d+)\.mixer\.experts\.(up_proj|down_proj)$")


def hybrid_pattern(hf_config) -> str:
    """The hybrid layer pattern (``--hybrid-layer-pattern``) of a NemotronH config."""
    blocks = getattr(hf_config, "layers_block_type", None)
    if blocks is None:
        return hf_config.hybrid_override_pattern
    out = []
    for block in blocks:
        symbol = BLOCK_SYMBOLS.get(block, _LEGACY_BLOCKS.get(block))
        if symbol is None:
            raise ValueError(f"NemotronH block type {block!r} has no Megatron layer symbol")
        out.append(symbol)
    return "".join(out)


def _check(hf_config) -> None:
    bad = [name for name in ("use_bias", "mlp_bias", "attention_bias", "mamba_proj_bias")
           if getattr(hf_config, name, False)]
    if bad:
        raise ValueError(f"NemotronH configs with {', '.join(bad)} are not supported (Megatron's hybrid layers have "
                         "no linear biases)")
    if getattr(hf_config, "conv_kernel", 4) != 4 or not getattr(hf_config, "use_conv_bias", True):
        raise ValueError("NemotronH: Megatron's mixer has a 4-tap convolution with a bias (conv_kernel 4, "
                         "use_conv_bias true)")
    if getattr(hf_config, "mlp_hidden_act", "relu2") != "relu2" or getattr(hf_config, "mamba_hidden_act",
                                                                            "silu") != "silu":
        raise ValueError("NemotronH: only mlp_hidden_act relu2 and mamba_hidden_act silu are supported")
    if "E" in hybrid_pattern(hf_config):
        if getattr(hf_config, "n_group", 1) != 1:
            raise ValueError("NemotronH: grouped routing (n_group > 1) scores groups differently in Megatron: "
                             "not supported")
        if not getattr(hf_config, "norm_topk_prob", True) and hf_config.num_experts_per_tok > 1:
            raise ValueError("NemotronH: norm_topk_prob false is not Megatron's sigmoid routing (which "
                             "renormalises the top-k weights)")
    if getattr(hf_config, "num_nextn_predict_layers", 0):
        raise ValueError("NemotronH multi-token-prediction layers (num_nextn_predict_layers) are not converted")


def nemotron_h_config_to_megatron(hf_config, make_vocab_size_divisible_by: int = 128,
                                  tensor_model_parallel_size: int = 1, **config_kwargs) -> TransformerConfig:
    """TransformerConfig computing what ``NemotronHForCausalLM`` computes (the pattern: :func:`hybrid_pattern`)."""
    _check(hf_config)
    pattern = hybrid_pattern(hf_config)
    kwargs = dict(
        num_layers=len(pattern), hidden_size=hf_config.hidden_size, num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads, kv_channels=hf_config.head_dim,
        ffn_hidden_size=hf_config.intermediate_size, layernorm_epsilon=hf_config.layer_norm_epsilon,
        normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=False, activation_func=squared_relu,
        squared_relu=True, bias_gelu_fusion=False, hidden_dropout=0.0,
        attention_dropout=getattr(hf_config, "attention_dropout", 0.0), init_method_std=hf_config.initializer_range,
        tensor_model_parallel_size=tensor_model_parallel_size, is_hybrid_model=True, hybrid_layer_pattern=pattern,
        mamba_state_dim=hf_config.ssm_state_size, mamba_head_dim=hf_config.mamba_head_dim,
        mamba_num_groups=hf_config.n_groups, mamba_num_heads=hf_config.mamba_num_heads,
        padded_vocab_size=vocab_size_with_padding(hf_config.vocab_size, make_vocab_size_divisible_by,
                                                  tensor_model_parallel_size, log=False),
        max_position_embeddings=hf_config.max_position_embeddings, position_embedding_type="none",
        untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", False))
    if "E" in pattern:
        scaling = getattr(hf_config, "routed_scaling_factor", 1.0)
        kwargs.update(
            num_moe_experts=hf_config.n_routed_experts, moe_router_topk=hf_config.num_experts_per_tok,
            moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            moe_shared_expert_intermediate_size=hf_config.moe_shared_expert_intermediate_size or None,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
            moe_router_topk_scaling_factor=None if scaling == 1.0 else float(scaling),
            moe_latent_size=getattr(hf_config, "moe_latent_size", None), moe_aux_loss_coeff=0.0)
    kwargs.update(config_kwargs)
    return TransformerConfig(**kwargs)


def _hf_names(hf_state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Without the ``backbone.`` / ``model.`` prefix, experts one by one (``layers.i.mixer.experts.e.…``)."""
    out = {}
    for key, value in hf_state_dict.items():
        for prefix in ("backbone.", "model."):
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        fused = _FUSED_EXPERTS.match(key)
        if fused:
            for e in range(value.shape[0]):
                out[f"layers.{fused.group(1)}.mixer.experts.{e}.{fused.group(2)}.weight"] = value[e]
        else:
            out[key] = value
    return out


def nemotron_h_hf_to_megatron(hf_state_dict: Dict[str, torch.Tensor], hf_config,
                              padded_vocab_size: int) -> Dict[str, torch.Tensor]:
    """NemotronH state dict (in-memory or on-disk names) -> ``MambaModel`` state dict (TP = 1, SequentialMLP)."""
    _check(hf_config)
    sd = _hf_names(hf_state_dict)
    pattern = hybrid_pattern(hf_config)
    nh, ng = hf_config.num_attention_heads, hf_config.num_key_value_heads
    out = {"embedding.word_embeddings.weight": pad_vocab(sd["embeddings.weight"], padded_vocab_size)}
    for i, symbol in enumerate(pattern):
        src, dst = f"layers.{i}.", f"decoder.layers.{i}."
        mixer = src + "mixer."
        norm = sd[src + "norm.weight"].clone()
        if symbol == "M":
            out[dst + "norm.weight"] = norm
            for name in _MIXER:
                out[dst + "mixer." + name] = sd[mixer + name].clone()
        elif symbol == "*":
            out[dst + "input_layernorm.weight"] = norm
            out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(
                sd[mixer + "q_proj.weight"], sd[mixer + "k_proj.weight"], sd[mixer + "v_proj.weight"], nh, ng)
            out[dst + "self_attention.linear_proj.weight"] = sd[mixer + "o_proj.weight"].clone()
        elif symbol == "-":
            out[dst + "pre_mlp_layernorm.weight"] = norm
            out[dst + "mlp.linear_fc1.weight"] = sd[mixer + "up_proj.weight"].clone()
            out[dst + "mlp.linear_fc2.weight"] = sd[mixer + "down_proj.weight"].clone()
        else:
            out[dst + "pre_mlp_layernorm.weight"] = norm
            out[dst + "mlp.router.weight"] = sd[mixer + "gate.weight"].clone()
            out[dst + "mlp.router.expert_bias"] = sd[mixer + "gate.e_score_correction_bias"].clone()
            experts = range(hf_config.n_routed_experts)
            experts_from_hf(torch.stack([sd[f"{mixer}experts.{e}.up_proj.weight"] for e in experts]),
                            torch.stack([sd[f"{mixer}experts.{e}.down_proj.weight"] for e in experts]),
                            dst + "mlp.", out)
            for hf_name, ours in (("shared_experts.up_proj", "shared_experts.linear_fc1"),
                                  ("shared_experts.down_proj", "shared_experts.linear_fc2"),
                                  ("fc1_latent_proj", "fc1_latent_proj"), ("fc2_latent_proj", "fc2_latent_proj")):
                if f"{mixer}{hf_name}.weight" in sd:
                    out[f"{dst}mlp.{ours}.weight"] = sd[f"{mixer}{hf_name}.weight"].clone()
    out["decoder.final_norm.weight"] = sd["norm_f.weight"].clone()
    if getattr(hf_config, "tie_word_embeddings", False):
        return out
    out["output_layer.weight"] = pad_vocab(sd["lm_head.weight"], padded_vocab_size)
    return out


def nemotron_h_megatron_to_hf(state_dict: Dict[str, torch.Tensor], hf_config) -> Dict[str, torch.Tensor]:
    """``MambaModel`` state dict (TP = 1, SequentialMLP names) -> NemotronH on-disk names (``backbone.``, one
    tensor per expert), vocabulary trimmed to ``hf_config.vocab_size``."""
    _check(hf_config)
    sd, V = state_dict, hf_config.vocab_size
    pattern = hybrid_pattern(hf_config)
    nh, ng = hf_config.num_attention_heads, hf_config.num_key_value_heads
    out = {"backbone.embeddings.weight": sd["embedding.word_embeddings.weight"][:V].clone()}
    for i, symbol in enumerate(pattern):
        src, dst = f"decoder.layers.{i}.", f"backbone.layers.{i}."
        mixer = dst + "mixer."
        if symbol == "M":
            out[dst + "norm.weight"] = sd[src + "norm.weight"].clone()
            for name in _MIXER:
                out[mixer + name] = sd[src + "mixer." + name].clone()
        elif symbol == "*":
            out[dst + "norm.weight"] = sd[src + "input_layernorm.weight"].clone()
            q, k, v = split_qkv(sd[src + "self_attention.linear_qkv.weight"], nh, ng)
            out.update({mixer + "q_proj.weight": q.contiguous(), mixer + "k_proj.weight": k.contiguous(),
                        mixer + "v_proj.weight": v.contiguous()})
            out[mixer + "o_proj.weight"] = sd[src + "self_attention.linear_proj.weight"].clone()
        elif symbol == "-":
            out[dst + "norm.weight"] = sd[src + "pre_mlp_layernorm.weight"].clone()
            out[mixer + "up_proj.weight"] = sd[src + "mlp.linear_fc1.weight"].clone()
            out[mixer + "down_proj.weight"] = sd[src + "mlp.linear_fc2.weight"].clone()
        else:
            out[dst + "norm.weight"] = sd[src + "pre_mlp_layernorm.weight"].clone()
            out[mixer + "gate.weight"] = sd[src + "mlp.router.weight"].clone()
            out[mixer + "gate.e_score_correction_bias"] = sd[src + "mlp.router.expert_bias"].float().clone()
            fc1, fc2, _, _ = experts_to_hf(sd, src + "mlp.", hf_config.n_routed_experts)
            for e in range(hf_config.n_routed_experts):
                out[f"{mixer}experts.{e}.up_proj.weight"] = fc1[e].clone()
                out[f"{mixer}experts.{e}.down_proj.weight"] = fc2[e].clone()
            for hf_name, ours in (("shared_experts.up_proj", "shared_experts.linear_fc1"),
                                  ("shared_experts.down_proj", "shared_experts.linear_fc2"),
                                  ("fc1_latent_proj", "fc1_latent_proj"), ("fc2_latent_proj", "fc2_latent_proj")):
                if f"{src}mlp.{ours}.weight" in sd:
                    out[f"{mixer}{hf_name}.weight"] = sd[f"{src}mlp.{ours}.weight"].clone()
    out["backbone.norm_f.weight"] = sd["decoder.final_norm.weight"].clone()
    if not getattr(hf_config, "tie_word_embeddings", False):
        out["lm_head.weight"] = sd["output_layer.weight"][:V].clone()
    return out


def config_to_hf(config: TransformerConfig):
    """``('nemotron_h', NemotronHConfig fields without the vocabulary)`` of a hybrid TransformerConfig (a model trained
    here), or None for any other config. ``time_step_min`` is 1e-9: Megatron does not clamp Δ (module docstring)."""
    pattern = config.hybrid_layer_pattern
    if not pattern or config.add_bias_linear or config.gated_linear_unit or not config.squared_relu \
            or config.normalization != "RMSNorm" or config.position_embedding_type != "none":
        return None
    pattern = pattern.replace("|", "")
    inverse = {v: k for k, v in BLOCK_SYMBOLS.items()}
    fields = dict(
        hidden_size=config.hidden_size, layers_block_type=[inverse[c] for c in pattern],
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_query_groups,
        head_dim=config.kv_channels, intermediate_size=config.ffn_hidden_size,
        max_position_embeddings=config.max_position_embeddings, layer_norm_epsilon=config.layernorm_epsilon,
        ssm_state_size=config.mamba_state_dim, mamba_head_dim=config.mamba_head_dim, n_groups=config.mamba_num_groups,
        mamba_num_heads=config.mamba_num_heads or 2 * config.hidden_size // config.mamba_head_dim,
        time_step_min=EXPORT_TIME_STEP_MIN, mlp_hidden_act="relu2", use_bias=False, mlp_bias=False,
        attention_bias=False, tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        initializer_range=config.init_method_std)
    if "E" in pattern:
        if config.moe_router_score_function != "sigmoid" or not config.moe_router_enable_expert_bias \
                or config.moe_router_num_groups or config.moe_shared_expert_gate \
                or not config.moe_shared_expert_intermediate_size:
            return None
        fields.update(n_routed_experts=config.num_moe_experts, num_experts_per_tok=config.moe_router_topk,
                      moe_intermediate_size=config.moe_ffn_hidden_size,
                      moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
                      routed_scaling_factor=config.moe_router_topk_scaling_factor or 1.0, norm_topk_prob=True,
                      moe_latent_size=config.moe_latent_size, n_group=1, topk_group=1)
    return MODEL_TYPE, fields

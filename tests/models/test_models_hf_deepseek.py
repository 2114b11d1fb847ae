"""Hugging Face DeepSeek-V3 and DeepSeek-V2(-Lite) <-> our GPTModel (megatron/core/models/conversion/hf_deepseek.py).

Tiny random ``DeepseekV3ForCausalLM`` (query compression, YaRN, a dense first layer then MoE layers: sigmoid routing
with ``e_score_correction_bias``, 4 groups of which 2 are kept, a shared expert, routed scaling 2.5) and
``DeepseekV2ForCausalLM`` (V2-Lite's shape: no query compression, softmax top-k without renormalisation, two shared
experts, YaRN with mscale = mscale_all_dim = 0.707). Their weights go through the bridge into our ``GPTModel``:

* the logits equal transformers' within 1e-5 at TP = 1 and, in one 2-rank launch, at TP = 2 with SP (the layer's
  heads split as Megatron splits them, experts over the expert-TP ranks);
* the export back gives the Hugging Face tensors unchanged, and the configuration round-trips through the
  TransformerConfig (``config_to_hf``);
* DeepSeek-V3's MTP layer as the Hub stores it (``model.layers.{L}.enorm / hnorm / eh_proj / shared_head.norm`` and a
  decoder layer) against transformers' own ``MtpLayer`` around ``DeepseekV3DecoderLayer``: our logged ``mtp_1 loss``
  equals its next-next-token cross entropy and the gradient reaching ``eh_proj`` is ``lambda / D`` times its.
"""
import os

import pytest
import torch

from helpers.dist_harness import run_distributed
from helpers.models_helpers import causal_mask, single_rank, spread_moe_weights  # noqa: F401  (fixture)
from helpers.numerics import rel_err

S, B, VOCAB = 12, 2, 96
TOL = 1e-5


def tiny_hf(family: str):
    """(config, eval-mode model) of a 3-layer random DeepSeek model; router weights and biases spread so that the
    top-k choices are far from ties."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=8,
                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1,
                  max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0,
                  eos_token_id=0, pad_token_id=None)
    torch.manual_seed(0)
    if family == "v3":
        cfg = transformers.DeepseekV3Config(
            q_lora_rank=16, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, num_mtp_layers=1,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "beta_fast": 32, "beta_slow": 1}, **common)
        model = transformers.DeepseekV3ForCausalLM(cfg)
    else:
        cfg = transformers.DeepseekV2Config(
            q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, routed_scaling_factor=1.0,
            topk_method="greedy", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                   "original_max_position_embeddings": 16, "mscale": 0.707,
                                                   "mscale_all_dim": 0.707}, **common)
        model = transformers.DeepseekV2ForCausalLM(cfg)
    spread_moe_weights(model, expert_std=0.1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if "e_score_correction_bias" in name:
                buf.normal_(0, 0.2)
    return cfg, model.eval()


def our_model(config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return GPTModel(config, get_gpt_decoder_block_spec(config), config.padded_vocab_size,
                    config.max_position_embeddings, share_embeddings_and_output_weights=False)


def inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    return ids, torch.arange(S).unsqueeze(0).expand(B, S)


def _convert(family, tp=1, **extra):
    from megatron.core.models.conversion import hf_registry

    cfg, hf = tiny_hf(family)
    bridge = hf_registry.bridge_for(cfg.model_type)
    overrides = bridge.config_kwargs_from_weights(cfg, hf.state_dict().keys())
    config = bridge.config_to_megatron(cfg, make_vocab_size_divisible_by=32, tensor_model_parallel_size=tp,
                                       use_cpu_initialization=True, **overrides, **extra)
    return cfg, hf, bridge, config, bridge.to_megatron(hf.state_dict(), cfg, config.padded_vocab_size)


@pytest.mark.parametrize("family", ["v3", "v2"])
def test_deepseek_logits_equal_transformers_and_export_round_trips(single_rank, family):
    cfg, hf, bridge, config, sd = _convert(family)
    assert config.mtp_num_layers is None  # transformers' model holds no MTP weights: imported without MTP
    model = our_model(config).eval()
    model.load_state_dict(sd)
    ids, pos = inputs()
    with torch.no_grad():
        err = rel_err(model(ids, pos, causal_mask(S))[..., :VOCAB], hf(ids).logits)
    assert err < TOL, (family, err)
    back = bridge.to_hf(model.state_dict(), cfg)
    ref = hf.state_dict()
    assert set(back) == set(ref), set(back) ^ set(ref)
    assert all(torch.equal(back[k], ref[k].to(back[k].dtype)) for k in ref)
    model_type, fields = bridge.config_to_hf(config)
    assert model_type == cfg.model_type
    assert fields.pop("num_mtp_layers", 0) == 0  # imported without the MTP layer the file lacks
    for key, value in fields.items():
        theirs = getattr(cfg, key)
        if key == "rope_parameters":  # (the export also spells out the default betas)
            value = {k: v for k, v in value.items() if k in theirs}
        assert theirs == value or float(theirs) == float(value), (key, theirs, value)
    print(family, "TP=1 logits relative error", err)


def _tp2_body():
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.conversion.tp import split_tensor_parallel

    ps.initialize_model_parallel(2, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    errs = {}
    for family in ("v3", "v2"):
        cfg, hf, _, config, sd = _convert(family, tp=2, sequence_parallel=True)
        model = our_model(config).eval()
        model.load_state_dict(split_tensor_parallel(sd, 2, True)[ps.get_tensor_model_parallel_rank()])
        ids, pos = inputs()
        with torch.no_grad():
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(model(ids, pos, causal_mask(S)))
            errs[family] = rel_err(logits[..., :VOCAB], hf(ids).logits)
    return errs


def test_deepseek_tp2_sp_logits_equal_transformers():
    for rank, errs in enumerate(run_distributed(_tp2_body, 2, timeout=180)):
        assert max(errs.values()) < TOL, (rank, errs)
    print("TP=2 + SP logits relative error", errs)


def test_deepseek_v3_mtp_layer_equals_transformers_mtp_layer(single_rank):
    """The Hub's MTP layer (transformers' MtpLayer around DeepseekV3DecoderLayer, renamed to the Hub's keys) ->
    our mtp.layers.0: the same depth-1 loss, and lambda / D times its gradient in eh_proj."""
    from megatron.core.models.conversion import hf_deepseek

    cfg, hf = tiny_hf("v3")
    L = cfg.num_hidden_layers
    mtp, layer = _mtp_layer(cfg)
    hub = dict(hf.state_dict(), **layer)
    hub[f"model.layers.{L}.embed_tokens.weight"] = hub["model.embed_tokens.weight"]
    hub[f"model.layers.{L}.shared_head.head.weight"] = hub["lm_head.weight"]
    assert hf_deepseek.config_kwargs_from_weights(cfg, hub.keys()) == {}
    config = hf_deepseek.config_to_megatron(cfg, make_vocab_size_divisible_by=32, use_cpu_initialization=True,
                                            mtp_loss_scaling_factor=0.3)
    assert config.mtp_num_layers == 1
    ours = our_model(config).train()
    sd = hf_deepseek.to_megatron(hub, cfg, config.padded_vocab_size)
    ours.load_state_dict(sd)
    assert set(hf_deepseek.to_hf(ours.state_dict(), cfg)) == set(hub)

    ids, pos = inputs()
    labels = torch.roll(ids, -1, dims=1)
    loss_mask = torch.ones(B, S)
    loss_mask[:, -1] = 0
    loss = ours(ids, pos, causal_mask(S), labels=labels, loss_mask=loss_mask)
    (loss * loss_mask).sum().backward()

    # transformers: depth 1 from the main model's normalised last hidden state and the tokens shifted by one.
    h0 = hf.model(ids).last_hidden_state
    rolled = torch.roll(ids, -1, dims=1)
    emb = hf.model.embed_tokens(rolled)
    mask = torch.full((S, S), float("-inf")).triu(1).expand(B, 1, S, S)
    h1 = mtp(emb, h0, hf.model.rotary_emb(emb, pos), mask, pos, None)
    logits = hf.lm_head(h1)
    ce = torch.nn.functional.cross_entropy(logits[:, : S - 2].reshape(-1, VOCAB), ids[:, 2:].reshape(-1))
    ce.backward()
    assert rel_err(ours.mtp.tracked_losses[0], ce) < TOL, (float(ours.mtp.tracked_losses[0]), float(ce))
    ours_grad = ours.mtp.layers[0].eh_proj.weight.grad
    assert rel_err(ours_grad, 0.3 * mtp.eh_proj.weight.grad) < 1e-4
    print("MTP depth-1 loss", float(ce), "relative error", rel_err(ours.mtp.tracked_losses[0], ce))


def _mtp_layer(cfg):
    """transformers' MtpLayer around DeepseekV3DecoderLayer, randomly initialised, and its tensors under the Hub's
    names of depth 1 (``model.layers.{L}.*``; the shared embedding and head are added by the caller)."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    L = cfg.num_hidden_layers
    torch.manual_seed(2)
    mtp = MtpLayer(cfg, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, L)
    with torch.no_grad():  # (transformers leaves the expert tensors uninitialised outside from_pretrained)
        for name, p in mtp.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.5 if "gate.weight" in name else 0.1)
    hub = {f"model.layers.{L}.{name.replace('mtp_block.', '').replace('post_norm.', 'shared_head.norm.')}": t
           for name, t in mtp.state_dict().items()}
    return mtp, hub


def test_deepseek_converter_round_trip_through_torch_dist(tmp_path, single_rank):
    """tools/checkpoint/convert.py --loader hf --saver torch_dist and back, for V3 with its MTP layer in the file (the
    Hub's layout) and for V2-Lite's shape: the torch_dist checkpoint has Megatron's keys (per-layer, as the first layer
    is dense; TE's latent-norm names; mtp.layers.0.*), loads into our GPTModel with transformers' logits, and the
    export back holds the original tensors and loads in transformers with the same logits."""
    import transformers
    from safetensors.torch import load_file, save_file

    from megatron.core.models.conversion import hf_deepseek
    from megatron.training.checkpointing.torch_dist import load_full_checkpoint
    from tools.checkpoint import convert
    from tools.checkpoint.dist_io import load_dist

    for family in ("v3", "v2"):
        cfg, hf = tiny_hf(family)
        src, dist, back = (str(tmp_path / f"{family}_{n}") for n in ("hf", "dist", "back"))
        hf.save_pretrained(src, safe_serialization=True)  # (the Hub's per-expert names on disk)
        original = dict(hf.state_dict())  # transformers' in-memory names, which the export writes
        if family == "v3":
            _, hub = _mtp_layer(cfg)
            L = cfg.num_hidden_layers
            hub[f"model.layers.{L}.embed_tokens.weight"] = original["model.embed_tokens.weight"].clone()
            hub[f"model.layers.{L}.shared_head.head.weight"] = original["lm_head.weight"].clone()
            original.update(hub)
            on_disk = load_file(os.path.join(src, "model.safetensors"))
            on_disk.update({k: v.contiguous() for k, v in hub.items()})
            save_file(on_disk, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
        for loader, saver, a, b in (("hf", "torch_dist", src, dist), ("torch_dist", "hf", dist, back)):
            convert.convert(convert.get_args(["--model-type", "GPT", "--loader", loader, "--saver", saver,
                                              "--load-dir", a, "--save-dir", b]))
        stored = load_full_checkpoint(os.path.join(dist, "release"))["model"]
        assert "decoder.layers.0.input_layernorm.weight" in stored
        assert "decoder.layers.1.pre_mlp_layernorm.weight" in stored
        assert stored["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"].shape == (8, 32, 32)
        assert "decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight" in stored
        assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in stored
        assert ("mtp.layers.0.transformer_layer.mlp.router.expert_bias" in stored) == (family == "v3")
        exported = load_file(os.path.join(back, "model.safetensors"))
        assert set(exported) == set(original), set(exported) ^ set(original)
        assert all(torch.equal(exported[k], original[k].to(exported[k].dtype)) for k in original)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
        full, _, _ = load_dist(dist)
        config = hf_deepseek.config_to_megatron(cfg, make_vocab_size_divisible_by=128, use_cpu_initialization=True,
                                                **hf_deepseek.config_kwargs_from_weights(cfg, original.keys()))
        ours = our_model(config).eval()
        ours.load_state_dict({k: v for k, v in full.items() if not k.endswith("_extra_state")})
        ids, pos = inputs()
        with torch.no_grad():
            ref = hf(ids).logits
            errs = (rel_err(reloaded(ids).logits, ref), rel_err(ours(ids, pos, causal_mask(S))[..., :VOCAB], ref))
        assert max(errs) < TOL, (family, errs)
        print(family, "converted: transformers reload / our torch_dist model logits relative error", errs)


def test_unmappable_deepseek_configs_are_refused_in_one_line():
    import transformers

    from megatron.core.models.conversion import hf_deepseek

    base = dict(hidden_size=32, num_attention_heads=4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8, num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8, moe_intermediate_size=8)
    cases = [
        (transformers.DeepseekV3Config(norm_topk_prob=False, **base), "renormalisation"),
        (transformers.DeepseekV3Config(num_experts_per_tok=4, n_group=4, topk_group=1, **base), "top-2"),
        (transformers.DeepseekV3Config(attention_bias=True, **base), "biases"),
        (transformers.DeepseekV2Config(topk_method="group_limited_greedy", num_experts_per_tok=4, n_group=4,
                                       topk_group=2, **base), "best expert"),
        (transformers.DeepseekV3Config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                                       **base), "'linear' is not supported"),
    ]
    for cfg, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            hf_deepseek.config_to_megatron(cfg)
        assert "\n" not in str(info.value)

"""Hybrid Mamba models (Nemotron-H): the chunked SSD scan against the step-by-step recurrence in float64, the causal
conv against its definition, the hybrid pattern's pipeline split, and Hugging Face ``NemotronHForCausalLM``
through ``tools/checkpoint/convert.py``: HF -> torch_dist (Megatron's per-layer keys, written out here from the
format) -> our MambaModel gives transformers' logits; torch_dist -> HF is exact and reloads with equal logits; a
configuration built from Megatron's flags exports a model transformers computes the same way."""
import os

import pytest
import torch

from helpers.hybrid_helpers import HF_VOCAB, convert, hf_to_torch_dist, ids, tiny_hf_nemotron_h
from helpers.models_helpers import single_rank  # noqa: F401  (fixture)
from helpers.numerics import rel_err

from megatron.core.ssm.ssd_chunked_scan import causal_depthwise_conv1d, ssd_chunked_scan, ssd_recurrence


def _scan_inputs(b=2, T=37, H=4, P=3, G=2, N=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)
    x = torch.randn(b, T, H, P, generator=g, **f64)
    dt = torch.nn.functional.softplus(torch.randn(b, T, H, generator=g, **f64))
    A = -torch.exp(torch.randn(H, generator=g, **f64))
    B, C = torch.randn(b, T, G, N, generator=g, **f64), torch.randn(b, T, G, N, generator=g, **f64)
    D = torch.randn(H, generator=g, **f64)
    return x, dt, A, B, C, D, torch.randn(b, H, P, N, generator=g, **f64)


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_ssd_chunked_scan_equals_recurrence_float64(chunk):
    """Chunk sizes below, dividing, not dividing and above the length 37, with an initial state: outputs, final
    state and the gradients of every input equal the plain loop to float64 rounding."""
    inputs = [t.requires_grad_() for t in _scan_inputs()]
    x, dt, A, B, C, D, s0 = inputs
    y, s = ssd_chunked_scan(x, dt, A, B, C, D, chunk_size=chunk, initial_state=s0, return_final_state=True)
    y_ref, s_ref = ssd_recurrence(x, dt, A, B, C, D, initial_state=s0)
    assert (y - y_ref).abs().max().item() < 1e-12 and (s - s_ref).abs().max().item() < 1e-12
    weights = torch.randn_like(y_ref)
    grads = torch.autograd.grad((y * weights).sum() + s.sum(), inputs)
    grads_ref = torch.autograd.grad((y_ref * weights).sum() + s_ref.sum(), inputs)
    for got, want in zip(grads, grads_ref):
        assert (got - want).abs().max().item() < 1e-10


def test_causal_conv1d_is_its_definition():
    g = torch.Generator().manual_seed(1)
    x, w, bias = torch.randn(2, 3, 9, generator=g), torch.randn(3, 1, 4, generator=g), torch.randn(3, generator=g)
    out = causal_depthwise_conv1d(x, w, bias)
    padded = torch.nn.functional.pad(x, (3, 0))
    want = torch.stack([bias[None, :] + sum(w[:, 0, j] * padded[:, :, t + j] for j in range(4)) for t in range(9)], -1)
    assert torch.allclose(out, want, atol=1e-6)


def test_hybrid_pattern_pipeline_split():
    from megatron.core.ssm.mamba_hybrid_layer_allocation import (HybridPatternError, layers_of_stage,
                                                                  parse_hybrid_pattern, virtual_pipeline_size)

    p = parse_hybrid_pattern("M-|M*E|-|MM")
    assert p.num_layers == 9 and p.layers == "M-M*E-MM" + "" or p.layers == "M-M*E-MM"
    assert virtual_pipeline_size(p, 2) == 2 and virtual_pipeline_size(p, 4) is None
    # rank (pp, vp) builds segment vp * PP + pp; its offset counts the characters of the earlier segments
    assert [layers_of_stage(p, 2, r, v) for v in (0, 1) for r in (0, 1)] == [(0, "M-"), (2, "M*E"), (5, "-"),
                                                                              (6, "MM")]
    assert layers_of_stage(parse_hybrid_pattern("M*-EM-"), 3, 2) == (4, "M-")
    for bad, words in (("M*x", "unknown layer symbol"), ("MG", "Gated DeltaNet"), ("M-/M*", "multi-token"),
                       ("M||M", "empty")):
        with pytest.raises(HybridPatternError, match=words):
            parse_hybrid_pattern(bad)
    with pytest.raises(HybridPatternError, match="not a multiple"):
        virtual_pipeline_size(parse_hybrid_pattern("M|M|M"), 2)


def _expected_keys(pattern="M*E-M", experts=4):
    """torch_dist keys of a MambaModel, written from Megatron's format: per-layer keys, the norm fused into the next
    linear layer's name, in_proj split into z/x/B/C/dt, the conv into x/B/C, experts with an expert axis."""
    keys = {"embedding.word_embeddings.weight", "decoder.final_norm.weight", "output_layer.weight",
            "output_layer._extra_state/shard_0_1"}
    per_type = {
        "M": ["mixer.in_proj.layer_norm_weight"] + [f"mixer.in_proj.weight.{p}" for p in ("z", "x", "B", "C", "dt")]
             + [f"mixer.conv1d.{w}.{p}" for w in ("weight", "bias") for p in ("x", "B", "C")]
             + ["mixer.A_log", "mixer.D", "mixer.dt_bias", "mixer.norm.weight", "mixer.out_proj.weight"],
        "*": ["self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
              "self_attention.linear_proj.weight"],
        "-": ["mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"],
        "E": ["pre_mlp_layernorm.weight", "mlp.router.weight", "mlp.router.expert_bias",
              "mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc2.weight",
              "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight",
              "mlp.fc1_latent_proj.weight", "mlp.fc2_latent_proj.weight"],
    }
    linears = {"M": ["mixer.in_proj", "mixer.out_proj"],
               "*": ["self_attention.linear_qkv", "self_attention.linear_proj"], "-": ["mlp.linear_fc1", "mlp.linear_fc2"],
               "E": ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2", "mlp.fc1_latent_proj",
                     "mlp.fc2_latent_proj"]}
    for i, symbol in enumerate(pattern):
        keys |= {f"decoder.layers.{i}.{k}" for k in per_type[symbol]}
        keys |= {f"decoder.layers.{i}.{k}._extra_state/shard_0_1" for k in linears[symbol]}
        if symbol == "E":
            keys |= {f"decoder.layers.{i}.mlp.experts.experts.linear_fc{n}._extra_state/shard_{e}_{experts}"
                     for n in (1, 2) for e in range(experts)}
    return keys


@pytest.fixture(scope="module")
def hf_model():
    pytest.importorskip("transformers")
    return tiny_hf_nemotron_h()


def test_nemotron_h_hf_torch_dist_round_trip(tmp_path, hf_model, single_rank):
    import json

    import transformers
    from safetensors.torch import load_file

    from megatron.core.models.conversion import hf_nemotron_h
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba.mamba_layer_specs import get_mamba_stack_spec
    from megatron.training.checkpointing.torch_dist import load_full_checkpoint
    from tools.checkpoint.dist_io import load_dist

    cfg, model = hf_model
    dist = hf_to_torch_dist(model, str(tmp_path))
    ckpt = load_full_checkpoint(os.path.join(dist, "release"))
    with open(os.path.join(dist, "release", ".metadata"), "rb") as f:  # every key the format file declares
        stored = set(_metadata_keys(f))
    assert stored == _expected_keys(), stored ^ _expected_keys()
    shapes = {k: tuple(v.shape) for k, v in ckpt["model"].items() if torch.is_tensor(v)}
    assert shapes["decoder.layers.0.mixer.in_proj.weight.z"] == (64, 32)   # d_inner = 8 heads x 8
    assert shapes["decoder.layers.0.mixer.in_proj.weight.B"] == (16, 32)   # 2 groups x state 8
    assert shapes["decoder.layers.0.mixer.in_proj.weight.dt"] == (8, 32)
    assert shapes["decoder.layers.0.mixer.conv1d.weight.x"] == (64, 1, 4)
    assert shapes["decoder.layers.2.mlp.experts.experts.linear_fc1.weight"] == (4, 16, 16)  # [E, F, latent]
    a = ckpt["args"]
    assert (a.hybrid_layer_pattern, a.is_hybrid_model, a.mamba_num_heads, a.mamba_head_dim, a.mamba_num_groups,
            a.mamba_state_dim, a.moe_latent_size, a.moe_router_topk_scaling_factor) == ("M*E-M", True, 8, 8, 2, 8,
                                                                                        16, 2.5)

    # --use-checkpoint-args takes the hybrid shape from the checkpoint.
    import argparse

    from megatron.training.checkpointing import load_args_from_checkpoint
    args, _ = load_args_from_checkpoint(argparse.Namespace(load=dist, ckpt_step=None, hybrid_layer_pattern=None,
                                                           mamba_num_heads=None, mamba_head_dim=64, squared_relu=False))
    assert (args.hybrid_layer_pattern, args.mamba_num_heads, args.mamba_head_dim, args.squared_relu,
            args.moe_latent_size) == ("M*E-M", 8, 8, True, 16)

    # The torch_dist checkpoint in our MambaModel computes transformers' logits.
    full, _, _ = load_dist(dist)
    config = hf_nemotron_h.nemotron_h_config_to_megatron(cfg, use_cpu_initialization=True)
    ours = MambaModel(config, get_mamba_stack_spec(), config.padded_vocab_size, 64,
                      hybrid_layer_pattern=hf_nemotron_h.hybrid_pattern(cfg)).eval()
    ours.load_state_dict(full)
    # The modules declare the same checkpoint (sharded_state_dict): keys, global shapes and values.
    declared = _declared(ours)
    assert set(declared) == stored, set(declared) ^ stored
    for key, value in ckpt["model"].items():
        if torch.is_tensor(value):
            assert torch.equal(declared[key], value), key
    tokens = ids()
    with torch.no_grad():
        ref = model(tokens).logits
        err = rel_err(ours(tokens, None, None)[..., :HF_VOCAB], ref)
    print(f"NemotronH logits, our MambaModel (TP=1) vs transformers: max rel err {err:.2e}")
    assert err <= 1e-5, err

    # torch_dist -> HF: the file transformers wrote, tensor for tensor; it reloads with the same logits.
    back = str(tmp_path / "back")
    convert("--loader", "torch_dist", "--saver", "hf", "--load-dir", dist, "--save-dir", back)
    written, original = (load_file(os.path.join(d, "model.safetensors")) for d in (back, str(tmp_path / "hf")))
    assert set(written) == set(original), set(written) ^ set(original)
    assert all(torch.equal(written[k], original[k]) for k in original)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(reloaded).__name__ == "NemotronHForCausalLM"
    with torch.no_grad():  # (transformers may pick another experts implementation for a loaded model: rounding)
        err = rel_err(reloaded(tokens).logits, ref)
    assert err <= 1e-6, err

    # A checkpoint trained here has no Hugging Face config: the export builds one from the Megatron flags.
    from tools.checkpoint.hf_io import save_hf

    full, margs, _ = load_dist(dist)
    del margs.hf_config
    save_hf(full, margs, str(tmp_path / "from_args"), true_vocab_size=HF_VOCAB)
    exported = json.load(open(tmp_path / "from_args" / "config.json"))
    assert exported["layers_block_type"] == cfg.layers_block_type and exported["time_step_min"] == 1e-9
    rebuilt = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "from_args")).eval()
    with torch.no_grad():
        err = rel_err(rebuilt(tokens).logits, ref)
    assert err <= 1e-6, err


def _declared(model):
    """{checkpoint key: tensor (the whole global one at TP = 1) or None (objects)} of ``model.sharded_state_dict()``."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    out = {}
    for leaf in nested_values(sharded):
        if isinstance(leaf, ShardedObject):
            out[leaf.unique_key] = None
        elif isinstance(leaf, ShardedTensor):
            if leaf.global_shape == leaf.local_shape:
                out[leaf.key] = leaf.data
            else:  # experts: one [1, ...] piece per expert
                whole = out.setdefault(leaf.key, torch.zeros(leaf.global_shape, dtype=leaf.data.dtype))
                whole[tuple(slice(o, o + n) for o, n in zip(leaf.global_offset, leaf.local_shape))] = leaf.data
    return out


def _metadata_keys(f):
    import pickle

    metadata = pickle.load(f)
    return metadata.state_dict_metadata.keys()

"""Hugging Face bridges of today's transformer families (Qwen2 / Qwen2.5, Qwen3, Qwen3-MoE, Llama 3.x with its RoPE
scaling, gpt-oss, Llama 4 text): a tiny random ``transformers`` model of each (tests/helpers/hf_zoo.py) converts with
tools/checkpoint/convert.py to torch_dist; that checkpoint in our megatron-core GPTModel gives HF's logits at TP=1
and, in one 2-rank launch, at TP=2 with sequence parallelism (the MoE also at EP=2; Llama 4 with Maverick's
interleaved dense / MoE layers, stored per layer, also at TP=1), fp32 within 1e-5; it exports back
to files ``transformers`` loads as the same class with equal tensors and logits, also from a checkpoint whose args hold
no HF config (the family is recognised from the model's shape). Configurations a family's bridge cannot map are
refused with one line."""
import os

import pytest
import torch

from helpers import hf_zoo
from helpers.dist_harness import run_distributed
from helpers.models_helpers import single_rank  # noqa: F401  (fixture)
from helpers.numerics import rel_err

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

FAMILY_NAMES = list(hf_zoo.FAMILIES)
MEASURED = {}  # (family, layout) -> max relative logit difference, printed at the end of the module


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """family -> (HF model, its directory root holding hf/ and dist/, reference logits)."""
    out = {}
    for family in FAMILY_NAMES:
        root = str(tmp_path_factory.mktemp(family))
        model = hf_zoo.tiny_hf(family)
        model.save_pretrained(os.path.join(root, "hf"))
        hf_zoo.convert("--loader", "hf", "--saver", "torch_dist", "--load-dir", os.path.join(root, "hf"),
                       "--save-dir", os.path.join(root, "dist"))
        with torch.no_grad():
            out[family] = (model, root, model(hf_zoo.inputs()).logits)
    yield out
    print("HF logit max relative difference:", {f"{f}/{layout}": f"{e:.1e}" for (f, layout), e in MEASURED.items()})


def _hf_state(model):
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_hf_torch_dist_round_trip_tp1(zoo, single_rank, family):
    from tools.checkpoint.dist_io import load_dist
    from tools.checkpoint.hf_io import save_hf

    model, root, ref = zoo[family]
    ours = hf_zoo.gpt_model(hf_zoo.megatron_config(model.config))
    hf_zoo.load_torch_dist(ours, os.path.join(root, "dist"))
    MEASURED[(family, "tp1")] = err = rel_err(hf_zoo.logits(ours, hf_zoo.inputs()), ref)
    assert err <= 1e-5, f"{family}: logits differ from HF by {err:.2e}"

    back = os.path.join(root, "back")
    hf_zoo.convert("--loader", "torch_dist", "--saver", "hf", "--load-dir", os.path.join(root, "dist"),
                   "--save-dir", back)
    written, expected = load_file(os.path.join(back, "model.safetensors")), _hf_state(model)
    assert set(written) == set(expected), set(written) ^ set(expected)
    assert all(torch.equal(written[k], expected[k]) for k in expected)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(reloaded).__name__ == hf_zoo.FAMILIES[family][0]
    with torch.no_grad():
        assert torch.equal(reloaded(hf_zoo.inputs()).logits, ref)

    # A checkpoint trained here holds no HF config: the family comes from the model's shape (the flags).
    full, margs, _ = load_dist(os.path.join(root, "dist"))
    margs.hf_config = margs.hf_model_type = None
    save_hf(full, margs, os.path.join(root, "from_args"), true_vocab_size=hf_zoo.VOCAB)
    rebuilt = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, "from_args")).eval()
    assert type(rebuilt).__name__ == hf_zoo.FAMILIES[family][0]
    with torch.no_grad():
        assert rel_err(rebuilt(hf_zoo.inputs()).logits, ref) <= 1e-6


def test_llama3_rope_scaling_is_applied(zoo, single_rank):
    """Llama 3's frequency scaling changes only the slow frequencies, whose angles are small over a short sequence:
    the rotary frequencies of the converted model are HF's (1e-6), and a third of them differ from the unscaled
    ones, so the parity above checks the scaling and not a no-op."""
    model, _, _ = zoo["llama"]
    config = hf_zoo.megatron_config(model.config)
    assert config.use_rope_scaling and config.rope_scaling_factor == 32.0 and config.rotary_base == 500000
    ours = hf_zoo.gpt_model(config).rotary_pos_emb.inv_freq
    theirs = model.model.rotary_emb.inv_freq
    assert rel_err(ours, theirs) <= 1e-6
    plain = 1.0 / (config.rotary_base ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert int(((ours - plain).abs() > 0.1 * plain).sum()) >= 3


def test_gpt_oss_yarn_is_applied(zoo, single_rank):
    """gpt-oss's YaRN (frequencies and attention concentration 1 + 0.1 ln 32): plain RoPE gives other logits."""
    import dataclasses

    model, root, ref = zoo["gpt_oss"]
    config = hf_zoo.megatron_config(model.config)
    assert (config.position_embedding_type, config.rotary_scaling_factor, config.original_max_position_embeddings,
            config.yarn_correction_range_round_to_int) == ("yarn", 32.0, 128, False)
    plain = hf_zoo.gpt_model(dataclasses.replace(config, position_embedding_type="rope"))
    hf_zoo.load_torch_dist(plain, os.path.join(root, "dist"))
    assert rel_err(hf_zoo.logits(plain, hf_zoo.inputs()), ref) > 1e-3


def tp2_body(cases):
    """Per case and layout (TP=2 + SP; MoE also EP=2): build, load the torch_dist checkpoint, max relative error."""
    import types

    from megatron.core import parallel_state, tensor_parallel

    out = {}
    for family, hf_config, checkpoint, ref in cases:
        hf_config = types.SimpleNamespace(**hf_config)  # the config's fields (the ranks need not import transformers)
        moe = "num_local_experts" in hf_config.__dict__
        # Maverick's mixed dense / MoE stack is stored per layer (heterogeneous layout): also checked at TP=1.
        layouts = ([("tp1", 1, 1)] if family == "llama4_text_interleaved" else []) + [("tp2_sp", 2, 1)] + (
            [("ep2", 1, 2)] if moe else [])
        for name, tp, ep in layouts:
            # Expert biases (gpt-oss) need expert tensor parallel size 1 (Megatron's rule).
            etp = 1 if family == "gpt_oss" else tp
            parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep,
                                                     expert_tensor_parallel_size=etp)
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
            try:
                config = hf_zoo.megatron_config(hf_config, tp=tp, sequence_parallel=tp > 1,
                                                expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
                model = hf_zoo.gpt_model(config)
                hf_zoo.load_torch_dist(model, checkpoint)
                out[(family, name)] = rel_err(hf_zoo.logits(model, hf_zoo.inputs()), ref)
            finally:
                parallel_state.destroy_model_parallel()
    return out


def test_hf_logits_at_tp2_and_ep2(zoo, tmp_path):
    cases = [(f, model.config.to_dict(), os.path.join(root, "dist"), ref) for f, (model, root, ref) in zoo.items()]
    maverick = hf_zoo.tiny_hf("llama4_text", **hf_zoo.LLAMA4_INTERLEAVED)  # Llama 4 Maverick's dense / MoE layers
    with torch.no_grad():
        ref = maverick(hf_zoo.inputs()).logits
    maverick.save_pretrained(str(tmp_path / "hf"))
    hf_zoo.convert("--loader", "hf", "--saver", "torch_dist", "--load-dir", str(tmp_path / "hf"),
                   "--save-dir", str(tmp_path / "dist"))
    cases.append(("llama4_text_interleaved", maverick.config.to_dict(), str(tmp_path / "dist"), ref))
    results = run_distributed(tp2_body, 2, cases, timeout=240)
    assert results[0] == results[1]  # every rank gathered the same logits
    for key, err in results[0].items():
        MEASURED[key] = err
        assert err <= 1e-5, f"{key}: logits differ from HF by {err:.2e}"
    assert {layout for _, layout in results[0]} == {"tp1", "tp2_sp", "ep2"}
    assert ("llama4_text_interleaved", "ep2") in results[0]


@pytest.mark.parametrize("family,overrides,message", [
    ("llama", dict(rope_parameters=dict(hf_zoo.LLAMA3_ROPE, low_freq_factor=2.0)),
     "llama3 RoPE scaling with {'low_freq_factor': 2.0}: Megatron's --use-rope-scaling fixes"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=4), "qwen2 with use_sliding_window is not supported"),
    ("qwen3", dict(attention_bias=True), "qwen3 with attention_bias (q/k/v/o biases, no MLP bias) has no Megatron"),
    ("qwen3_moe", dict(mlp_only_layers=[0]), "Qwen3-MoE configurations with dense layers"),
])
def test_unmappable_configurations_are_refused(tmp_path, family, overrides, message):
    from tools.checkpoint.legacy_io import ConversionError

    hf_zoo.tiny_hf(family, **overrides).save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(ConversionError) as error:
        hf_zoo.convert("--loader", "hf", "--saver", "torch_dist", "--load-dir", str(tmp_path / "hf"),
                       "--save-dir", str(tmp_path / "out"))
    assert message in str(error.value) and "\n" not in str(error.value)

"""gpt-oss's and Llama 4's building blocks against their definitions and against Hugging Face's own code: the
sliding-window mask and the layers --window-attn-skip-freq selects, attention sinks (the softmax with a sink column,
off-by-one = a zero learnable sink), the quick-GeGLU gate with offset and clamp (vs transformers'
GptOssExperts._apply_gate on the interleaved layout); Llama 4's NoPE layers (= HF no_rope_layers), QK L2 norm (vs
Llama4TextL2Norm, and where HF applies it), the interleaved dense / MoE layout (Maverick's shape) vs
Llama4ForCausalLM; the flags reaching TransformerConfig, and the one-line refusals."""
import dataclasses

import pytest
import torch

from helpers import hf_zoo
from helpers.args_test_helpers import clean_env, validated  # noqa: F401  (fixture)
from helpers.models_helpers import single_rank  # noqa: F401  (fixture)
from helpers.numerics import rel_err

from megatron.core.transformer.attention_variants import attention_with_sinks, window_mask
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.errors import ConfigurationError


def test_window_mask_is_the_band_definition():
    for window, sq, skv in (((3, 0), 7, 7), ((2, 1), 5, 5), ((-1, 0), 4, 4), ((1, -1), 3, 6)):
        mask = window_mask(sq, skv, window)
        for i in range(sq):
            pos = i + skv - sq
            for j in range(skv):
                visible = (window[0] < 0 or j >= pos - window[0]) and (window[1] < 0 or j <= pos + window[1])
                assert bool(mask[i, j]) == (not visible), (window, i, j)


def test_window_layers_follow_skip_freq():
    from helpers.models_helpers import tiny_config

    cfg = tiny_config(num_layers=4, window_size=(127, 0), window_attn_skip_freq=2)
    assert [cfg.is_window_attention_layer(n) for n in range(1, 5)] == [True, False, True, False]  # = HF layer_types
    cfg = tiny_config(num_layers=4, window_size=(127, 0), window_attn_skip_freq=[0, 0, 1, 1])
    assert [cfg.is_window_attention_layer(n) for n in range(1, 5)] == [False, False, True, True]
    assert all(tiny_config(num_layers=4, window_size=(3, 0)).is_window_attention_layer(n) for n in range(1, 5))
    assert not tiny_config(num_layers=4).is_window_attention_layer(1)


def test_attention_with_sinks_is_the_sink_softmax():
    """p_ij = exp(a_ij) / (sum_k exp(a_ik) + exp(s_h)) in float64 from the definition."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g) for _ in range(3))
    sinks = torch.randn(3, generator=g)
    hidden = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
    out = attention_with_sinks(q, k, v, hidden, sinks)
    a = (q.double() @ k.double().transpose(-1, -2)) / 2.0
    e = torch.exp(a).masked_fill(hidden, 0.0)
    p = e / (e.sum(-1, keepdim=True) + torch.exp(sinks.double()).view(1, 3, 1, 1))
    assert rel_err(out, p @ v.double()) <= 1e-6
    assert float(p.sum(-1).max()) < 1.0  # the sink takes a share of every row


def test_off_by_one_equals_a_zero_learnable_sink(single_rank):
    model = hf_zoo.tiny_hf("gpt_oss")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.zero_()
        ref = model(hf_zoo.inputs()).logits
    from megatron.core.models.conversion import hf_registry

    config = dataclasses.replace(hf_zoo.megatron_config(model.config), softmax_type="off-by-one")
    sd = hf_registry.bridge_for("gpt_oss").to_megatron(model.state_dict(), model.config, config.padded_vocab_size)
    sd = {k: v for k, v in sd.items() if not k.endswith("softmax_offset")}  # a buffer, not saved
    ours = hf_zoo.gpt_model(config)
    ours.load_state_dict(sd)
    assert "decoder.layers.0.self_attention.core_attention.softmax_offset" not in ours.state_dict()
    assert rel_err(hf_zoo.logits(ours, hf_zoo.inputs()), ref) <= 1e-5


def test_quick_geglu_gate_equals_hugging_face(single_rank):
    """Our gate on [gate | linear] halves = transformers' GptOssExperts._apply_gate on the interleaved layout."""
    from megatron.core.activations import quick_gelu
    from megatron.core.models.conversion.hf_gpt_oss import _deinterleave
    from megatron.core.transformer.mlp import glu_activation

    model = hf_zoo.tiny_hf("gpt_oss", swiglu_limit=0.5)
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(2))  # values beyond the clamp on both sides
    config = hf_zoo.megatron_config(model.config)
    assert config.activation_func is quick_gelu and config.glu_linear_offset == 1.0
    assert config.activation_func_clamp_value == 0.5
    ours = glu_activation(config)(_deinterleave(x, 1))
    assert rel_err(ours, experts._apply_gate(x)) <= 1e-6


def test_gpt_oss_flags_reach_the_config(clean_env):
    args = validated("--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 --softmax-type learnable "
                     "--window-size 127,0 --window-attn-skip-freq 2")
    config = core_transformer_config_from_args(args)
    assert config.gated_linear_unit and config.activation_func.__name__ == "quick_gelu"
    assert (config.glu_linear_offset, config.activation_func_clamp_value, config.softmax_type) == (1.0, 7.0, "learnable")
    assert config.window_size == (127, 0) and config.window_attn_skip_freq == 2
    assert validated("--window-size 3,-1 --window-attn-skip-freq ([1]*2+[0]*2)").window_attn_skip_freq == [1, 1, 0, 0]


@pytest.mark.parametrize("extra,world,message", [
    ("--window-size 127,0 --context-parallel-size 2", 2,
     "--window-size (127, 0) with --context-parallel-size 2 is not implemented yet in this library"),
    ("--softmax-type learnable --context-parallel-size 2", 2,
     "--softmax-type learnable with --context-parallel-size 2 is not implemented yet in this library"),
    ("--window-attn-skip-freq 2", 1, "--window-attn-skip-freq selects the layers of --window-size: pass --window-size"),
    ("--window-size 4,0 --window-attn-skip-freq [1,0]", 1, "--window-attn-skip-freq lists 2 layers; the model has 4"),
    ("--glu-linear-offset 1.0", 1, "--glu-linear-offset 1.0 applies to a gated MLP: add --quick-geglu or --swiglu"),
    ("--quick-geglu --activation-func-clamp-value -1", 1, "--activation-func-clamp-value must be > 0, got -1.0"),
    ("--quick-geglu --swiglu", 1, "--swiglu and --quick-geglu each choose the MLP activation: pass only one"),
])
def test_variant_misconfigurations_are_one_line(clean_env, extra, world, message):
    with pytest.raises(ConfigurationError) as error:
        validated(extra, world_size=world)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize("value", ["127", "1,2,3", "-2,0"])
def test_bad_window_size_is_one_line(clean_env, value):
    with pytest.raises(ConfigurationError) as error:
        validated(f"--window-size={value}")
    assert str(error.value).startswith("--window-size must be 'left,right' with integers >= -1")


def test_non_integer_window_size_is_an_argparse_error(clean_env, capsys):
    from megatron.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv=["--window-size", "a,b"])
    assert "--window-size" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------- Llama 4

def test_no_rope_layers_follow_no_rope_freq():
    from helpers.models_helpers import tiny_config

    cfg = tiny_config(num_layers=8, position_embedding_type="rope", no_rope_freq=4)
    hf_uses_rope = [int((i + 1) % 4 != 0) for i in range(8)]  # transformers' default no_rope_layers (1 = RoPE)
    assert [int(not cfg.is_no_rope_layer(i + 1)) for i in range(8)] == hf_uses_rope
    cfg = tiny_config(num_layers=4, position_embedding_type="rope", no_rope_freq=[1, 0, 0, 0])
    assert [cfg.is_no_rope_layer(n) for n in range(1, 5)] == [True, False, False, False]


def test_l2_norm_equals_hugging_face():
    from transformers.models.llama4.modeling_llama4 import Llama4TextL2Norm

    from megatron.core.transformer.attention_variants import l2_norm

    x = torch.randn(3, 2, 4, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(l2_norm(x, 1e-5), Llama4TextL2Norm(1e-5)(x))


def test_llama4_interleaved_moe_equals_hugging_face(single_rank):
    """Maverick's shape: dense and MoE layers interleaved, NoPE every 4th layer, no QK norm; the bridge's config
    computes transformers' logits, the weights go back unchanged; Megatron's --qk-l2-norm on a model with NoPE layers
    normalises those too, which Hugging Face does not (the bridge keeps HF's placement)."""
    from megatron.core.models.conversion import hf_registry

    bridge = hf_registry.bridge_for("llama4_text")
    for overrides in (hf_zoo.LLAMA4_INTERLEAVED, {}):
        model = hf_zoo.tiny_hf("llama4_text", **overrides)
        config = hf_zoo.megatron_config(model.config)
        sd = bridge.to_megatron(model.state_dict(), model.config, config.padded_vocab_size)
        ours = hf_zoo.gpt_model(config)
        ours.load_state_dict(sd)
        with torch.no_grad():
            ref = model(hf_zoo.inputs()).logits
        assert rel_err(hf_zoo.logits(ours, hf_zoo.inputs()), ref) <= 1e-5
        back = bridge.to_hf(ours.state_dict(), model.config)
        assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    assert config.qk_l2_norm and config.qk_l2_norm_rope_layers_only and config.no_rope_freq == 4
    megatron_style = hf_zoo.gpt_model(dataclasses.replace(config, qk_l2_norm_rope_layers_only=False))
    megatron_style.load_state_dict(sd)
    assert rel_err(hf_zoo.logits(megatron_style, hf_zoo.inputs()), ref) > 1e-3


def test_llama4_flags_reach_the_config(clean_env):
    args = validated("--num-experts 4 --moe-router-topk 1 --moe-router-score-function sigmoid --position-embedding-type "
                     "rope --no-rope-freq 2 --qk-l2-norm --moe-apply-probs-on-input --moe-layer-freq ([0,1]*2)")
    config = core_transformer_config_from_args(args)
    assert config.no_rope_freq == 2 and config.qk_l2_norm and config.moe_apply_probs_on_input
    assert [config.is_moe_layer(n) for n in range(1, 5)] == [False, True, False, True]


@pytest.mark.parametrize("extra,message", [
    ("--num-experts 4 --moe-apply-probs-on-input", "--moe-apply-probs-on-input needs --moe-router-topk 1 (one routing "
                                                   "weight per token), got 2"),
    ("--moe-apply-probs-on-input", "--moe-apply-probs-on-input needs a mixture of experts (--num-experts)"),
    ("--position-embedding-type rope --no-rope-freq 3", "--no-rope-freq 3 must be >= 1 and divide --num-layers (4)"),
    ("--no-rope-freq 2", "--no-rope-freq picks layers without rotary embeddings: it needs --position-embedding-type "
                         "rope, got learned_absolute"),
])
def test_llama4_misconfigurations_are_one_line(clean_env, extra, message):
    with pytest.raises(ConfigurationError) as error:
        validated(extra)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)

"""Model flags of today's Megatron-LM: parsing, validation, config field and behaviour (RoPE variants,
--apply-layernorm-1p, --attention-backend, --qk-layernorm, --transformer-impl, legacy/mcore selection), and a
layer spec's own bias-dropout-add."""
import math

import pytest
import torch

from helpers.args_test_helpers import clean_env, validated  # noqa: F401  (fixture)
from helpers.models_helpers import causal_mask, gpt_inputs, single_rank, tiny_config  # noqa: F401  (fixture)

from megatron.core.models.gpt import GPTModel as CoreGPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.rotary import RotaryEmbedding, apply_rotary_pos_emb, llama3_scaled_inv_freq
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.errors import ConfigurationError


# ------------------------------------------------------------------------------------------------ RoPE

def _hand_llama3(f, factor):
    """Llama-3.x scaling of one frequency, written out from its definition (8192 context, factors 1 and 4)."""
    wavelen = 2 * math.pi / f
    if wavelen < 8192 / 4:
        return f
    if wavelen > 8192 / 1:
        return f / factor
    s = (8192 / wavelen - 1) / (4 - 1)
    return (1 - s) * f / factor + s * f


def test_llama3_rope_scaling_against_hand_computation_and_hf():
    dim, base, factor = 64, 500000, 8.0
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    ours = RotaryEmbedding(dim, rotary_base=base, rope_scaling=True, rope_scaling_factor=factor).inv_freq
    hand = torch.tensor([_hand_llama3(f, factor) for f in inv.double().tolist()], dtype=torch.float64)
    assert torch.allclose(ours.double(), hand, rtol=1e-6, atol=0)
    # the three regimes are all present at this size, so every branch was compared
    wl = 2 * math.pi / inv
    assert (wl < 2048).any() and (wl > 8192).any() and ((wl >= 2048) & (wl <= 8192)).any()
    assert not torch.allclose(ours, inv)

    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    cfg = transformers.LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, max_position_embeddings=131072,
                                   rope_theta=base, rope_scaling={"rope_type": "llama3", "factor": factor,
                                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                  "original_max_position_embeddings": 8192})
    hf_inv, _ = _compute_llama3_parameters(cfg, "cpu")
    assert torch.allclose(ours, hf_inv.float(), rtol=1e-6, atol=0)


def test_rotary_interleaved_rotates_adjacent_pairs():
    s, d = 5, 8
    rope = RotaryEmbedding(d, rotary_interleaved=True)
    freqs = rope(s)                                  # [s, 1, 1, d]
    t = torch.randn(s, 2, 3, d)
    out = apply_rotary_pos_emb(t, freqs, interleaved=True)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    expect = torch.empty_like(t)
    for p in range(s):
        for i in range(d // 2):
            a = p * inv[i]
            x0, x1 = t[p, ..., 2 * i], t[p, ..., 2 * i + 1]
            expect[p, ..., 2 * i] = x0 * math.cos(a) - x1 * math.sin(a)
            expect[p, ..., 2 * i + 1] = x1 * math.cos(a) + x0 * math.sin(a)
    assert torch.allclose(out, expect, atol=1e-5)
    half = apply_rotary_pos_emb(t, RotaryEmbedding(d)(s))
    assert not torch.allclose(out, half, atol=1e-3)


def test_rotary_base_and_interpolation_factor_reach_the_model(single_rank):
    model = CoreGPTModel(tiny_config(style="llama"), get_gpt_layer_local_spec(), 64, 16,
                         position_embedding_type="rope", rotary_base=500000, seq_len_interpolation_factor=4)
    hn = model.config.kv_channels
    inv = 1.0 / (500000 ** (torch.arange(0, hn, 2, dtype=torch.float32) / hn))
    assert torch.allclose(model.rotary_pos_emb.inv_freq, inv)
    angles = model.rotary_pos_emb(6)[:, 0, 0, : hn // 2]
    assert torch.allclose(angles, torch.outer(torch.arange(6.0) / 4, inv))


def test_rope_flags_map_onto_config_and_model(clean_env, single_rank):
    args = validated("--position-embedding-type rope --rotary-base 500000 --rotary-interleaved --use-rope-scaling "
                     "--rope-scaling-factor 16 --rotary-seq-len-interpolation-factor 2 --no-rope-fusion "
                     "--no-position-embedding")
    assert isinstance(args.rotary_base, int) and args.apply_rope_fusion is False
    cfg = core_transformer_config_from_args(args)
    assert (cfg.rotary_base, cfg.rotary_interleaved, cfg.use_rope_scaling, cfg.rope_scaling_factor,
            cfg.rotary_seq_len_interpolation_factor, cfg.apply_rope_fusion, cfg.add_position_embedding) == \
        (500000, True, True, 16.0, 2, False, False)
    with pytest.raises(ConfigurationError, match="--no-position-embedding"):
        validated("--no-position-embedding")


# ------------------------------------------------------------------------------------ norms, attention

def test_apply_layernorm_1p_zero_centred_gamma(clean_env, single_rank):
    cfg = core_transformer_config_from_args(validated("--apply-layernorm-1p"))
    assert cfg.layernorm_zero_centered_gamma
    cfg = tiny_config(layernorm_zero_centered_gamma=True)
    model = CoreGPTModel(cfg, get_gpt_layer_local_spec(), 64, 16)
    norm = model.decoder.layers[0].input_layernorm
    assert torch.equal(norm.weight, torch.zeros_like(norm.weight))   # stored as gamma - 1
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5)
        norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(3, 2, cfg.hidden_size)
    expect = torch.nn.functional.layer_norm(x, (cfg.hidden_size,), 1 + norm.weight, norm.bias, cfg.layernorm_epsilon)
    assert torch.allclose(norm(x), expect, atol=1e-6)


def test_attention_backend_flag_and_implementations(clean_env, single_rank, capsys):
    assert validated("").attention_backend is AttnBackend.auto
    args = validated("--attention-backend local")
    assert core_transformer_config_from_args(args).attention_backend is AttnBackend.local
    with pytest.raises(SystemExit):
        validated("--attention-backend sdpa")
    assert "invalid choice 'sdpa'" in capsys.readouterr().err

    ids, pos, mask, _ = gpt_inputs(seq=8)
    outs = {}
    for backend in ("auto", "flash", "fused", "unfused", "local"):
        torch.manual_seed(0)
        model = CoreGPTModel(tiny_config(attention_backend=backend), get_gpt_layer_local_spec(), 64, 16).eval()
        with torch.no_grad():
            outs[backend] = model(ids, pos, mask)
        core = model.decoder.layers[0].self_attention.core_attention
        assert core.use_sdpa(mask) == (backend not in ("unfused", "local"))
    printed = capsys.readouterr().out
    assert "--attention-backend local: explicit baddbmm + masked softmax" in printed
    assert "--attention-backend flash: torch SDPA" in printed
    for backend, out in outs.items():
        assert torch.allclose(out, outs["local"], atol=1e-5), backend


def test_no_masked_softmax_fusion_maps_onto_config(clean_env):
    assert core_transformer_config_from_args(validated("")).masked_softmax_fusion is True
    assert core_transformer_config_from_args(validated("--no-masked-softmax-fusion")).masked_softmax_fusion is False


def test_qk_layernorm_normalises_queries_and_keys(clean_env, single_rank):
    assert core_transformer_config_from_args(validated("--qk-layernorm")).qk_layernorm
    cfg = tiny_config(qk_layernorm=True, normalization="RMSNorm", add_bias_linear=False)
    model = CoreGPTModel(cfg, get_gpt_layer_local_spec(qk_layernorm=True), 64, 16).eval()
    keys = model.state_dict().keys()
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in keys
    assert "decoder.layers.0.self_attention.k_layernorm.weight" in keys
    ids, pos, mask, _ = gpt_inputs(seq=8)
    with torch.no_grad():
        before = model(ids, pos, mask)
        # RMS-normalised queries and keys do not change when the Q and K rows of linear_qkv are scaled
        # (without the norms the attention scores would change by the factor squared).
        w = model.decoder.layers[0].self_attention.linear_qkv.weight
        w.mul_(7.0)
        w.view(cfg.num_attention_heads, 3, cfg.kv_channels, -1)[:, 2].div_(7.0)  # leave V as it was
        after = model(ids, pos, mask)
    assert torch.allclose(before, after, atol=1e-4)


# ----------------------------------------------------------------------- implementation / model family

def test_transformer_impl_default_falls_back_to_local_with_a_log_line(clean_env, capsys):
    args = validated("")
    assert args.transformer_impl == "local"
    assert "--transformer-impl transformer_engine:" in capsys.readouterr().out
    assert "using --transformer-impl local" not in (validated("--transformer-impl local") and capsys.readouterr().out)


def test_legacy_and_mcore_model_flags(clean_env):
    args = validated("--use-mcore-models")
    assert args.use_legacy_models is False and args.deprecated_use_mcore_models is True
    assert validated("--use-legacy-models --ckpt-format torch").use_legacy_models is True
    for extra, flag in (("--ckpt-format torch_dist", "--ckpt-format torch"), ("", "--ckpt-format torch"),
                        ("--ckpt-format torch --position-embedding-type rope --rotary-interleaved",
                         "--rotary-interleaved")):
        with pytest.raises(ConfigurationError, match=flag):
            validated("--use-legacy-models " + extra)


def test_model_provider_builds_mcore_by_default_and_legacy_on_request(clean_env, single_rank):
    import pretrain_gpt
    from megatron.legacy.model import GPTModel as LegacyGPTModel
    from megatron.training.global_vars import set_args

    for extra, cls in (("", CoreGPTModel), ("--use-legacy-models --ckpt-format torch", LegacyGPTModel)):
        args = validated(extra + " --use-cpu-initialization")
        args.padded_vocab_size = 128
        set_args(args)
        model = pretrain_gpt.model_provider()
        assert type(model) is cls
        keys = model.state_dict_for_save_checkpoint()
        if cls is CoreGPTModel:
            assert "decoder.layers.0.self_attention.linear_qkv.weight" in keys
        else:
            assert "encoder" in keys["language_model"]


# -------------------------------------------------------------------------------- spec bias-dropout-add

def test_layer_spec_bias_dropout_add_is_used(single_rank):
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    calls = []

    def counting_bda(training, fused):
        inner = get_bias_dropout_add(training, fused)

        def bda(x_with_bias, residual, prob):
            calls.append(prob)
            return inner(x_with_bias, residual, prob) * 0.5     # observable: halves every residual stream
        return bda

    spec = get_gpt_layer_local_spec()
    spec.submodules.mlp_bda = counting_bda
    cfg = tiny_config()
    torch.manual_seed(0)
    plain = CoreGPTModel(cfg, get_gpt_layer_local_spec(), 64, 16).eval()
    torch.manual_seed(0)
    custom = CoreGPTModel(cfg, spec, 64, 16).eval()
    custom.load_state_dict(plain.state_dict())
    ids, pos, mask, _ = gpt_inputs(seq=8)
    with torch.no_grad():
        a, b = plain(ids, pos, mask), custom(ids, pos, mask)
    assert len(calls) == cfg.num_layers
    assert not torch.allclose(a, b, atol=1e-3)

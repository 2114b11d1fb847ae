"""Each fast path equals the plain path it replaces: SDPA vs explicit masked softmax, fused bias-GeLU vs autograd
of the plain formula, fused (compiled) bias-dropout-add vs eager; norms against their definitions; clear errors for
missing optional packages."""
import os

import pytest
import torch
import torch.nn.functional as F

from helpers.numerics import rel_err
from helpers.models_helpers import causal_mask, single_rank, tiny_config  # noqa: F401  (fixture)

from megatron.core import activations
from megatron.core.fusions import fused_bias_dropout, fused_bias_gelu
from megatron.core import utils as core_utils
from megatron.core.fusions import fused_kernels
from megatron.core.transformer.dot_product_attention import CoreAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.norms import LayerNorm, RMSNorm


def _attention_pair(mask_type, **cfg):
    config = tiny_config(**cfg)
    sdpa = CoreAttention(1, config, mask_type)
    config_unfused = tiny_config(attention_backend="unfused", **cfg)
    explicit = CoreAttention(1, config_unfused, mask_type)
    return sdpa, explicit


def _compare_attention(sdpa, explicit, mask, sq=6, sk=6, heads=4, kv_heads=4, hd=8):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sq, 2, heads, hd, generator=g, requires_grad=True)
    k = torch.randn(sk, 2, kv_heads, hd, generator=g, requires_grad=True)
    v = torch.randn(sk, 2, kv_heads, hd, generator=g, requires_grad=True)
    out_fast = sdpa(q, k, v, mask)
    grads_fast = torch.autograd.grad(out_fast.square().sum(), (q, k, v))
    out_plain = explicit(q, k, v, mask)
    grads_plain = torch.autograd.grad(out_plain.square().sum(), (q, k, v))
    assert sdpa.use_sdpa(mask) and not explicit.use_sdpa(mask)
    return max([rel_err(out_fast, out_plain)] + [rel_err(a, b) for a, b in zip(grads_fast, grads_plain)])


def test_sdpa_equals_explicit_attention(single_rank):
    errs = {}
    sdpa, explicit = _attention_pair(AttnMaskType.causal)
    errs["causal, mask given"] = _compare_attention(sdpa, explicit, causal_mask(6))
    errs["causal, no mask"] = _compare_attention(sdpa, explicit, None)
    errs["causal, GQA (4 heads, 2 groups)"] = _compare_attention(sdpa, explicit, causal_mask(6), kv_heads=2)
    errs["causal, KV cache shape (sq < sk)"] = _compare_attention(sdpa, explicit, None, sq=2, sk=6)
    # Per-sample causal masks (reset attention mask) are a general boolean mask.
    reset = causal_mask(6).repeat(2, 1, 1, 1)
    reset[1, 0, 3:, :3] = True
    errs["document (reset) masks"] = _compare_attention(sdpa, explicit, reset)
    sdpa, explicit = _attention_pair(AttnMaskType.padding)
    padding = torch.ones(2, 6)
    padding[1, 4:] = 0
    bert_mask = ((padding[:, None, :] * padding[:, :, None]) < 0.5).unsqueeze(1)  # fully masked padding rows
    errs["padding with fully masked rows"] = _compare_attention(sdpa, explicit, bert_mask)
    errs["padding, no mask"] = _compare_attention(sdpa, explicit, None)
    print(f"SDPA vs explicit attention, max relative error (output and q/k/v grads): {errs}")
    assert all(e <= 1e-5 for e in errs.values()), errs


def test_query_key_layer_scaling_is_neutral(single_rank):
    """apply_query_key_layer_scaling divides by the layer number and multiplies back in the softmax."""
    base = CoreAttention(3, tiny_config(attention_backend="unfused", apply_query_key_layer_scaling=False),
                         AttnMaskType.causal)
    scaled = CoreAttention(3, tiny_config(attention_backend="unfused", apply_query_key_layer_scaling=True),
                           AttnMaskType.causal)
    assert scaled.norm_factor == pytest.approx(3 * base.norm_factor)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 2, 4, 8, generator=g) for _ in range(3))
    assert rel_err(scaled(q, k, v, causal_mask(5)), base(q, k, v, causal_mask(5))) <= 1e-6


def test_fused_bias_gelu_equals_plain():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 16, generator=g, requires_grad=True)
    b = torch.randn(16, generator=g, requires_grad=True)
    fused = fused_bias_gelu.bias_gelu_impl(x, b, use_compiled=False)   # hand-written backward
    gx, gb = torch.autograd.grad(fused.sum() * 1.0 + fused.square().sum(), (x, b))
    plain = activations.openai_gelu(x + b)                          # autograd of the plain tanh-GeLU
    px, pb = torch.autograd.grad(plain.sum() * 1.0 + plain.square().sum(), (x, b))
    errs = [rel_err(fused, plain), rel_err(gx, px), rel_err(gb, pb)]
    # Megatron's fused GeLU is the tanh approximation: close to, not equal to, the exact erf GeLU.
    assert rel_err(fused, F.gelu(x + b)) < 2e-3
    if torch.cuda.is_available() or os.environ.get("MEGATRON_TEST_COMPILE") == "1":  # ~20 s to compile on CPU
        compiled = fused_bias_gelu.bias_gelu_impl(x, b, use_compiled=True)
        cx, cb = torch.autograd.grad(compiled.sum() * 1.0 + compiled.square().sum(), (x, b))
        errs += [rel_err(compiled, plain), rel_err(cx, px), rel_err(cb, pb)]
    print(f"fused bias-gelu vs plain, max relative errors: {max(errs):.2e}")
    assert max(errs) <= 1e-6, errs


def test_fused_bias_dropout_add_equals_plain():
    """torch.compile'd bias-dropout-add draws the same dropout mask as eager (fallback_random)."""
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(6, 2, 16, generator=g), torch.randn(6, 2, 16, generator=g)
    bias = torch.randn(16, generator=g)
    compiled = fused_kernels.compiled(fused_bias_dropout._bias_dropout_add_train)
    torch.manual_seed(4)
    fused = compiled(x, bias, residual, 0.3)
    torch.manual_seed(4)
    plain = fused_bias_dropout.bias_dropout_add(x, bias, residual, 0.3, True)
    assert torch.equal(fused, plain)
    dropped = (plain == residual).float().mean().item()
    assert 0.1 < dropped < 0.5  # dropout really happened
    kept = plain != residual
    assert torch.allclose(plain[kept], (residual + (x + bias) / 0.7)[kept], atol=1e-6)
    assert torch.equal(fused_bias_dropout.bias_dropout_add(x, bias, residual, 0.3, False), residual + (x + bias))


def test_norms_match_definitions(single_rank):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 16, generator=g)
    ln = LayerNorm(16, eps=1e-5)
    with torch.no_grad():
        ln.weight.normal_(generator=g)
        ln.bias.normal_(generator=g)
    ref = torch.nn.LayerNorm(16, eps=1e-5)
    ref.load_state_dict(ln.state_dict())
    assert rel_err(ln(x), ref(x)) <= 1e-6
    ln1p = LayerNorm(16, apply_layernorm_1p=True)
    assert torch.all(ln1p.weight == 0) and rel_err(ln1p(x), torch.nn.LayerNorm(16)(x)) <= 1e-6
    rms = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        rms.weight.normal_(generator=g)
    expect = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * rms.weight
    assert rel_err(rms(x), expect) <= 1e-6
    # fp32 residual stream with half-precision norm weights: computed in fp32, returned in the weight dtype.
    half = LayerNorm(16, params_dtype=torch.bfloat16)
    assert half(x).dtype == torch.bfloat16


def test_missing_optional_packages_raise_clear_errors(single_rank):
    from megatron.model import GPTModel

    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="--transformer-impl transformer_engine"):
            GPTModel(tiny_config(transformer_impl="transformer_engine"))
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="--use-flash-attn"):
            GPTModel(tiny_config(use_flash_attn=True))
    with pytest.raises(ValueError, match="padded_vocab_size"):
        GPTModel(tiny_config(padded_vocab_size=None))


def test_fast_path_choice_is_logged_once(single_rank, capsys):
    core_utils._LOGGED.clear()
    sdpa, explicit = _attention_pair(AttnMaskType.causal)
    q = torch.randn(4, 1, 4, 8)
    for _ in range(2):
        sdpa(q, q, q, None)
        explicit(q, q, q, None)
    out = capsys.readouterr().out
    assert out.count("attention: torch.nn.functional.scaled_dot_product_attention (SDPA)") == 1
    assert out.count("attention: explicit masked softmax (unfused)") == 1

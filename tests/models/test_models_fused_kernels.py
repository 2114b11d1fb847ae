"""The torch.compile'd fused kernels (RMSNorm, LayerNorm, bias-SwiGLU, bias-GeLU, RoPE, vocab-parallel cross
entropy) against independent plain formulas, forward and backward.

Compiling on CPU (inductor's C++ backend) costs a few seconds per kernel, so the COMPILED kernels run in one
fp32 test (``MEGATRON_COMPILE_FUSIONS_ON_CPU=1``, asserting that the compiled version ran) and in the TP=2
cross-entropy test; the bf16 checks and the model wiring run the plain path.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from helpers.numerics import rel_err
from helpers.dist_harness import run_distributed
from helpers.models_helpers import single_rank, tiny_config  # noqa: F401  (fixture)

from megatron.core import utils as core_utils
from megatron.core.fusions import fused_kernels
from megatron.core.fusions.fused_cross_entropy import GRADIENT, LOCAL_STATISTICS, fused_vocab_parallel_cross_entropy
from megatron.core.fusions import fused_bias_gelu


# ---------------------------------------------------------------- independent references (written out here)

def ref_rms_norm(x, w, eps):
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps)


def ref_layer_norm(x, w, b, eps):
    x = x.float()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w.float() + b.float()


def ref_swiglu(y, bias):
    h = y.shape[-1] // 2
    a, b = (y + bias)[..., :h], (y + bias)[..., h:]
    return a * torch.sigmoid(a) * b


def ref_gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def ref_rope(t, angles):
    """Channel i and i + d/2 as one complex number, multiplied by exp(j * angle_i); other channels pass."""
    d = angles.shape[-1] * 2
    z = torch.complex(t[..., : d // 2].double(), t[..., d // 2: d].double()) * torch.polar(
        torch.ones_like(angles, dtype=torch.float64), angles.double())
    return torch.cat((z.real, z.imag, t[..., d:].double()), dim=-1)


def ref_cross_entropy(logits, target, label_smoothing):
    # Megatron spreads the smoothing mass over the V-1 wrong classes: PyTorch's smoothing e' = e V / (V - 1).
    vocab = logits.shape[-1]
    e = label_smoothing * vocab / (vocab - 1)
    return F.cross_entropy(logits.reshape(-1, vocab).double(), target.reshape(-1), reduction="none",
                           label_smoothing=e).view(target.shape)


def _grads(out, inputs, seed=7):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.autograd.grad((out.double() * g).sum(), inputs)


def _check(fused_fn, ref_fn, inputs, tol):
    """max relative error of output and input gradients of fused_fn vs ref_fn on the same inputs."""
    a = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    b = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out_f, out_r = fused_fn(*a), ref_fn(*b)
    diff_a = [t for t in a if t.requires_grad]
    diff_b = [t for t in b if t.requires_grad]
    errs = [rel_err(out_f, out_r)] + [rel_err(x, y) for x, y in zip(_grads(out_f, diff_a), _grads(out_r, diff_b))]
    assert max(errs) <= tol, errs
    return max(errs)


def _kernel_cases(dtype):
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    angles = torch.outer(torch.arange(5, dtype=torch.float32), torch.rand(4, generator=g))  # [s, d/2]
    freqs = torch.cat((angles, angles), -1)[:, None, None, :]                                # [s, 1, 1, d]
    return {
        "RMSNorm": (lambda x, w: fused_kernels.RMS_NORM(x, w, 1e-6), lambda x, w: ref_rms_norm(x, w, 1e-6),
                    [rnd(5, 2, 16), rnd(16)], fused_kernels.RMS_NORM),
        "LayerNorm": (lambda x, w, b: fused_kernels.LAYER_NORM(x, w, b, 1e-5),
                      lambda x, w, b: ref_layer_norm(x, w, b, 1e-5), [rnd(5, 2, 16), rnd(16), rnd(16)],
                      fused_kernels.LAYER_NORM),
        "bias-SwiGLU": (lambda y, b: fused_kernels.BIAS_SWIGLU(y, b), ref_swiglu, [rnd(5, 2, 24), rnd(24)],
                        fused_kernels.BIAS_SWIGLU),
        # 8 of 12 channels rotated (rotary_percent < 1): the rest must pass through untouched.
        "RoPE": (lambda t: fused_kernels.ROTARY(t, freqs), lambda t: ref_rope(t, angles[:, None, None, :]),
                 [rnd(5, 2, 3, 12)], fused_kernels.ROTARY),
    }


def test_compiled_kernels_match_plain_formulas_fp32(single_rank, monkeypatch):
    """The compiled kernels really run (inductor C++ on CPU) and equal the written-out formulas."""
    monkeypatch.setenv(fused_kernels.COMPILE_ON_CPU_ENV, "1")
    monkeypatch.delenv(fused_kernels.NO_COMPILE_ENV, raising=False)
    errs = {}
    for name, (fused, ref, inputs, op) in _kernel_cases(torch.float32).items():
        errs[name] = _check(fused, ref, inputs, 1e-5)
        assert op.last_choice == "compiled", f"{name}: {op._broken}"
    # bias-GeLU: the existing hand-written backward, now compiled when compile_blocker allows.
    errs["bias-GeLU"] = _check(lambda y, b: fused_bias_gelu.bias_gelu_impl(y, b), lambda y, b: ref_gelu_tanh(y + b),
                               _kernel_cases(torch.float32)["bias-SwiGLU"][2], 1e-5)
    for smoothing in (0.0, 0.1):
        g = torch.Generator().manual_seed(1)
        logits, target = torch.randn(4, 3, 20, generator=g), torch.randint(0, 20, (4, 3), generator=g)
        errs[f"cross entropy (smoothing {smoothing})"] = _check(
            lambda z, t: fused_vocab_parallel_cross_entropy(z, t, smoothing),
            lambda z, t: ref_cross_entropy(z, t, smoothing), [logits, target], 1e-5)
        assert LOCAL_STATISTICS.last_choice == "compiled" and GRADIENT.last_choice == "compiled"
    print(f"compiled fused kernels vs plain formulas (fp32), max relative errors: {errs}")


def test_plain_kernels_match_formulas_fp32_and_bf16(single_rank, monkeypatch, capsys):
    """The default CPU path (plain, logged with its reason): fp32 tight, bf16 against the fp32 formula."""
    monkeypatch.delenv(fused_kernels.COMPILE_ON_CPU_ENV, raising=False)
    core_utils._LOGGED.clear()
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        for name, (fused, ref, inputs, op) in _kernel_cases(dtype).items():
            _check(fused, lambda *t: ref(*[x.float() for x in t]), inputs, tol)
            assert op.last_choice == "plain", name
    out = capsys.readouterr().out
    assert "using plain RMSNorm: input on CPU" in out and "using torch.compile fused" not in out
    # Switched off by its flag: the reason names the flag.
    fused_kernels.ROTARY(torch.randn(2, 1, 1, 4), torch.zeros(2, 1, 1, 4), fused=False, flag_hint="--no-rope-fusion")
    assert "fusion disabled (--no-rope-fusion)" in capsys.readouterr().out


def test_fusion_flags_reach_the_model_and_keep_its_numerics(single_rank):
    """A llama-style GPT with every fusion flag on (plain kernels on CPU) equals the one with them off."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    losses, grads = [], []
    for on in (False, True):
        torch.manual_seed(0)
        config = tiny_config(style="llama", bias_activation_fusion=on, apply_rope_fusion=on,
                             cross_entropy_loss_fusion=on)
        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16,
                         position_embedding_type="rope")
        mlp = model.decoder.layers[0].mlp
        assert mlp.bias_swiglu_fusion is on
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        loss = model(tokens, torch.arange(8).expand(2, 8), None, labels=tokens)
        loss.sum().backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])


def _fused_ce_tp2(smoothings):
    """Each rank holds half of the vocabulary; compare with the unsharded loss on the gathered logits."""
    import torch.distributed as dist

    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(2, 1)
    rank = parallel_state.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(5)
    full = torch.randn(6, 2, 16, generator=g, dtype=torch.float64).float()
    target = torch.randint(0, 16, (6, 2), generator=g)
    errs = []
    for smoothing in smoothings:
        local = full[..., rank * 8:(rank + 1) * 8].clone().requires_grad_(True)
        loss = fused_vocab_parallel_cross_entropy(local, target, smoothing)
        upstream = torch.randn(6, 2, generator=torch.Generator().manual_seed(9))
        (grad_local,) = torch.autograd.grad((loss * upstream).sum(), local)
        ref_logits = full.clone().requires_grad_(True)
        ref = ref_cross_entropy(ref_logits, target, smoothing).float()
        (ref_grad,) = torch.autograd.grad((ref * upstream).sum(), ref_logits)
        errs.append(max(rel_err(loss, ref), rel_err(grad_local, ref_grad[..., rank * 8:(rank + 1) * 8])))
    choice = (LOCAL_STATISTICS.last_choice, GRADIENT.last_choice)
    dist.barrier()
    return errs, choice


def test_fused_cross_entropy_tp2_matches_unsharded():
    results = run_distributed(_fused_ce_tp2, 2, (0.0, 0.2), timeout=180,
                              env={fused_kernels.COMPILE_ON_CPU_ENV: "1"})
    for errs, choice in results:
        assert choice == ("compiled", "compiled")
        assert max(errs) <= 1e-5, errs


def test_compile_failure_falls_back_with_reason(monkeypatch, capsys):
    monkeypatch.setenv(fused_kernels.COMPILE_ON_CPU_ENV, "1")
    op = fused_kernels.FusedOp("test op", lambda x: x * 2)

    def broken(fn):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    core_utils._LOGGED.clear()
    assert torch.equal(op(torch.ones(2)), torch.full((2,), 2.0)) and op.last_choice == "plain"
    assert "using plain test op: torch.compile failed: RuntimeError: no C++ compiler found" in capsys.readouterr().out
    assert math.isclose(float(op(torch.ones(1))), 2.0) and op.last_choice == "plain"

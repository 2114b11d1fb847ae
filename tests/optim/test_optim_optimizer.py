"""get_megatron_optimizer against plain torch optimizers, mixed precision and loss scaling (one process).

References are independent: torch.optim.AdamW / SGD (the non-foreach implementation) over the same param
groups, built here by hand with Megatron's rule (no weight decay on biases and 1-D weights), and
torch.nn.utils.clip_grad_norm_ for clipping. Mixed-precision runs track the fp32 reference within the
precision of bf16 / fp16.
"""
import copy
import io

import pytest
import torch

from helpers.numerics import rel_err
from helpers.dist_harness import run_distributed
from helpers.optim_helpers import ToyModel, init_parallel, make_config, toy_batch, toy_loss

LR, WD = 0.01, 0.1


def _reference_groups(model):
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.ndim == 1)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.ndim == 1]
    assert len(decay) == 3 and len(no_decay) == 5  # fc1/fc2/head weights; 3 biases + norm weight and bias
    return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]


def _wrap(base, dtype=torch.float32, fp32_reduce=False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model = copy.deepcopy(base).to(dtype)
    return DistributedDataParallel(make_config(), DistributedDataParallelConfig(grad_reduce_in_fp32=fp32_reduce),
                                   model)


def _train_step(model, opt, step, inject_inf=False, zero_first_input=False):
    model.zero_grad_buffer()
    opt.zero_grad()
    x, y = toy_batch(8, step=step)
    if zero_first_input:
        x[:, 0] = 0.0
    opt.scale_loss(toy_loss(model, x, y)).backward()
    model.finish_grad_sync()
    if inject_inf:
        model.module.fc2.weight.main_grad[0, 0] = float("inf")
    return opt.step()


def _ref_step(model, opt, step, clip=None, zero_first_input=False):
    opt.zero_grad()
    x, y = toy_batch(8, step=step)
    if zero_first_input:
        x[:, 0] = 0.0
    toy_loss(model, x, y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item() if clip else None
    zeros = sum(int((p.grad == 0).sum()) for p in model.parameters())
    opt.step()
    return norm, zeros


def _params_rel(model, ref):
    return max(rel_err(p.float(), q) for p, q in zip(model.module.parameters(), ref.parameters()))


def single_process_body():
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    init_parallel()
    base = ToyModel()
    out = {}

    # 1. fp32 Adam with clipping and zero counting vs torch AdamW + clip_grad_norm_.
    for clip in (0.0, 0.05):
        model = _wrap(base)
        cfg = OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=clip, log_num_zeros_in_grad=True)
        opt = get_megatron_optimizer(cfg, [model])
        ref = copy.deepcopy(base)
        ref_opt = torch.optim.AdamW(_reference_groups(ref), lr=LR, foreach=False)
        norm_err, zeros_ok = 0.0, True
        for step in range(5):
            ok, norm, zeros = _train_step(model, opt, step, zero_first_input=(step == 1))
            ref_norm, ref_zeros = _ref_step(ref, ref_opt, step, clip=clip or None, zero_first_input=(step == 1))
            assert ok
            if clip:
                norm_err = max(norm_err, abs(norm - ref_norm) / ref_norm)
            else:
                assert norm is None
            zeros_ok &= zeros == ref_zeros and (step != 1 or zeros >= 13)
        out[f"adam_fp32_clip{clip}"] = _params_rel(model, ref)
        out[f"adam_fp32_clip{clip}_norm"] = norm_err
        out[f"adam_fp32_clip{clip}_zeros"] = zeros_ok
        out["groups"] = [(g["wd_mult"], g["lr_mult"], len(g["params"])) for g in opt.param_groups]

    # 2. fp32 SGD with momentum vs torch SGD.
    model = _wrap(base)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.05, weight_decay=WD, clip_grad=0.0), [model])
    ref = copy.deepcopy(base)
    groups = _reference_groups(ref)
    ref_opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9, foreach=False)
    for step in range(3):
        _train_step(model, opt, step)
        _ref_step(ref, ref_opt, step)
    out["sgd_fp32"] = _params_rel(model, ref)

    # 3. bf16 / fp16 params with fp32 main params track the fp32 reference.
    for dtype, fp32_reduce in ((torch.bfloat16, True), (torch.float16, False)):
        model = _wrap(base, dtype, fp32_reduce)
        cfg = OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=1.0, bf16=dtype == torch.bfloat16,
                              fp16=dtype == torch.float16, initial_loss_scale=2 ** 10)
        opt = get_megatron_optimizer(cfg, [model])
        ref = copy.deepcopy(base)
        ref_opt = torch.optim.AdamW(_reference_groups(ref), lr=LR, foreach=False)
        oks = []
        for step in range(5):
            oks.append(_train_step(model, opt, step)[0])
            _ref_step(ref, ref_opt, step, clip=1.0)
        name = str(dtype).split(".")[-1]
        out[name] = _params_rel(model, ref)
        out[name + "_all_ok"] = all(oks)
        mains = [p for g in opt.fp32_from_float16_groups for p in g]
        out[name + "_main_is_fp32"] = all(p.dtype == torch.float32 for p in mains)
        out[name + "_model_is_rounded_main"] = all(
            torch.equal(m.data, p.to(dtype)) for m, p in zip([q for g in opt.float16_groups for q in g], mains))

    # 4. fp16 dynamic loss scaler: skip on overflow, halve after `hysteresis` overflows, grow after the window.
    model = _wrap(base, torch.float16)
    cfg = OptimizerConfig(lr=LR, weight_decay=WD, fp16=True, initial_loss_scale=2 ** 10, loss_scale_window=3,
                          hysteresis=2)
    opt = get_megatron_optimizer(cfg, [model])
    x, y = toy_batch(8)
    loss = toy_loss(model, x, y)
    out["scale_loss"] = abs(opt.scale_loss(loss).item() - 1024 * loss.item()) / (1024 * loss.item())
    trace = []
    for step, inject in enumerate([False, True, True, False, False, False]):
        before = [p.detach().clone() for p in model.parameters()]
        state_before = {k: v["exp_avg"].clone() for k, v in enumerate(opt.optimizer.state.values())}
        ok, norm, zeros = _train_step(model, opt, step, inject_inf=inject)
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        state_same = len(state_before) == len(opt.optimizer.state) and all(
            torch.equal(state_before[k], v["exp_avg"]) for k, v in enumerate(opt.optimizer.state.values()))
        trace.append((ok, norm is None, unchanged, state_same, opt.get_loss_scale().item()))
    out["dynamic_trace"] = trace
    out["scaler_state_keys"] = sorted(opt.state_dict()["grad_scaler"])

    # 5. constant --loss-scale: overflow skips the step but the scale never changes.
    model = _wrap(base, torch.float16)
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, fp16=True, loss_scale=128.0), [model])
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(_reference_groups(ref), lr=LR, foreach=False)
    constant = []
    for step, inject in enumerate([False, True, False, False]):
        ok = _train_step(model, opt, step, inject_inf=inject)[0]
        if ok:
            _ref_step(ref, ref_opt, step, clip=1.0)
        constant.append((ok, opt.get_loss_scale().item()))
    out["constant_trace"] = constant
    out["constant_vs_ref"] = _params_rel(model, ref)

    # 6. state_dict round trip (through torch.save) continues exactly where it stopped; fp16 and fp32.
    for dtype in (torch.float16, torch.float32):
        fp16 = dtype == torch.float16
        cfg = OptimizerConfig(lr=LR, weight_decay=WD, fp16=fp16, initial_loss_scale=2 ** 10)
        model = _wrap(base, dtype)
        opt = get_megatron_optimizer(cfg, [model])
        for step in range(2):
            _train_step(model, opt, step)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=False)
        model2 = _wrap(ToyModel(seed=4321), dtype)
        model2.load_state_dict(saved["model"])
        opt2 = get_megatron_optimizer(cfg, [model2])
        opt2.load_state_dict(saved["optimizer"])
        for step in range(2, 4):
            _train_step(model, opt, step)
            _train_step(model2, opt2, step)
        name = str(dtype).split(".")[-1]
        inner = saved["optimizer"]["optimizer"] if fp16 else saved["optimizer"]
        out[f"roundtrip_{name}"] = max(rel_err(p, q) for p, q in zip(model.parameters(), model2.parameters()))
        out[f"roundtrip_{name}_group_step"] = inner["param_groups"][0].get("step")
        out[f"roundtrip_{name}_keys"] = sorted(saved["optimizer"]) if fp16 else None
    return out


def test_optimizer_single_process():
    out = run_distributed(single_process_body, 1, timeout=120)[0]
    # Megatron's group order: decayed params first, then the not-decayed ones (wd_mult 0).
    assert out["groups"] == [(1.0, 1.0, 3), (0.0, 1.0, 5)], out["groups"]
    for clip in (0.0, 0.05):
        assert out[f"adam_fp32_clip{clip}"] < 1e-6, out
        assert out[f"adam_fp32_clip{clip}_norm"] < 1e-6, out
        assert out[f"adam_fp32_clip{clip}_zeros"], out
    assert out["sgd_fp32"] < 1e-6, out
    assert out["bfloat16"] < 8e-3 and out["float16"] < 2e-3, out  # max-abs relative error of half-precision params
    for name in ("bfloat16", "float16"):
        assert out[name + "_all_ok"] and out[name + "_main_is_fp32"] and out[name + "_model_is_rounded_main"], out
    assert out["scale_loss"] < 1e-6

    # (update ok, grad_norm is None, params unchanged, Adam state unchanged, loss scale after the step)
    assert out["dynamic_trace"] == [
        (True, False, False, False, 1024.0),  # growth tracker 1
        (False, True, True, True, 1024.0),   # overflow 1: hysteresis 2 -> 1, scale kept
        (False, True, True, True, 512.0),    # overflow 2: hysteresis exhausted, scale halved
        (True, False, False, False, 512.0),  # growth tracker 1
        (True, False, False, False, 512.0),  # growth tracker 2
        (True, False, False, False, 1024.0),  # window of 3 clean steps: doubled
    ], out["dynamic_trace"]
    assert out["scaler_state_keys"] == ["growth_tracker", "hysteresis_tracker", "scale"]
    assert out["constant_trace"] == [(True, 128.0), (False, 128.0), (True, 128.0), (True, 128.0)]
    assert out["constant_vs_ref"] < 2e-3, out  # fp16 params, max-abs relative error
    for name in ("float16", "float32"):
        assert out[f"roundtrip_{name}"] == 0.0, out
        assert out[f"roundtrip_{name}_group_step"] == 2, out
    assert out["roundtrip_float16_keys"] == ["fp32_from_fp16_params", "grad_scaler", "optimizer"]


def test_dynamic_grad_scaler_table():
    from megatron.core.optimizer import ConstantGradScaler, DynamicGradScaler

    scaler = DynamicGradScaler(initial_scale=8.0, min_scale=2.0, growth_factor=2.0, backoff_factor=0.5,
                               growth_interval=2, hysteresis=2)
    # Worked by hand from the rules: hysteresis counts overflows down to 0 and is refilled only on growth.
    #   inf: hyst 2->1, 8 | inf: hyst 0, 8*0.5=4 | inf: 4*0.5=2 | inf: max(1, min 2)=2
    #   ok: growth 1, 2 | ok: growth 2 = window -> 4, hyst refilled to 2 | inf: hyst 1, 4 | ok: 4 | ok: 8
    expected = [8.0, 4.0, 2.0, 2.0, 2.0, 4.0, 4.0, 4.0, 8.0]
    seen = []
    for found_inf in [True, True, True, True, False, False, True, False, False]:
        scaler.update(found_inf)
        seen.append(scaler.scale.item())
    assert seen == expected
    assert scaler.inv_scale.item() == 1 / 8.0
    state = scaler.state_dict()
    fresh = DynamicGradScaler(initial_scale=1024.0, min_scale=1.0)
    fresh.load_state_dict(state)
    assert fresh.scale.item() == 8.0 and fresh._growth_tracker == 0 and fresh._hysteresis_tracker == 2
    const = ConstantGradScaler(64.0)
    const.update(True)
    assert const.scale.item() == 64.0 and const.state_dict() == {}
    with pytest.raises(ValueError, match="min-loss-scale"):
        DynamicGradScaler(initial_scale=1.0, min_scale=2.0)


def test_optimizer_config_errors():
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    with pytest.raises(ValueError, match="--fp16 and --bf16"):
        OptimizerConfig(lr=1.0, fp16=True, bf16=True)
    with pytest.raises(ValueError, match="--optimizer"):
        OptimizerConfig(lr=1.0, optimizer="lamb")
    with pytest.raises(ValueError, match="--lr"):
        get_megatron_optimizer(OptimizerConfig(), [torch.nn.Linear(2, 2)])

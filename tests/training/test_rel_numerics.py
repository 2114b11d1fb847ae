"""Numerical faults: with --rerun-mode disabled, --check-for-nan-in-loss-and-grad stops every rank with one message
naming the iteration and the first rank (the default validate_results mode re-runs the iteration instead:
test_rel_rerun.py); with --fp16 an overflow skips the step without touching the optimizer state or the LR schedule.

Faults come from the test-only MEGATRON_FAULT_INJECT hook (megatron/training/fault_injection.py)."""
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from helpers.dist_harness import run_distributed

from megatron.training.fault_injection import fault_requested

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = ["--mock-data", "--num-layers", "2", "--train-iters", "6", "--log-interval", "1", "--lr-warmup-iters", "0"]


def test_fault_injection_spec(monkeypatch):
    monkeypatch.delenv("MEGATRON_FAULT_INJECT", raising=False)
    assert not fault_requested("nan_grad", 1, 3)
    monkeypatch.setenv("MEGATRON_FAULT_INJECT", "nan_grad:rank=1:iter=3,raise:iter=2")
    assert fault_requested("nan_grad", 1, 3)
    assert not fault_requested("nan_grad", 0, 3) and not fault_requested("nan_grad", 1, 4)
    assert fault_requested("raise", 0, 2) and fault_requested("raise", 7, 2) and not fault_requested("raise", 0, 3)
    monkeypatch.setenv("MEGATRON_FAULT_INJECT", "nan_grad:rank=x")
    with pytest.raises(ValueError, match="MEGATRON_FAULT_INJECT"):
        fault_requested("nan_grad", 0, 0)


def _optimizer_snapshot(optimizer, scheduler):
    """Every piece of state a step may change: Adam moments and step, fp32 main params, the scheduler."""
    inner = optimizer.optimizer
    state = []
    for group in inner.param_groups:
        for p in group["params"]:
            s = inner.state.get(p, {})
            state.append((p.detach().clone(),) + tuple(
                s[k].detach().clone() if torch.is_tensor(s[k]) else s[k] for k in ("exp_avg", "exp_avg_sq", "step")
                if k in s))
    return state, scheduler.num_steps, [g["lr"] for g in inner.param_groups]


def _identical(a, b):
    (sa, na, la), (sb, nb, lb) = a, b
    if na != nb or la != lb or len(sa) != len(sb):
        return False
    for x, y in zip(sa, sb):
        if len(x) != len(y):
            return False
        for u, v in zip(x, y):
            if torch.is_tensor(u):
                if u.dtype != v.dtype or u.shape != v.shape or u.numpy().tobytes() != v.numpy().tobytes():
                    return False  # bit-level comparison (NaN == NaN, -0.0 != 0.0)
            elif u != v:
                return False
    return True


def numerics_body():
    from helpers import train_helpers
    from helpers.train_helpers import run_pretrain

    from megatron.training import training as training_mod
    from megatron.training.numerical_checks import NumericalFaultError

    out = {}
    rank = torch.distributed.get_rank()
    # 1. --check-for-nan-in-loss-and-grad: a NaN gradient on rank 1 at iteration 3, then a NaN loss on rank 0 at 2.
    for name, spec in (("grad", "nan_grad:rank=1:iter=3"), ("loss", "nan_loss:rank=0:iter=2")):
        os.environ["MEGATRON_FAULT_INJECT"] = spec
        records = []
        original_log = training_mod.training_log

        def counting_log(*a, **k):
            records.append(a[3])
            return original_log(*a, **k)

        training_mod.training_log = counting_log
        try:
            run_pretrain("pretrain_gpt", SHORT + ["--check-for-nan-in-loss-and-grad", "--rerun-mode", "disabled"])
            out[name] = ("no error", records)
        except NumericalFaultError as error:
            out[name] = (str(error), records, error.same_on_every_rank)
        finally:
            training_mod.training_log = original_log
            del os.environ["MEGATRON_FAULT_INJECT"]

    # 2. fp16: a NaN gradient on rank 1 at iteration 3 and a NaN loss (every rank) at iteration 5 are overflows:
    # both steps are skipped everywhere, the scale halves, and nothing of the optimizer or schedule moves.
    os.environ["MEGATRON_FAULT_INJECT"] = "nan_grad:rank=1:iter=3,nan_loss:iter=5"
    snapshots = []
    original_step = training_mod.train_step

    def snapshot_step(forward_step_func, data_iterator, model, optimizer, scheduler, config, **kwargs):
        before = _optimizer_snapshot(optimizer, scheduler)
        result = original_step(forward_step_func, data_iterator, model, optimizer, scheduler, config, **kwargs)
        snapshots.append((before, _optimizer_snapshot(optimizer, scheduler), result[1]))
        return result

    training_mod.train_step = snapshot_step
    try:
        records = run_pretrain("pretrain_gpt", SHORT + ["--fp16", "--initial-loss-scale", "4096", "--hysteresis", "1",
                                                        "--no-check-for-nan-in-loss-and-grad"])
    finally:
        training_mod.train_step = original_step
        del os.environ["MEGATRON_FAULT_INJECT"]
    out["fp16"] = {
        "skipped": [r["skipped"] for r in records], "scale": [r["loss_scale"] for r in records],
        "lines": [r.get("line") for r in records],
        "unchanged": [_identical(before, after) for before, after, _ in snapshots],
        "sched_steps": [after[1] for _, after, _ in snapshots],
    }
    out["rank"] = rank
    del train_helpers
    return out


LINE_COUNTS = re.compile(r"number of skipped iterations:\s+(\d+) \| number of nan iterations:\s+(\d+) \|$")


def test_nan_check_and_fp16_skip_in_process():
    results = run_distributed(numerics_body, 2, timeout=300)
    for out in results:
        message, records, same = out["grad"]
        assert same and message.startswith("iteration 3: found NaN in local grad norm before the data-parallel "
                                           "reduction on rank 1 (node "), message
        assert "--check-for-nan-in-loss-and-grad" in message and records == [1, 2]
        message, records, same = out["loss"]
        assert same and message.startswith("iteration 2: found NaN in local forward loss calculation on rank 0 (node "), \
            message
        assert records == [1]
    assert results[0]["grad"][0] == results[1]["grad"][0] and results[0]["loss"][0] == results[1]["loss"][0]

    for out in results:
        fp16 = out["fp16"]
        assert fp16["skipped"] == [0, 0, 1, 0, 1, 0]
        assert fp16["scale"] == [4096.0, 4096.0, 2048.0, 2048.0, 1024.0, 1024.0]
        # A skipped step leaves Adam's moments and step, the main params and the LR schedule bit-identical
        # (Megatron steps the scheduler only when the update succeeded); a taken step changes them.
        assert fp16["unchanged"] == [False, False, True, False, True, False]
        gbs = 4
        assert fp16["sched_steps"] == [gbs, 2 * gbs, 2 * gbs, 3 * gbs, 3 * gbs, 4 * gbs]
    lines = results[1]["fp16"]["lines"]  # the last rank prints the log line
    counts = [tuple(int(x) for x in LINE_COUNTS.search(line).groups()) for line in lines]
    # NaN gradient: a skipped iteration with a finite loss; NaN loss: skipped and counted as a nan iteration.
    assert counts == [(0, 0), (0, 0), (1, 0), (0, 0), (1, 1), (0, 0)]


def _launch_two_ranks(argv, env_extra, port):
    env = dict(os.environ, PYTHONPATH=REPO, MEGATRON_FORCE_CPU="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE="2", OMP_NUM_THREADS="1", **env_extra)
    procs = [subprocess.Popen([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *argv],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO) for r in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a rank hung after a NaN") from None
        outs.append((p.returncode, out, err))
    return outs


def test_nan_check_end_to_end_every_rank_exits_and_message_printed_once():
    from helpers.train_helpers import GPT_ARGS

    from helpers.dist_harness import free_port

    args = list(GPT_ARGS) + SHORT + ["--check-for-nan-in-loss-and-grad", "--rerun-mode", "disabled"]
    start = time.time()
    outs = _launch_two_ranks(args, {"MEGATRON_FAULT_INJECT": "nan_grad:rank=1:iter=3"}, free_port())
    elapsed = time.time() - start
    assert [rc for rc, _, _ in outs] == [1, 1], [o[2][-2000:] for o in outs]
    text = "".join(out + err for _, out, err in outs)
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.fullmatch(
        r"error: iteration 3: found NaN in local grad norm before the data-parallel reduction on rank 1 \(node \S+, "
        r"device cpu:1\): unexpected result nan \(--rerun-mode disabled\); stopping the run on every rank "
        r"\(--check-for-nan-in-loss-and-grad\)\. Lower --lr, check the data of this iteration, or resume from the "
        r"last checkpoint", errors[0]), errors
    assert "Traceback" not in text
    print(f"nan check end-to-end: 2 ranks exited with code 1 in {elapsed:.1f} s")

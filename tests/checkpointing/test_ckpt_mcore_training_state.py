"""``pretrain_gpt.py --load`` resumes a checkpoint that Megatron-LM's training loop wrote (made by the real megatron-core
0.16.1 in a subprocess: tests/checkpointing/mcore_oracle_train_child.py).

The oracle trains a TP=2 GPT for two Adam steps, advances its scheduler to iteration 7 (28 samples at global batch 4)
and saves what Megatron-LM's ``save_checkpoint`` saves. Here ``pretrain_gpt`` (TP=2 on 2 gloo ranks, same layout, so
the RNG state is loaded too) resumes it with the flags that describe the same run and trains iterations 8 and 9.
Checked against the oracle's own numbers: the logits of a fixed batch right after loading (1e-5 relative), the Adam
moments of every parameter of rank 0 (exact), the iteration, consumed samples, the scheduler's step count and
learning rate; then the first resumed iteration is 8 and its learning rate is the cosine schedule at sample 32
computed here by hand.
"""
import math
import os

import pytest
import torch

from helpers.dist_harness import run_distributed
from helpers.mcore_oracle import require_oracle, run_oracle
from helpers.numerics import rel_err

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcore_oracle_train_child.py")
SEQ, GBS, ITER = 32, 4, 7
LR, MIN_LR, WARMUP_ITERS, DECAY_ITERS = 1e-2, 1e-3, 2, 20
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def oracle():
    return require_oracle()


def resume_body(ckpt):
    """pretrain_gpt --load ckpt for two iterations; on rank 0 also what was loaded, captured right after loading."""
    from helpers.ckpt_helpers import run_leg
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.training import get_args
    from megatron.training import training as training_mod
    from megatron.training.utils import unwrap_model

    seen = {}
    original_load = training_mod.load_checkpoint

    def capturing_load(model, optimizer, scheduler, *a, **k):
        iteration = original_load(model, optimizer, scheduler, *a, **k)
        gpt = unwrap_model(model)[0]
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, 99, (2, SEQ), generator=g)
        pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
        mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
        with torch.no_grad():
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(gpt(ids, pos, mask))
        names = {id(p): n for n, p in gpt.named_parameters()}
        inner = optimizer.optimizer
        moments = {}
        for group in inner.param_groups:
            for p in group["params"]:
                main = getattr(optimizer, "main_to_model", {}).get(p, p)
                moments[names.get(id(main), names.get(id(p)))] = {k: inner.state[p][k].clone()
                                                                  for k in ("exp_avg", "exp_avg_sq")}
        seen.update(iteration=iteration, logits=logits.float(), moments=moments, lr=inner.param_groups[0]["lr"],
                    consumed=get_args().consumed_train_samples, num_steps=scheduler.num_steps,
                    tp_rank=ps.get_tensor_model_parallel_rank())
        return iteration

    training_mod.load_checkpoint = capturing_load
    try:
        records, _ = run_leg([
            "--tensor-model-parallel-size", "2", "--ckpt-format", "torch_dist", "--load", ckpt,
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "99", "--mock-data", "--train-iters", "9",
            "--lr-decay-iters", str(DECAY_ITERS), "--log-interval", "1", "--eval-interval", "1000",
        ])
    finally:
        training_mod.load_checkpoint = original_load
    return {"seen": seen, "records": records}


def test_pretrain_gpt_resumes_megatron_training_checkpoint(oracle, tmp_path):
    ckpt, ref_path = tmp_path / "megatron_run", tmp_path / "oracle.pt"
    run_oracle([CHILD, "2", "2", ckpt, ref_path], cwd=tmp_path)
    ref = torch.load(ref_path, weights_only=False)

    out = run_distributed(resume_body, 2, str(ckpt), timeout=300)[0]
    seen, records = out["seen"], out["records"]
    assert seen["iteration"] == ITER
    assert seen["consumed"] == ITER * GBS
    assert seen["num_steps"] == ref["sched"]["num_steps"] == ITER * GBS
    assert seen["lr"] == pytest.approx(ref["lr"], rel=1e-12)
    err = rel_err(seen["logits"], ref["logits"])
    print(f"logits after loading Megatron's training checkpoint: max rel diff {err:.2e}")
    assert err <= 1e-5
    assert set(seen["moments"]) == set(ref["moments"]), sorted(set(seen["moments"]) ^ set(ref["moments"]))
    for name, state in ref["moments"].items():
        for kind, expected in state.items():
            assert torch.equal(seen["moments"][name][kind], expected), f"{kind} of {name} differs"

    assert [r["iteration"] for r in records] == [ITER + 1, ITER + 2]
    warmup, decay, step = WARMUP_ITERS * GBS, DECAY_ITERS * GBS, (ITER + 1) * GBS  # the lr logged after iteration 8
    ratio = (step - warmup) / (decay - warmup)
    expected_lr = MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * ratio))
    assert records[0]["lr"] == pytest.approx(expected_lr, rel=1e-9)
    assert all(math.isfinite(r["loss"]["lm loss"]) for r in records)

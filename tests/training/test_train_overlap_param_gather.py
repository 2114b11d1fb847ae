"""pretrain_gpt.py end to end with today's training features, on gloo ranks.

1. --overlap-param-gather (DP = 2, distributed optimizer, several small buckets): the per-iteration losses equal
   those of the synchronous all-gather within 1e-6 relative, and the step really defers the gather (the
   synchronous all-gather runs 0 times instead of once per iteration).
2. A shrunk llama3 (RMSNorm, SwiGLU, RoPE, GQA, untied, no bias) with bf16, TP = 2 with sequence parallelism,
   the distributed optimizer, --overlap-grad-reduce --overlap-param-gather, --decoupled-lr,
   --calculate-per-token-loss, --manual-gc, --attention-backend auto, --no-create-attention-mask-in-dataloader,
   --rotary-base and --mock-data: the loss falls, equals the run without
   --overlap-param-gather within 1e-6 relative, the logged LR is the default group's (not the decoupled one),
   and the gradient buffers are fp32 (bf16 with --grad-reduce-in-bf16, which also trains).
"""
import math

from helpers.dist_harness import run_distributed
from helpers.train_helpers import run_pretrain

REL_TOL = 1e-6
SMALL = ["--mock-data", "--use-mcore-models", "--num-layers", "2", "--train-iters", "8", "--log-interval", "1",
         "--eval-interval", "1000", "--eval-iters", "1"]


def _run_recording(extra):
    """run_pretrain, also recording the DDP buffers' gradient dtypes / bucket counts and the synchronous
    parameter all-gathers of the distributed optimizer."""
    from megatron.core.distributed.param_and_grad_buffer import ParamAndGradBuffer
    from megatron.training import training as training_mod

    seen = {"grad_dtypes": set(), "buckets": 0, "sync_gathers": 0}
    original_get_model, original_gather = training_mod.get_model, ParamAndGradBuffer.all_gather_params

    def get_model(*args, **kwargs):
        model = original_get_model(*args, **kwargs)
        for chunk in model:
            for buffer in chunk.param_and_grad_buffers:
                seen["grad_dtypes"].add(str(buffer.grad_dtype))
                seen["buckets"] += len(buffer.buckets)
        return model

    def all_gather_params(self):
        seen["sync_gathers"] += 1
        return original_gather(self)

    training_mod.get_model, ParamAndGradBuffer.all_gather_params = get_model, all_gather_params
    try:
        records = run_pretrain("pretrain_gpt", SMALL + list(extra))
    finally:
        training_mod.get_model, ParamAndGradBuffer.all_gather_params = original_get_model, original_gather
    return {"losses": [r["loss"]["lm loss"] for r in records], "lrs": [r["lr"] for r in records], **seen}


def runs_body(runs):
    return {name: _run_recording(extra) for name, extra in runs}


def _close(a, b):
    return all(abs(x - y) <= REL_TOL * abs(y) for x, y in zip(a, b)) and len(a) == len(b)


DP_BASE = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "3000"]


def test_overlap_param_gather_dp2_matches_sync_gather():
    runs = [("sync", DP_BASE), ("overlap", DP_BASE + ["--overlap-param-gather"])]
    out = run_distributed(runs_body, 2, runs, timeout=300)[-1]
    sync, overlap = out["sync"], out["overlap"]
    assert sync["buckets"] >= 3, sync["buckets"]
    assert len(sync["losses"]) == 8 and all(math.isfinite(x) for x in sync["losses"])
    assert _close(overlap["losses"], sync["losses"]), (overlap["losses"], sync["losses"])
    assert sync["sync_gathers"] >= 8  # at least once per step
    assert overlap["sync_gathers"] == 0, overlap["sync_gathers"]


LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--no-rope-fusion",
         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
         "--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
         "--overlap-grad-reduce", "--ddp-bucket-size", "5000", "--decoupled-lr", "5e-3",
         "--decoupled-min-lr", "5e-4", "--calculate-per-token-loss", "--manual-gc", "--train-iters", "12",
         "--attention-backend", "auto", "--no-create-attention-mask-in-dataloader", "--rotary-base", "500000",
         # A small vocabulary makes the mock documents (1, 2, 3, ... wrapping around) learnable in 12 steps.
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "255"]


def test_llama3_like_integration():
    runs = [("sync", LLAMA), ("overlap", LLAMA + ["--overlap-param-gather"]),
            ("bf16_grads", LLAMA + ["--overlap-param-gather", "--grad-reduce-in-bf16"])]
    out = run_distributed(runs_body, 2, runs, timeout=400)[-1]
    sync, overlap, bf16 = out["sync"], out["overlap"], out["bf16_grads"]
    for run in (sync, overlap, bf16):
        losses = run["losses"]
        assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses
    assert _close(overlap["losses"], sync["losses"]), (overlap["losses"], sync["losses"])
    assert sync["grad_dtypes"] == {"torch.float32"} and bf16["grad_dtypes"] == {"torch.bfloat16"}
    # Logged LR: the default group's warmup (--lr 1e-2, 2 warmup iterations): 5e-3 then 1e-2, not 2.5e-3 / 5e-3.
    assert abs(sync["lrs"][0] - 5e-3) < 1e-12 and abs(sync["lrs"][1] - 1e-2) < 1e-12, sync["lrs"][:2]

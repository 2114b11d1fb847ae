"""The bytes each parallel dimension communicates per iteration, counted against the formulas on paper.

A few iterations of a tiny GPT run through the real training path (``pretrain_gpt.py`` via
``train_helpers.run_pretrain``: schedules, DDP grad buffer, optimizer, ``finalize_model_grads``) under gloo,
with ``megatron.core.comm_accounting.CommAccountant`` active inside ``train_step`` only (setup collectives
such as the initial parameter broadcast and the tied-embedding sync are outside). For every rank the counted
calls and payload bytes per (process group, operation) must equal, exactly, the formulas of
docs/performance.md ("Scaling on paper"), written out independently in ``expected_volume`` below —
including the small terms (data broadcast over TP, the reported loss summed over DP, gradient-norm all-reduce, the
rerun state machine's agreement).
"""
import os
from collections import defaultdict

import pytest

from helpers.dist_harness import run_distributed  # noqa: E402

# The model of train_helpers.GPT_ARGS with 4 layers (8 for the interleaved schedule) and --mock-data
# (padded vocabulary 8192).
H, S, B, V = 32, 32, 1, 8192
GLOBAL_BATCH = 4


def _layout(tp=1, pp=1, dp=1, sp=False, distopt=False, vpp=1, bf16=False, layers=4):
    extra = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
             "--num-layers", str(layers)]
    if sp:
        extra.append("--sequence-parallel")
    if distopt:
        extra.append("--use-distributed-optimizer")
    if vpp > 1:
        extra += ["--num-layers-per-virtual-pipeline-stage", str(layers // (pp * vpp))]
    if bf16:
        extra.append("--bf16")
    return dict(t=tp, p=pp, d=dp, sp=sp, distopt=distopt, v=vpp, bf16=bf16, L=layers), extra


LAYOUTS = {
    2: {"tp2": _layout(tp=2), "tp2-sp": _layout(tp=2, sp=True), "pp2": _layout(pp=2), "dp2": _layout(dp=2),
        "dp2-distopt": _layout(dp=2, distopt=True)},
    4: {"tp2-pp2-sp": _layout(tp=2, pp=2, sp=True), "pp4-vpp2": _layout(pp=4, vpp=2, layers=8),
        "tp2-dp2-distopt-bf16": _layout(tp=2, dp=2, distopt=True, bf16=True)},
}


def expected_volume(c, pp_rank):
    """{(group, op): [calls, payload bytes]} of one rank (pipeline stage ``pp_rank``) for one iteration.

    The formulas of docs/performance.md: s, b, h, L, V, t, p, d, m micro-batches, v model chunks per stage;
    E bytes per activation element, G per gradient-buffer element, P per parameter.
    """
    t, p, d, v, sp, L = c["t"], c["p"], c["d"], c["v"], c["sp"], c["L"]
    s, b, h = S, B, H
    m = GLOBAL_BATCH // (B * d)
    E = P = 2 if c["bf16"] else 4
    G = 4  # fp32 parameters, or bf16 (which forces --accumulate-allreduce-grads-in-fp32)
    first, last = pp_rank == 0, pp_rank == p - 1
    layers = L // p  # on this stage (all its model chunks)
    act = s * b * h * E  # one full [s, b, h] activation
    out = defaultdict(lambda: [0, 0])

    def add(group, op, calls, nbytes):
        out[(group, op)][0] += calls
        out[(group, op)][1] += nbytes

    # --- tensor parallel, per micro-batch -------------------------------------------------------------
    # get_batch: TP rank 0 broadcasts sizes (int64, 5 per key; skipped when t == 1, where every rank already
    # knows them) then data: tokens, labels, position_ids (int64) and loss_mask (fp32), on every stage and
    # model chunk, and also when t == 1.
    sizes_calls, sizes_bytes = (2, 3 * 5 * 8 + 5 * 8) if t > 1 else (0, 0)
    add("tp", "broadcast", (2 + sizes_calls) * m * v, m * v * (sizes_bytes + 3 * b * s * 8 + b * s * 4))
    if t > 1:
        ce = 3 * s * b * 4  # vocab-parallel cross entropy: max, target logit, sum of exp (fp32 [s, b])
        if not sp:
            # per layer: fwd all-reduce of the attention and MLP row-parallel outputs, bwd all-reduce of the
            # QKV and fc1 column-parallel input grads; embedding fwd; output layer bwd (input grad).
            n = 4 * layers + first + last
            add("tp", "all_reduce", m * (n + 3 * last), m * (n * act + last * ce))
        else:
            # per layer: fwd all-gather before QKV/fc1, reduce-scatter after proj/fc2; bwd all-gather of the
            # output grads of proj/fc2, re-gather of the QKV/fc1 inputs for the weight grads, reduce-scatter
            # of the QKV/fc1 input grads. Embedding: fwd all-reduce then split (bwd all-gather). Output
            # layer: fwd all-gather, bwd re-gather + reduce-scatter.
            add("tp", "all_gather", m * (6 * layers + first + 2 * last), m * (6 * layers + first + 2 * last) * act)
            add("tp", "reduce_scatter", m * (4 * layers + last), m * (4 * layers + last) * act)
            add("tp", "all_reduce", m * (first + 3 * last), m * (first * act + last * ce))
            # finalize_model_grads: grads of the TP-replicated params that saw a sequence shard (2 layer
            # norms with weight and bias, 2 row-parallel biases per layer; final norm), one coalesced call.
            add("tp", "all_reduce", 1, (6 * h * layers + 2 * h * last) * G)

    # --- pipeline parallel, per micro-batch and model chunk -------------------------------------------
    if p > 1:
        pipe = (s // t if sp else s) * b * h * P  # [s/t if SP, b, h] in the pipeline (= params) dtype
        fwd_send, bwd_send = m * (v - last), m * (v - first)
        add("pp", "send", fwd_send + bwd_send, (fwd_send + bwd_send) * pipe)
        add("pp", "recv", fwd_send + bwd_send, (fwd_send + bwd_send) * pipe)  # mirrored: v - first, v - last

    # --- tied word embedding between the first and last stage, per iteration --------------------------
    if p > 1 and (first or last):
        add("embedding", "all_reduce", 1, V // t * h * G)

    # --- data parallel ----------------------------------------------------------------------------------
    if last:
        add("dp", "all_reduce", 1, 8)  # the reported [loss sum, token count] (fp32 pair), once per iteration
    if d > 1:
        layer_params = 12 * h * h // t + 7 * h // t + 6 * h
        embedding = V // t * h if (first or (last and p > 1)) else 0
        rest = layers * layer_params + first * s * h + last * 2 * h  # + positions (max-pos = s), final norm
        if not c["distopt"]:
            add("dp", "all_reduce", 1, (embedding + rest) * G)  # one bucket without --overlap-grad-reduce
        else:
            # the tied embedding has a bucket of its own; each bucket is padded to a multiple of d
            buckets = [n for n in (embedding, rest) if n]
            padded = sum(-(-n // d) * d for n in buckets)
            add("dp", "reduce_scatter", len(buckets), padded * G)
            add("dp", "all_gather", len(buckets), padded * P)

    # --- gradient norm (--clip-grad 1.0): one scalar over TP x PP, or the world with the dist. optimizer; fp32 on
    # GPUs as in Megatron, fp64 on CPU (clip_grads accumulates the sum of squares in fp64 there), so 8 bytes here
    add("world" if c["distopt"] else "mp", "all_reduce", 1, 8)
    # --- the rerun state machine's verdict on the iteration (--rerun-mode validate_results): 6 int64 over the world
    add("world", "all_reduce", 1, 48)
    return {k: tuple(v) for k, v in out.items()}


def comm_volume_body(layouts):
    """Run each layout for 2 iterations; return per layout (pp_rank, counted volume of each iteration)."""
    from helpers import train_helpers
    from megatron.core import parallel_state as ps
    from megatron.core.comm_accounting import CommAccountant
    from megatron.training import training as training_mod

    results = {}
    original = training_mod.train_step
    for name, (_, extra) in layouts.items():
        iterations, where = [], {}

        def counted(*args, **kwargs):
            accountant = CommAccountant()
            with accountant:
                out = original(*args, **kwargs)
            iterations.append({(g, op): (v["calls"], v["bytes"])
                               for g, ops in accountant.summary().items() for op, v in ops.items()})
            where["pp_rank"] = ps.get_pipeline_model_parallel_rank()
            return out

        training_mod.train_step = counted
        try:
            train_helpers.run_pretrain("pretrain_gpt", ["--mock-data", "--train-iters", "2",
                                                        "--lr-warmup-iters", "0", "--eval-iters", "0"] + extra)
        finally:
            training_mod.train_step = original
        results[name] = (where["pp_rank"], iterations)
    return results


def _table(name, rank, counted, expected):
    rows = [f"{name} rank {rank}: group/op  counted (calls, bytes)  formula (calls, bytes)"]
    for key in sorted(set(counted) | set(expected)):
        mark = "" if counted.get(key) == expected.get(key) else "   <-- differs"
        rows.append(f"  {key[0]:>9}/{key[1]:<14} {str(counted.get(key)):>18} {str(expected.get(key)):>18}{mark}")
    return "\n".join(rows)


@pytest.mark.parametrize("world", [2, 4])
def test_counted_bytes_match_the_formulas(world):
    layouts = LAYOUTS[world]
    results = run_distributed(comm_volume_body, world, layouts, timeout=300)
    failures, report = [], []
    for name, (config, _) in layouts.items():
        for rank, per_rank in enumerate(results):
            pp_rank, iterations = per_rank[name]
            assert len(iterations) == 2
            expected = expected_volume(config, pp_rank)
            report.append(_table(name, rank, iterations[-1], expected))
            for counted in iterations:
                if counted != expected:
                    failures.append(report[-1])
                    break
    print("\n".join(report))
    assert not failures, "counted communication differs from the formulas:\n" + "\n".join(failures)


def test_ring_bytes_convention_and_patching_is_undone():
    import torch.distributed as dist

    from megatron.core.comm_accounting import CommAccountant, ring_bytes

    assert ring_bytes("all_reduce", 1000, 4) == 1500  # 2 (t-1)/t N
    assert ring_bytes("all_gather", 1000, 4) == ring_bytes("reduce_scatter", 1000, 4) == 750
    assert ring_bytes("send", 1000, 2) == 1000 and ring_bytes("recv", 1000, 2) == 0
    assert ring_bytes("all_reduce", 1000, 1) == 0  # a group of one rank sends nothing
    originals = (dist.all_reduce, dist.isend, dist.distributed_c10d.isend)
    with CommAccountant():
        assert dist.all_reduce is not originals[0] and dist.isend is dist.distributed_c10d.isend
    assert (dist.all_reduce, dist.isend, dist.distributed_c10d.isend) == originals

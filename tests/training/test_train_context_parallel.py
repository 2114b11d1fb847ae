"""pretrain_gpt with context parallelism trains like --context-parallel-size 1: the same losses (1e-5 relative,
every iteration) on 4 gloo ranks, a RoPE model. CP=1 is DP=4 (one micro-batch of the global batch of 4 per rank);
CP=2 (p2p) is DP=2; CP=4 (all_gather, and a2a with 8 heads against its own 8-head CP=1 run) is DP=1 with 4
micro-batches; PP=2 x CP=2 runs the 1F1B schedule with
activations of S/CP tokens between stages. Gradients are reduced over DP x CP, the reported loss summed over
DP x CP; all layouts read the same 4 samples per step. The per-token runs save torch_dist checkpoints: CP=1
resumed from the CP=2 one gives the losses of CP=1 resumed from its own.

The mock data's loss mask is all ones, so the default objective (the mean over DP x CP ranks and micro-batches of
per-rank token means) equals the global token mean in both layouts; the --calculate-per-token-loss run (exact
for any mask) uses --eod-mask-loss as well.
"""
from helpers.dist_harness import run_distributed

BASE = ["--mock-data", "--num-layers", "2", "--train-iters", "5", "--log-interval", "1", "--eval-interval", "1000",
        "--eval-iters", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--seq-length", "64",
        "--max-position-embeddings", "64", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--no-create-attention-mask-in-dataloader", "--global-batch-size", "4"]


def cp_train_body(runs):
    from helpers.train_helpers import run_pretrain
    from megatron.core.transformer import context_parallel

    calls = {}
    original = context_parallel.context_parallel_attention

    def counting(*args, comm_type="p2p", **kwargs):  # proves the CP runs really ran the CP attention
        calls[comm_type] = calls.get(comm_type, 0) + 1
        return original(*args, comm_type=comm_type, **kwargs)

    context_parallel.context_parallel_attention = counting
    try:
        out = {}
        for name, extra in runs:
            calls.clear()
            out[name] = [r["loss"].get("lm loss") for r in run_pretrain("pretrain_gpt", BASE + extra)]
            out[name + "_calls"] = dict(calls)
        return out
    finally:
        context_parallel.context_parallel_attention = original


def test_cp2_losses_equal_cp1(tmp_path):
    per_token = ["--calculate-per-token-loss", "--eod-mask-loss", "--use-distributed-optimizer", "--ckpt-format",
                 "torch_dist", "--save-interval", "5"]
    ckpt = {cp: str(tmp_path / f"ckpt_cp{cp}") for cp in (1, 2)}
    resume = per_token + ["--train-iters", "7", "--no-load-rng", "--use-checkpoint-opt_param-scheduler"]
    runs = [("cp1", []), ("cp2_p2p", ["--context-parallel-size", "2"]),
            ("cp4_all_gather", ["--context-parallel-size", "4", "--cp-comm-type", "all_gather"]),
            ("cp4_a2a", ["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-attention-heads", "8",
                         "--kv-channels", "8"]),
            ("pp2_cp2", ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"]),
            ("cp1_per_token", per_token + ["--save", ckpt[1]]),
            ("cp2_per_token", per_token + ["--context-parallel-size", "2", "--save", ckpt[2]]),
            # torch_dist checkpoints (distributed optimizer sharded over DP x CP = 4 in both) are CP-independent:
            # CP=1 resumed from the CP=2 checkpoint trains on like CP=1 resumed from its own.
            ("cp1_from_cp1", resume + ["--load", ckpt[1]]), ("cp1_from_cp2", resume + ["--load", ckpt[2]])]
    runs.insert(3, ("cp4_a2a_vs_cp1", ["--num-attention-heads", "8", "--kv-channels", "8"]))  # a2a's reference
    out = run_distributed(cp_train_body, 4, runs, timeout=600)[-1]
    worst = {}
    for ref_name, names in (("cp1", ("cp2_p2p", "cp4_all_gather", "pp2_cp2")), ("cp1_per_token", ("cp2_per_token",))):
        ref = out[ref_name]
        assert len(ref) == 5 and all(x == x for x in ref), out
        for name in names:
            assert len(out[name]) == 5, out
            for a, b in zip(out[name], ref):
                assert abs(a - b) <= 1e-5 * abs(b), (name, out[name], ref)
            worst[name] = max(abs(a - b) / abs(b) for a, b in zip(out[name], ref))
    assert out["cp1_calls"] == {} and out["cp1_per_token_calls"] == {}
    assert set(out["cp2_p2p_calls"]) == {"p2p"} and set(out["cp4_all_gather_calls"]) == {"all_gather"}, out
    assert set(out["pp2_cp2_calls"]) == {"p2p"} and set(out["cp4_a2a_calls"]) == {"a2a"}
    for a, b in zip(out["cp4_a2a"], out["cp4_a2a_vs_cp1"]):  # a2a splits 8 heads over 4 ranks: its own CP=1 run
        assert abs(a - b) <= 1e-5 * abs(b), (out["cp4_a2a"], out["cp4_a2a_vs_cp1"])
    assert set(out["cp2_per_token_calls"]) == {"p2p"}
    assert len(out["cp1_from_cp1"]) == 2 and len(out["cp1_from_cp2"]) == 2, out
    for a, b in zip(out["cp1_from_cp2"], out["cp1_from_cp1"]):
        assert abs(a - b) <= 1e-5 * abs(b), (out["cp1_from_cp2"], out["cp1_from_cp1"])
    worst["cp1_from_cp2"] = max(abs(a - b) / abs(b) for a, b in zip(out["cp1_from_cp2"], out["cp1_from_cp1"]))
    # The runs differ from each other (the test would see a wrong objective): loss falls over the iterations.
    assert out["cp1"][-1] < out["cp1"][0]
    print("max relative loss difference vs CP=1:", worst)

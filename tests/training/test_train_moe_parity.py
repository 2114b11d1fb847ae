"""MoE GPT training runs: the per-iteration losses (LM loss and Megatron's logged load_balancing_loss / z_loss)
and grad norms (1e-4) are layout-independent (losses 1e-5 relative) across EP=1, EP=2 (both dispatchers), EP=2 x
TP=2 (+SP, expert TP 2), grouped GEMM on and off, PP=2, the distributed optimizer, context parallelism (CP=2,
EP=2 x CP=2), and selective recompute of the MoE layer (--moe-layer-recompute; --recompute-modules moe moe_act). Every run starts from the same model (train_helpers.deterministic_init: experts keyed by global layer
and global expert index). Dropless routing, fp32; one 4-rank gloo spawn runs every layout in process. Aux-loss-free
balancing (sigmoid routing, --moe-router-enable-expert-bias): losses and the updated biases equal for EP=1, EP=2 x
TP=2 and EP=2 x PP=2, and the update changes later losses. global_aux_loss (EP 1/2/4 at DP 4) and sinkhorn routing
(EP 1/2): losses equal."""
import pytest
import torch

from helpers.dist_harness import run_distributed
from helpers.train_helpers import preprocess_corpus_slice, run_pretrain

MOE = ["--num-layers", "2", "--train-iters", "3", "--log-interval", "1", "--seq-length", "16",
       "--max-position-embeddings", "16", "--swiglu", "--disable-bias-linear", "--num-experts", "4",
       "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]
LAYOUTS = {
    "ep1": [],
    "ep2_allgather": ["--expert-model-parallel-size", "2"],
    "ep2_alltoall": ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
    "ep2_tp2_alltoall_grouped": ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                 "--sequence-parallel", "--moe-token-dispatcher-type", "alltoall",
                                 "--moe-grouped-gemm"],
    "ep2_tp2_allgather": ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                          "--sequence-parallel"],
    "ep4_grouped_alltoall": ["--expert-model-parallel-size", "4", "--moe-grouped-gemm",
                             "--moe-token-dispatcher-type", "alltoall"],
    "ep2_pp2": ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                "--moe-token-dispatcher-type", "alltoall"],
    "ep2_distopt": ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
    # Context parallelism: each CP rank routes its half of every sequence; the load-balancing counts are summed
    # over TP x CP and the partial losses add up to the sequence batch's.
    "cp2_alltoall": ["--context-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
    "ep2_cp2_allgather": ["--expert-model-parallel-size", "2", "--context-parallel-size", "2"],
    # Activation recompute of the MoE layer (dispatch and combine collectives run again in backward): the logged
    # router losses must count one forward, not two.
    "ep2_alltoall_moe_layer_recompute": ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                         "alltoall", "--moe-layer-recompute"],
    "ep2_tp2_grouped_recompute_modules": ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                          "--sequence-parallel", "--moe-token-dispatcher-type", "alltoall",
                                          "--moe-grouped-gemm", "--recompute-granularity", "selective",
                                          "--recompute-modules", "core_attn", "moe", "moe_act"],
}


def moe_layouts_body(data, names):
    from megatron.core.transformer import context_parallel

    calls = []
    original = context_parallel.context_parallel_attention

    def counting(*args, **kwargs):  # proves the CP layouts really split the sequence
        calls.append(1)
        return original(*args, **kwargs)

    context_parallel.context_parallel_attention = counting
    out = {}
    try:
        for name in names:
            calls.clear()
            records = run_pretrain("pretrain_gpt", ["--data-path", data] + MOE + LAYOUTS[name])
            out[name] = [(r["iteration"], r["loss"], r["grad_norm"]) for r in records]
            out[name + "_cp_calls"] = len(calls)
    finally:
        context_parallel.context_parallel_attention = original
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return preprocess_corpus_slice(str(tmp_path_factory.mktemp("moe_data")), num_docs=100)


@pytest.mark.timeout(400)
def test_moe_training_losses_equal_across_layouts(data):
    results = run_distributed(moe_layouts_body, 4, data, list(LAYOUTS), timeout=380)
    # The last rank is on the last pipeline stage in every layout: it logs the losses.
    runs = results[-1]
    cp_calls = {name: runs.pop(name + "_cp_calls") for name in LAYOUTS}
    assert all((cp_calls[name] > 0) == ("cp2" in name) for name in LAYOUTS), cp_calls
    ref = runs["ep1"]
    assert len(ref) == 3
    for iteration, losses, _ in ref:
        assert set(losses) >= {"lm loss", "load_balancing_loss", "z_loss"}, losses
    worst = {}
    for name, records in runs.items():
        assert [r[0] for r in records] == [r[0] for r in ref], name
        for (it, losses, norm), (_, ref_losses, ref_norm) in zip(records, ref):
            for key, value in ref_losses.items():
                err = abs(losses[key] - value) / abs(value)
                worst[(name, key)] = max(worst.get((name, key), 0.0), err)
                assert err <= 1e-5, f"{name} iteration {it} {key}: {losses[key]} vs EP=1 {value}"
            # Grad norms: 1e-4 (the reported norm of the distributed optimizer and of TP=2 + SP runs differs from the
            # TP=1 one by ~4e-5 for dense models too: different summation order of the squares).
            err = abs(norm - ref_norm) / ref_norm
            worst[(name, "grad norm")] = max(worst.get((name, "grad norm"), 0.0), err)
            assert err <= 1e-4, f"{name} iteration {it} grad norm {norm} vs {ref_norm}"
    print("max relative difference to EP=1:", {f"{n}/{k}": f"{v:.1e}" for (n, k), v in worst.items()})


# Aux-loss-free balancing: sigmoid routing with an expert bias that each step moves by the global token counts. The
# counts are summed over TP x DP (x CP), so the bias (and the losses) must not depend on the layout. The tiny model's
# scores are close together, so the bias dominates the choice and swings the loads: by iteration 4 some expert gets
# no token at all, which the grouped-GEMM layout must survive (its empty-expert path once skipped a collective).
BIAS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.05", "--train-iters", "4"]
BIAS_LAYOUTS = {
    "ep1": [],
    "ep2_tp2_alltoall": ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                         "--sequence-parallel", "--moe-token-dispatcher-type", "alltoall"],
    "ep2_pp2": ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "ep4_grouped_alltoall": ["--expert-model-parallel-size", "4", "--moe-grouped-gemm",
                             "--moe-token-dispatcher-type", "alltoall"],
    "ep1_rate0": ["--moe-router-bias-update-rate", "0"],
}


def expert_bias_body(data):
    import importlib

    from megatron.core.transformer.moe.router import TopKRouter

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    original = finalize._finish_router_step
    out = {}
    for name, extra in BIAS_LAYOUTS.items():
        steps = []  # per step: this rank's routers' biases after the update

        def update_and_record(model, config, *groups):  # (the pg_collection, when finalize_model_grads got one)
            original(model, config, *groups)
            steps.append([m.expert_bias.clone() for chunk in model for m in chunk.modules()
                          if isinstance(m, TopKRouter)])

        finalize._finish_router_step = update_and_record
        try:
            records = run_pretrain("pretrain_gpt", ["--data-path", data] + MOE + BIAS + extra)
        finally:
            finalize._finish_router_step = original
        out[name] = ([(r["iteration"], r["loss"].get("lm loss")) for r in records], steps)
    return out


@pytest.mark.timeout(300)
def test_expert_bias_training_is_layout_independent(data):
    results = run_distributed(expert_bias_body, 4, data, timeout=280)
    ref, ref_steps = results[-1]["ep1"]
    assert [it for it, _ in ref] == [1, 2, 3, 4] and len(ref_steps) == 4
    for name in ("ep2_tp2_alltoall", "ep2_pp2", "ep4_grouped_alltoall"):
        losses = results[-1][name][0]
        for (it, loss), (_, ref_loss) in zip(losses, ref):
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), f"{name} iteration {it}: {loss} vs EP=1 {ref_loss}"
    # Each step's biases: sums of steps of +-0.05 or 0 (fp32), the same on every rank and in every layout (with PP=2
    # layer 1's router is on the first stage, layer 2's on the last).
    ref_bias = torch.stack([torch.stack(step) for step in ref_steps])  # [step, layer, expert]
    units = ref_bias / 0.05
    assert torch.allclose(units, units.round(), atol=1e-4) and float(units.abs().max()) > 0, units
    for rank_out in results:
        for name in ("ep1", "ep2_tp2_alltoall", "ep4_grouped_alltoall"):
            assert torch.equal(torch.stack([torch.stack(s) for s in rank_out[name][1]]), ref_bias), name
    pp = [torch.stack(a + b) for a, b in zip(results[0]["ep2_pp2"][1], results[-1]["ep2_pp2"][1])]
    assert torch.equal(torch.stack(pp), ref_bias)
    # The update changes the routing of later steps: with rate 0 the first loss is the same, a later one is not.
    frozen = results[-1]["ep1_rate0"][0]
    assert frozen[0][1] == ref[0][1] and any(abs(a[1] - b[1]) > 1e-5 * abs(b[1]) for a, b in zip(frozen, ref))


# Global-batch load balancing: the counts are summed over TP x DP (x CP) and averaged over the micro-batches of the
# step so far, so the losses depend on the number of micro-batches per rank (as in Megatron): the layouts compared
# keep DP = 4 (expert parallelism is carved out of DP) with two micro-batches each.
GLOBAL = ["--moe-router-load-balancing-type", "global_aux_loss", "--global-batch-size", "8"]
GLOBAL_LAYOUTS = {
    "ep1": [],
    "ep2_alltoall": ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
    "ep4_grouped_alltoall": ["--expert-model-parallel-size", "4", "--moe-grouped-gemm",
                             "--moe-token-dispatcher-type", "alltoall"],
}


# Sinkhorn routing (no aux loss): the balanced choice is per micro-batch of local tokens, so EP does not change it.
SINKHORN = ["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0"]


def losses_body(data, layouts):
    return {name: [(r["iteration"], r["loss"]) for r in
                   run_pretrain("pretrain_gpt", ["--data-path", data] + MOE + extra)] for name, extra in layouts}


@pytest.mark.timeout(300)
def test_global_aux_loss_and_sinkhorn_training_are_layout_independent(data):
    layouts = [(name, GLOBAL + extra) for name, extra in GLOBAL_LAYOUTS.items()]
    layouts += [("sinkhorn_ep1", SINKHORN), ("sinkhorn_ep2_alltoall", SINKHORN + GLOBAL_LAYOUTS["ep2_alltoall"])]
    runs = run_distributed(losses_body, 4, data, layouts, timeout=280)[-1]
    sinkhorn, sinkhorn_ref = runs.pop("sinkhorn_ep2_alltoall"), runs.pop("sinkhorn_ep1")
    assert [set(losses) for _, losses in sinkhorn_ref] == [{"lm loss", "z_loss"}] * 3, sinkhorn_ref
    for (it, losses), (_, ref_losses) in zip(sinkhorn, sinkhorn_ref):
        for key, value in ref_losses.items():
            assert abs(losses[key] - value) <= 1e-5 * abs(value), f"sinkhorn EP=2 iteration {it} {key}: {losses[key]}"
    ref = runs["ep1"]
    assert sinkhorn_ref[0][1]["lm loss"] != ref[0][1]["lm loss"]  # another routing, another model output
    assert [it for it, _ in ref] == [1, 2, 3]
    for _, losses in ref:
        assert set(losses) == {"lm loss", "global_load_balancing_loss", "z_loss"}, losses
        # Each rank's term is its tokens' share of the global loss (T_tot counts every rank's tokens): summed over
        # TP x DP it is the loss of the whole batch, about 1 for near-balanced routing, like load_balancing_loss.
        assert 0.9 < losses["global_load_balancing_loss"] < 2, losses
    for name in ("ep2_alltoall", "ep4_grouped_alltoall"):
        for (it, losses), (_, ref_losses) in zip(runs[name], ref):
            for key, value in ref_losses.items():
                assert abs(losses[key] - value) <= 1e-5 * abs(value), f"{name} iteration {it} {key}: {losses[key]}"

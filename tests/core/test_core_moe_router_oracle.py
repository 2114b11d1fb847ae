"""MoE routing features against the real megatron-core 0.16.1 (the oracle, run in a subprocess).

Same logits on both sides; compared: the routing map (exactly), the routing probabilities and their gradient with
respect to the logits, for every routing option Megatron has (softmax / pre-softmax / sigmoid scores, top-k
scaling, expert bias, group-limited routing), capacity and token dropping (both drop policies, padding to
capacity, several capacity factors), the scores and map the load-balancing loss uses, and the router's losses
(aux_loss, seq_aux_loss, z-loss) as our ``TopKRouter`` computes and logs them, and the aux-loss-free expert-bias
update. Input jitter is checked directly.
"""

import pytest
import torch

from helpers.mcore_oracle import run_oracle
from helpers.models_helpers import single_rank  # noqa: F401  (fixture)
from helpers.numerics import rel_err

T, E, SEQ, BATCH = 24, 8, 6, 4  # T = SEQ * BATCH tokens
TOL = 1e-6

ROUTING = {
    "softmax_top2": dict(topk=2),
    "softmax_top1": dict(topk=1),
    "pre_softmax_top2": dict(topk=2, use_pre_softmax=True),
    "sigmoid_top2": dict(topk=2, score_function="sigmoid"),
    "sigmoid_top1": dict(topk=1, score_function="sigmoid"),
    "sigmoid_expert_bias": dict(topk=2, score_function="sigmoid", expert_bias="bias"),
    "scaling_factor": dict(topk=2, scaling_factor=2.5),
    "group_limited_softmax": dict(topk=2, num_groups=4, group_topk=2),
    "group_limited_sigmoid": dict(topk=4, num_groups=4, group_topk=2, score_function="sigmoid", scaling_factor=2.0),
    "deepseek_v3": dict(topk=4, num_groups=4, group_topk=2, score_function="sigmoid", scaling_factor=2.5,
                        expert_bias="bias", use_pre_softmax=True),
}
DROPPING = {
    "probs_cf1": ("softmax_top2", 1.0, "probs", False),
    "position_cf1": ("softmax_top2", 1.0, "position", False),
    "probs_cf05": ("softmax_top2", 0.5, "probs", False),
    "probs_pad": ("softmax_top2", 1.0, "probs", True),
    "position_pad_cf15": ("sigmoid_top2", 1.5, "position", True),
}

# DeepSeek-V3's routing flags on a tiny router (hidden 16, 8 experts), bf16 parameters, fp32 routing.
DEEPSEEK_ROUTER = dict(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=E, moe_router_topk=4,
                       moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
                       moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
                       moe_router_pre_softmax=True, moe_router_dtype="fp32",
                       moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01, bf16=True,
                       params_dtype=torch.bfloat16, add_bias_linear=False)

ORACLE = r"""
import sys, torch
from megatron.core.transformer.moe import moe_utils as m
cases = torch.load(sys.argv[1])
out = {}
for name, kw in cases["routing"].items():
    logits = cases["logits"].clone().requires_grad_(True)
    kw = dict(kw)
    if kw.get("expert_bias") == "bias":
        kw["expert_bias"] = cases["expert_bias"]
    probs, rmap = m.topk_routing_with_score_function(logits, **kw)
    (probs * cases["weights"]).sum().backward()
    out[name] = (probs.detach(), rmap, logits.grad)
for name, (base, cf, policy, pad) in cases["dropping"].items():
    probs, rmap = out[base][0], out[base][1]
    topk = cases["routing"][base]["topk"]
    out["drop_" + name] = m.apply_router_token_dropping(probs, rmap, topk, cf, policy, pad)
for fn in ("softmax", "sigmoid"):
    rmap, scores = m.compute_routing_scores_for_aux_loss(cases["logits"], 2, fn)
    out["aux_scores_" + fn] = (rmap, scores)
# The losses of TopKRouter (router.py of 0.16.1), one rank: aux_loss, seq_aux_loss (tokens are [s, b] flattened,
# the batch folded into the expert columns, divided by the batch) and z-loss, each with its coefficient.
logits = cases["logits"]
rmap, scores = m.compute_routing_scores_for_aux_loss(logits, 2, "softmax")
aux = m.switch_load_balancing_loss_func(scores, rmap.sum(0), logits.shape[0], 2, logits.shape[1], 0.01)
s, b = cases["seq_batch"]
seq_scores, seq_map = scores.reshape(s, -1), rmap.reshape(s, -1)
seq = m.switch_load_balancing_loss_func(seq_scores, seq_map.sum(0), s, 2, logits.shape[1], 0.02) / b
z = m.z_loss_func(logits, 0.001)
out["losses"] = {"load_balancing_loss": aux / 0.01, "seq_load_balancing_loss": seq / 0.02, "z_loss": z / 0.001}
# global_aux_loss as the 0.16.1 router accumulates it over a step's micro-batches (here the logits' two halves):
# global += counts; ga_steps += 1; loss with global / ga_steps and T_tot = the micro-batch's tokens (one rank).
total, steps, per_mb = torch.zeros(logits.shape[1]), 0, []
for half in logits.chunk(2):
    rmap, scores = m.compute_routing_scores_for_aux_loss(half, 2, "softmax")
    total, steps = total + rmap.sum(0), steps + 1
    per_mb.append(m.switch_load_balancing_loss_func(scores, total / steps, half.shape[0], 2, logits.shape[1], 0.03)
                  / 0.03)
out["global_aux_loss"] = per_mb
# Sinkhorn routing: megatron-core's sinkhorn(), and TopKRouter.sinkhorn_load_balancing of 0.16.1 written out (the
# class allocates CUDA buffers): top-k of sinkhorn(logits) in training, of the scores in evaluation; sigmoid scores
# for k = 1, softmax for k > 1; weights = scores * map.
out["sinkhorn"] = m.sinkhorn(logits.float())
for k in (1, 2):
    for training in (True, False):
        scores = torch.sigmoid(logits) if k == 1 else torch.softmax(logits, dim=-1, dtype=torch.float32)
        chosen = m.sinkhorn(logits.float()) if training else scores
        _, idx = torch.topk(chosen, k=k, dim=1)
        rmap = torch.zeros_like(logits).int().scatter(1, idx, 1).bool()
        out[f"sinkhorn_routing_{k}_{training}"] = (scores * rmap, rmap)
# seq_aux_loss on sigmoid scores (DeepSeek-V3): the aux scores are sigmoid normalised over the experts.
rmap, scores = m.compute_routing_scores_for_aux_loss(logits, 2, "sigmoid")
seq_scores, seq_map = scores.reshape(s, -1), rmap.reshape(s, -1)
out["seq_aux_loss_sigmoid"] = m.switch_load_balancing_loss_func(seq_scores, seq_map.sum(0), s, 2, logits.shape[1],
                                                                0.02) / b / 0.02
# DeepSeek-V3's router as the 0.16.1 TopKRouter class runs it on CPU (a few torch.cuda calls stubbed, a 1-rank gloo
# group): sigmoid scores, 4 groups of which 2 are kept, top-4, scaling 2.5, expert bias, bf16 parameters with the
# gating GEMM and routing in fp32 (--moe-router-dtype fp32), seq_aux_loss; probs, map, input gradient, logged loss,
# expert-bias token counts.
import os, tempfile
torch.cuda.current_device = lambda: "cpu"
torch.cuda.is_available = lambda: False
if not hasattr(m, "te_general_gemm"):  # defined only when Transformer Engine imports
    m.te_general_gemm = None
fd, init = tempfile.mkstemp(); os.close(fd); os.remove(init)
torch.distributed.init_process_group("gloo", init_method="file://" + init, rank=0, world_size=1)
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.moe.router import TopKRouter
cfg = TransformerConfig(**cases["deepseek_router_config"])
from megatron.core.process_groups_config import ProcessGroupCollection
router = TopKRouter(cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
router.set_layer_number(1)
router.weight.data.copy_(cases["router_weight"])
router.expert_bias.copy_(cases["expert_bias"])
x = cases["router_input"].clone().requires_grad_(True)
probs, rmap = router(x)
(probs.float() * cases["weights"]).sum().backward()
tracker = m.get_moe_layer_wise_logging_tracker()
out["deepseek_router"] = dict(probs=probs.detach(), map=rmap, grad=x.grad,
                              counts=router.local_tokens_per_expert.clone(),
                              seq_aux=tracker["seq_load_balancing_loss"]["values"][0].clone())
# The aux-loss-free bias update, one process: its all-reduce over the TP x DP x CP group is the identity.
torch.distributed.all_reduce = lambda tensor, group=None, **kw: None
m.parallel_state.get_tensor_and_data_parallel_group = lambda **kw: None
out["expert_bias_update"] = m.get_updated_expert_bias(cases["counts"].clone(), cases["bias_before"], 0.01)
torch.save(out, sys.argv[2])
"""


@pytest.fixture(scope="module")
def oracle_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_router_oracle")
    g = torch.Generator().manual_seed(7)
    cases = {"logits": torch.randn(T, E, generator=g) * 2, "weights": torch.randn(T, E, generator=g),
             "expert_bias": torch.randn(E, generator=g) * 0.5, "routing": ROUTING, "dropping": DROPPING,
             "seq_batch": (SEQ, BATCH),
             # Token counts of 3 routers (one at its mean, where the sign is 0) and their biases before the update.
             "counts": torch.tensor([[5., 9., 2., 8.], [6., 6., 6., 6.], [0., 12., 3., 9.]]),
             "bias_before": torch.randn(3, 4, generator=g),
             "deepseek_router_config": DEEPSEEK_ROUTER, "router_weight": torch.randn(E, 16, generator=g),
             "router_input": torch.randn(SEQ, BATCH, 16, generator=g).to(torch.bfloat16)}
    torch.save(cases, tmp / "cases.pt")
    run_oracle(["-c", ORACLE, tmp / "cases.pt", tmp / "out.pt"], cwd=tmp, timeout=240)
    return cases, torch.load(tmp / "out.pt")


def _ours_routing(cases, name):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    kw = dict(ROUTING[name])
    if kw.get("expert_bias") == "bias":
        kw["expert_bias"] = cases["expert_bias"]
    logits = cases["logits"].clone().requires_grad_(True)
    probs, rmap = topk_routing_with_score_function(logits, **kw)
    (probs * cases["weights"]).sum().backward()
    return probs.detach(), rmap, logits.grad


@pytest.mark.parametrize("name", sorted(ROUTING))
def test_routing_matches_megatron_core(oracle_results, name):
    cases, ref = oracle_results
    probs, rmap, grad = _ours_routing(cases, name)
    ref_probs, ref_map, ref_grad = ref[name]
    assert torch.equal(rmap, ref_map), f"{name}: routing map differs"
    assert int(rmap.sum()) == T * ROUTING[name]["topk"]
    assert rel_err(probs, ref_probs) <= TOL, (name, rel_err(probs, ref_probs))
    assert rel_err(grad, ref_grad) <= TOL, (name, rel_err(grad, ref_grad))


@pytest.mark.parametrize("name", sorted(DROPPING))
def test_capacity_and_token_dropping_match_megatron_core(oracle_results, name):
    from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping, get_capacity

    cases, ref = oracle_results
    base, cf, policy, pad = DROPPING[name]
    probs, rmap, _ = _ours_routing(cases, base)
    topk = ROUTING[base]["topk"]
    ours_probs, ours_map = apply_router_token_dropping(probs, rmap, topk, cf, policy, pad)
    ref_probs, ref_map = ref["drop_" + name]
    assert torch.equal(ours_map, ref_map), f"{name}: kept tokens differ"
    assert rel_err(ours_probs, ref_probs) <= TOL
    capacity = get_capacity(T * topk, E, cf)
    per_expert = ours_map.sum(0)
    if pad:
        assert torch.all(per_expert == capacity), per_expert
    else:
        assert int(per_expert.max()) <= capacity and int(ours_map.sum()) < T * topk  # something was dropped


@pytest.mark.parametrize("fn", ["softmax", "sigmoid"])
def test_aux_loss_scores_match_megatron_core(oracle_results, fn):
    from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

    cases, ref = oracle_results
    rmap, scores = compute_routing_scores_for_aux_loss(cases["logits"], 2, fn)
    assert torch.equal(rmap, ref["aux_scores_" + fn][0])
    assert rel_err(scores, ref["aux_scores_" + fn][1]) <= TOL


def _router(**extra):
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=E,
                               moe_router_topk=2, add_bias_linear=False, **extra)
    return TopKRouter(config).train()


def test_router_losses_match_megatron_core(oracle_results, single_rank):
    """aux_loss + seq_aux_loss + z-loss together through our TopKRouter: the logged per-layer values (loss / coeff)
    equal megatron-core's formulas on the same logits."""
    cases, ref = oracle_results
    router = _router(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.01, 0.02],
                     moe_z_loss_coeff=0.001)
    logits = cases["logits"].clone().requires_grad_(True)
    probs, rmap = router.routing(logits, SEQ, BATCH)
    assert set(router.tracked_losses) == set(ref["losses"])
    for name, value in ref["losses"].items():
        assert rel_err(router.tracked_losses[name], value) <= TOL, (name, router.tracked_losses[name], value)


def test_input_jitter_multiplies_by_uniform_noise(single_rank):
    """--moe-input-jitter-eps: the gating input is x * U(1 - eps, 1 + eps), in training and in evaluation."""
    router = _router(moe_input_jitter_eps=0.1)
    x = torch.randn(SEQ, BATCH, 16).abs() + 0.5
    for mode in (router.train, router.eval):
        mode()
        ratio = router.apply_input_jitter(x) / x
        assert float(ratio.min()) >= 0.9 - 1e-6 and float(ratio.max()) <= 1.1 + 1e-6
        assert float(ratio.std()) > 0.02  # noise, not a constant
    assert _router().apply_input_jitter(x) is x  # no eps: untouched


def test_expert_bias_update_matches_megatron_core(oracle_results):
    """--moe-router-enable-expert-bias: bias + rate * sign(mean count - count), per router (a row of the stack)."""
    from megatron.core.transformer.moe.moe_utils import updated_expert_bias

    cases, ref = oracle_results
    ours = updated_expert_bias(cases["counts"], cases["bias_before"], 0.01)
    assert torch.equal(ours, ref["expert_bias_update"]), (ours, ref["expert_bias_update"])
    assert torch.equal(ours[1], cases["bias_before"][1])  # a balanced router keeps its bias


def test_global_aux_loss_matches_megatron_core(oracle_results, single_rank):
    """--moe-router-load-balancing-type global_aux_loss over two micro-batches: the running mean of the counts,
    per micro-batch values as megatron-core's router computes them; the step's reset clears the running counts."""
    cases, ref = oracle_results
    router = _router(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.03)
    values = []
    for half in cases["logits"].chunk(2):
        before = float(router.tracked_losses.get("global_load_balancing_loss", 0.0))
        router.routing(half.clone().requires_grad_(True), half.shape[0] // BATCH, BATCH)
        values.append(float(router.tracked_losses["global_load_balancing_loss"]) - before)
    for ours, theirs in zip(values, ref["global_aux_loss"]):
        assert abs(ours - float(theirs)) <= 1e-6 * abs(float(theirs)), (values, ref["global_aux_loss"])
    assert float(router.ga_steps) == 2 and abs(values[0] - values[1]) > 1e-6  # the second uses both halves' counts
    router.reset_global_aux_loss_tracker()
    assert float(router.ga_steps) == 0 and float(router.global_tokens_per_expert.abs().sum()) == 0


@pytest.mark.parametrize("topk", [1, 2])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_sinkhorn_routing_matches_megatron_core(oracle_results, topk, training):
    """--moe-router-load-balancing-type sinkhorn: the balanced matrix, the chosen experts and their weights."""
    from megatron.core.transformer.moe.moe_utils import sinkhorn, sinkhorn_routing

    cases, ref = oracle_results
    assert rel_err(sinkhorn(cases["logits"].float()), ref["sinkhorn"]) <= TOL
    probs, rmap = sinkhorn_routing(cases["logits"], topk, training)
    ref_probs, ref_map = ref[f"sinkhorn_routing_{topk}_{training}"]
    assert torch.equal(rmap, ref_map) and int(rmap.sum()) == T * topk
    assert rel_err(probs, ref_probs) <= TOL
    if training:  # the balanced choice differs from plain top-k of the scores on these logits
        assert not torch.equal(rmap, ref[f"sinkhorn_routing_{topk}_False"][1])


def test_seq_aux_loss_on_sigmoid_scores_matches_megatron_core(oracle_results, single_rank):
    """seq_aux_loss with sigmoid routing (DeepSeek-V3): the logged value equals megatron-core's formula."""
    cases, ref = oracle_results
    router = _router(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.02,
                     moe_router_score_function="sigmoid")
    router.routing(cases["logits"].clone().requires_grad_(True), SEQ, BATCH)
    ours = router.tracked_losses["seq_load_balancing_loss"]
    assert rel_err(ours, ref["seq_aux_loss_sigmoid"]) <= TOL, (ours, ref["seq_aux_loss_sigmoid"])


def test_deepseek_v3_router_matches_megatron_core_topkrouter(oracle_results, single_rank):
    """The whole TopKRouter with DeepSeek-V3's flags (--moe-router-score-function sigmoid, --moe-router-num-groups,
    --moe-router-group-topk, --moe-router-topk-scaling-factor, expert bias, --moe-router-dtype fp32 with bf16 weights,
    seq_aux_loss) against megatron-core 0.16.1's class on the same weights and bf16 input: the probabilities (fp32, as
    the routing runs in fp32), the map, the input gradient, the logged seq_load_balancing_loss and the bias counts."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    cases, ref = oracle_results
    router = TopKRouter(TransformerConfig(**DEEPSEEK_ROUTER), layer_number=1).train()
    with torch.no_grad():
        router.weight.copy_(cases["router_weight"])
        router.expert_bias.copy_(cases["expert_bias"])
    x = cases["router_input"].clone().requires_grad_(True)
    probs, rmap = router(x)
    (probs.float() * cases["weights"]).sum().backward()
    theirs = ref["deepseek_router"]
    assert router.weight.dtype == torch.bfloat16 and probs.dtype == theirs["probs"].dtype == torch.float32
    assert torch.equal(rmap, theirs["map"]) and int(rmap.sum()) == T * 4
    assert rel_err(probs, theirs["probs"]) <= TOL
    assert x.grad.dtype == theirs["grad"].dtype and rel_err(x.grad, theirs["grad"]) <= 1e-2  # bf16 input gradient
    assert torch.equal(router.local_tokens_per_expert, theirs["counts"])
    ours_seq = router.tracked_losses["seq_load_balancing_loss"]
    assert rel_err(ours_seq, theirs["seq_aux"]) <= TOL, (ours_seq, theirs["seq_aux"])
    # Group-limited: every token's experts lie in at most 2 of the 4 groups of 2.
    assert int(rmap.view(T, 4, 2).any(-1).sum(-1).max()) <= 2

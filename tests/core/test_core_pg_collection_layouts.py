"""Explicit process groups in full: a model built from a ``ProcessGroupCollection`` whose groups are NOT
parallel_state's trains exactly like the whole model, and like the same layout built through parallel_state.

On 4 gloo ranks, two layouts of one tiny MoE GPT (2 layers, 4 experts top-2 with the load-balancing loss, alltoall
dispatcher, RoPE, sequence parallelism, tied embeddings):

* ``tp2-pp2-ep2``: TP 2 x PP 2 (1F1B over 2 micro-batches, the tied embedding all-reduced over ``embd``), EP 2;
* ``tp2-cp2-ep2``: TP 2 x CP 2 (ring attention, each CP rank's rotary angles and tokens), EP 2 (expert DP 2), the
  distributed optimizer (sharded over DP x CP and expert DP).

Each layout runs twice: (a) ``parallel_state.initialize_model_parallel`` with those sizes and no collection anywhere;
(b) parallel_state initialised with every size 1 (four data-parallel replicas of a one-rank model) and the layout's
groups created with ``HyperCommGrid`` (megatron-core's rank order ``tp-cp-ep-dp-pp``) and passed as ``pg_collection``
to GPTModel, DistributedDataParallel, get_megatron_optimizer, the schedule (its P2PCommunicator and
finalize_model_grads) and ``get_batch_on_this_cp_rank``. Two optimizer steps each (Adam, clipping 1.0). The
independent reference is the whole model (every size 1, no collection): (b)'s per-micro-batch losses (the CP ranks'
parts added) and gradient norms equal its own within 2e-5 at both steps (step 2's loss checks step 1's update); and
every rank must see the same losses, gradient norms and parameters in (a) and (b). (b) then saves
``model.sharded_state_dict()`` with ``dist_checkpointing.save`` (replicas and expert shards from the collection's
groups); loaded into the whole model it gives the whole run's trained weights (< 1e-4; the weights are ~0.05).
If any module still reached parallel_state's (size-1) groups, run (b) would train another model: unsplit heads or
vocabulary, no pipeline exchange, no expert all-to-all, no CP ring. Every tensor starts from one global value drawn
from its checkpoint key (``set_global_weights``), so that all layouts start from the same model.
"""
import pytest
import torch

from helpers.dist_harness import run_distributed
from helpers.models_helpers import set_global_weights

SEQ, MICRO_BATCH, MICRO_BATCHES, VOCAB = 16, 2, 2, 64
LAYOUTS = {"tp2-pp2-ep2": dict(tp=2, cp=1, pp=2, ep=2, dist_opt=False),
           "tp2-cp2-ep2": dict(tp=2, cp=2, pp=1, ep=2, dist_opt=True)}
WHOLE = dict(tp=1, cp=1, pp=1, ep=1, dist_opt=False)


def _config(layout):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, padded_vocab_size=VOCAB, max_position_embeddings=SEQ,
        position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False,
        tensor_model_parallel_size=layout["tp"], pipeline_model_parallel_size=layout["pp"],
        context_parallel_size=layout["cp"], expert_model_parallel_size=layout["ep"], expert_tensor_parallel_size=1,
        sequence_parallel=layout["tp"] > 1,
        pipeline_dtype=torch.float32, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.01)


def _collection(layout):
    """The layout's groups from HyperCommGrid, parallel_state's rank order: dense tp-cp-dp-pp, experts
    tp-ep-dp-pp (expert TP 1)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    world = torch.distributed.get_world_size()
    tp, cp, pp, ep = layout["tp"], layout["cp"], layout["pp"], layout["ep"]
    dp = world // (tp * cp * pp)
    dense = HyperCommGrid([tp, cp, dp, pp], ["tp", "cp", "dp", "pp"])
    expert = HyperCommGrid([1, ep, world // (ep * pp), pp], ["tp", "ep", "dp", "pp"])
    pgs = ProcessGroupCollection(
        tp=dense.create_pg("tp"), cp=dense.create_pg("cp"), pp=dense.create_pg("pp"), dp=dense.create_pg("dp"),
        dp_cp=dense.create_pg(["cp", "dp"]), tp_cp=dense.create_pg(["tp", "cp"]), mp=dense.create_pg(["tp", "pp"]),
        tp_dp_cp=dense.create_pg(["tp", "cp", "dp"]), ep=expert.create_pg("ep"), expt_tp=expert.create_pg("tp"),
        tp_ep=expert.create_pg(["tp", "ep"]), expt_dp=expert.create_pg("dp"),
        tp_ep_pp=expert.create_pg(["tp", "ep", "pp"]))
    pgs.embd = pgs.pp  # the first and last stage of each pipeline (PP 2: the whole pipeline group)
    return pgs


def _build(layout, pgs):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import pg_rank, pg_size

    pp_rank, pp_size = pg_rank(pgs, "pp"), pg_size(pgs, "pp")
    return GPTModel(_config(layout), get_gpt_layer_local_spec(num_experts=4), VOCAB, SEQ, pre_process=pp_rank == 0,
                    post_process=pp_rank == pp_size - 1, share_embeddings_and_output_weights=True,
                    pg_collection=pgs)


def _train(layout, pgs, save_dir=None):
    """Two optimizer steps; (per-step reported loss sums and token counts, grad norms, final parameters). With
    ``save_dir``: then ``dist_checkpointing.save(model.sharded_state_dict(), save_dir)``."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core import dist_checkpointing
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.process_groups_config import pg_rank, pg_size
    from megatron.core.utils import get_batch_on_this_cp_rank

    torch.manual_seed(7)
    tensor_parallel.model_parallel_cuda_manual_seed(7, tp_rank=pg_rank(pgs, "tp"), ep_rank=pg_rank(pgs, "ep"),
                                                    etp_rank=pg_rank(pgs, "expt_tp"))
    pp_rank, pp_size = pg_rank(pgs, "pp"), pg_size(pgs, "pp")
    model = _build(layout, pgs)
    config = model.config
    set_global_weights(model)
    dist_opt = layout["dist_opt"]  # sharded over the collection's dp_cp / expt_dp groups
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=dist_opt), model,
                                  pg_collection=pgs)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0,
                                                       use_distributed_optimizer=dist_opt), [ddp],
                                       pg_collection=pgs)
    g = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g) for _ in range(2 * MICRO_BATCHES)]
    cp_group = None if pgs is None else pgs.cp

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                 "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ)}
        batch = get_batch_on_this_cp_rank(batch, cp_group)
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_func(output):
            total = output.float().sum()
            return total, torch.tensor(output.numel()), {"lm loss": total.detach().clone()}

        return losses, loss_func

    schedule = get_forward_backward_func(pp_size=pp_size)
    out = {"losses": [], "grad_norms": [], "optimizer": type(optimizer).__name__}
    for step in range(2):
        optimizer.zero_grad()
        ddp.zero_grad_buffer()
        data = iter(batches[step * MICRO_BATCHES:(step + 1) * MICRO_BATCHES])
        reported = schedule(forward_step_func=forward_step, data_iterator=data, model=ddp,
                            num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                            **({} if pgs is None else {"pg_collection": pgs}))
        out["losses"].append([float(r["lm loss"]) for r in reported])
        _, grad_norm, _ = optimizer.step()
        out["grad_norms"].append(grad_norm)
    out["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    if save_dir is not None:
        dist_checkpointing.save(model.sharded_state_dict(), save_dir)
    # Which part of the whole loss this rank reports: the last stage's, one TP rank of each CP rank's tokens.
    out["reports_part"] = pp_rank == pp_size - 1 and pg_rank(pgs, "tp") == 0
    return out


def body(ckpt_root):
    import os

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    # The independent reference: the whole model (no model parallelism; four identical data-parallel replicas).
    ps.initialize_model_parallel(1, 1)
    whole = _train(WHOLE, None)
    ps.destroy_model_parallel()
    results = {"whole": {"losses": whole["losses"], "grad_norms": whole["grad_norms"]}}
    for name, layout in LAYOUTS.items():
        ps.initialize_model_parallel(layout["tp"], layout["pp"], context_parallel_size=layout["cp"],
                                     expert_model_parallel_size=layout["ep"], expert_tensor_parallel_size=1)
        through_mpu = _train(layout, None)
        ps.destroy_model_parallel()

        ps.initialize_model_parallel(1, 1)
        assert ps.get_data_parallel_world_size() == torch.distributed.get_world_size()
        if torch.distributed.get_rank() == 0:
            os.makedirs(os.path.join(ckpt_root, name))
        torch.distributed.barrier()
        through_collection = _train(layout, _collection(layout), save_dir=os.path.join(ckpt_root, name))
        ps.destroy_model_parallel()

        a, b = through_mpu, through_collection
        results[name] = {
            "losses": (a["losses"], b["losses"]), "grad_norms": (a["grad_norms"], b["grad_norms"]),
            "names": sorted(a["params"]) == sorted(b["params"]),
            "param_diff": max(float((a["params"][k] - b["params"][k]).abs().max()) for k in a["params"]),
            "moved": max(float(v.abs().sum()) for v in a["params"].values()) > 0,
            "reports_part": b["reports_part"], "optimizers": (a["optimizer"], b["optimizer"])}

    # The checkpoints the collection layouts wrote, loaded into the whole model: the whole run's trained weights.
    ps.initialize_model_parallel(1, 1)
    for name in LAYOUTS:
        model = _build(WHOLE, None)
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), os.path.join(ckpt_root, name)))
        loaded = dict(model.named_parameters())
        results[name]["ckpt_vs_whole"] = (sorted(loaded) == sorted(whole["params"]), max(
            float((loaded[k] - whole["params"][k]).abs().max()) for k in whole["params"]))
    ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(body, 4, str(tmp_path_factory.mktemp("pg_layouts")), timeout=240)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_collection_groups_train_like_the_whole_model(results, layout):
    """The layout built from the collection reproduces the whole model: each step's loss (the parts the CP ranks of
    the last stage report add up to it; step 2's loss checks step 1's update) and the gradient norms (every rank)."""
    whole = results[0]["whole"]
    parts = [per_rank[layout]["losses"][1] for per_rank in results if per_rank[layout]["reports_part"]]
    assert parts and all(per_rank["whole"] == whole for per_rank in results)
    for step in range(2):
        summed = [sum(part[step][m] for part in parts) for m in range(MICRO_BATCHES)]
        print(f"{layout} step {step}: micro-batch losses {summed} vs whole model {whole['losses'][step]}")
        assert summed == pytest.approx(whole["losses"][step], rel=2e-5)
    for per_rank in results:
        assert per_rank[layout]["grad_norms"][1] == pytest.approx(whole["grad_norms"], rel=2e-5)
        same_names, diff = per_rank[layout]["ckpt_vs_whole"]
        print(f"{layout}: its torch_dist checkpoint loaded into the whole model vs the whole run's weights: {diff:.1e}")
        # Adam's two steps amplify the fp32 rounding differences of the layouts to ~1e-5; a misplaced shard or
        # replica would be off by the weights' scale (0.05).
        assert same_names and diff < 1e-4


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_collection_groups_train_like_parallel_state(results, layout):
    for rank, per_rank in enumerate(results):
        r = per_rank[layout]
        print(f"{layout} rank {rank}: losses {r['losses'][0]} vs {r['losses'][1]}, grad norms {r['grad_norms'][0]} "
              f"vs {r['grad_norms'][1]}, max parameter difference {r['param_diff']:.1e}")
        (loss_a, loss_b), (norm_a, norm_b) = r["losses"], r["grad_norms"]
        assert r["names"] and len(norm_a) == 2
        expected = "DistributedOptimizer" if LAYOUTS[layout]["dist_opt"] else "FP32Optimizer"
        assert r["optimizers"] == (expected, expected)
        for step in range(2):
            assert loss_a[step] == pytest.approx(loss_b[step], rel=1e-6, abs=1e-6)
        assert norm_a == pytest.approx(norm_b, rel=1e-6)
        assert r["param_diff"] <= 1e-6
    # the last pipeline stage reports the losses; every rank takes part in the gradient norm
    assert any(per_rank[layout]["losses"][0][0] for per_rank in results)
    assert all(n > 0 for per_rank in results for n in per_rank[layout]["grad_norms"][0])

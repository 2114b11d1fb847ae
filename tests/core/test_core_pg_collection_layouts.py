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

In the same launch, BERT (TP 2 x PP 2, tied embedding), T5 (TP 2 x PP 2 split at 1: encoder on stage 0, decoder on
stage 1, word and position embeddings on both), a hybrid Mamba model (TP 2 x PP 2, pattern ``M*``) and a GPT with
multi-latent attention and one multi-token-prediction depth (PP 2 x CP 2: the depth and its copy of the embedding
on the last stage) each run one forward-backward step of
2 micro-batches (schedule, DDP, finalize_model_grads) built (a) with parallel_state's groups of that shape and (b)
with parallel_state at size 1 and the groups passed as ``pg_collection``: every rank's losses and every parameter's
reduced gradient must be equal (<= 1e-6). The hybrid model refuses a collection's CP group of 2 (its Mamba layers
have no context parallelism) in one line.
"""
import pytest
import torch

from helpers.dist_harness import run_distributed
from helpers.models_helpers import set_global_weights, tiny_config

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
    results["models"] = _models_body()
    return results


# ------------------------------------------------------------------------------------- BERT, T5, Mamba, MLA + MTP
# One forward-backward step (2 micro-batches through the schedule, DDP, finalize_model_grads) of each tiny model, built
# (a) with parallel_state's groups of the layout, (b) with parallel_state at every size 1 and the layout's groups passed
# as pg_collection: the reported losses and every gradient must be equal. Each layout splits the model (TP 2 with PP 2
# or CP 2): a module still reaching parallel_state's (size-1) groups would compute another model, or hang.
MODEL_LAYOUTS = {"bert tp2-pp2": dict(tp=2, cp=1, pp=2, ep=1),
                 "t5 tp2-pp2 split 1": dict(tp=2, cp=1, pp=2, ep=1, split=1),
                 "mamba tp2-pp2": dict(tp=2, cp=1, pp=2, ep=1),
                 "mla+mtp pp2-cp2": dict(tp=1, cp=2, pp=2, ep=1)}
MODEL_SEQ, MODEL_DEC_SEQ = 8, 6


def _tokens(seed, shape):
    return torch.randint(1, VOCAB - 4, shape, generator=torch.Generator().manual_seed(seed))


def _bert(layout, pgs, first, last):
    from megatron.core.models.bert import BertModel

    config = tiny_config(tp=layout["tp"], pp=layout["pp"])
    model = BertModel(config, 2, vocab_size=VOCAB, max_sequence_length=16, pre_process=first, post_process=last,
                      share_embeddings_and_output_weights=True, pg_collection=pgs)

    def forward_step(data_iterator, model):
        seed = next(data_iterator)
        ids = _tokens(seed, (MICRO_BATCH, MODEL_SEQ))
        padding = torch.ones(MICRO_BATCH, MODEL_SEQ)
        padding[1, -3:] = 0
        types = (torch.arange(MODEL_SEQ) >= MODEL_SEQ // 2).long().expand(MICRO_BATCH, MODEL_SEQ)
        out = model(ids, padding, tokentype_ids=types, lm_labels=_tokens(seed + 1, (MICRO_BATCH, MODEL_SEQ)))

        def loss_func(output):
            lm, binary = output
            total = (lm.float() * padding).sum() + torch.nn.functional.cross_entropy(
                binary.float(), torch.tensor([0, 1]), reduction="sum")
            return total, torch.tensor(MICRO_BATCH * MODEL_SEQ), {"loss": total.detach().clone()}

        return out, loss_func

    return model, forward_step, {}


def _t5(layout, pgs, first, last):
    from megatron.core.models.T5 import T5Model
    from megatron.core.models.T5.t5_spec import (get_t5_decoder_with_local_block_spec,
                                                 get_t5_encoder_with_local_block_spec)
    from megatron.core.enums import ModelType
    from helpers.t5_helpers import t5_inputs, t5_masks

    config = tiny_config(tp=layout["tp"], pp=layout["pp"])
    # PP 2 split at 1: the encoder on stage 0, the decoder on stage 1, each stage embeds.
    model = T5Model(config, config, get_t5_encoder_with_local_block_spec(2), get_t5_decoder_with_local_block_spec(2),
                    vocab_size=VOCAB, max_sequence_length=16, share_embeddings_and_output_weights=True,
                    add_encoder=first, add_decoder=last, pg_collection=pgs)
    model.model_type = ModelType.encoder_and_decoder

    def forward_step(data_iterator, model):
        enc, dec, labels, loss_mask = t5_inputs(batch=MICRO_BATCH, se=MODEL_SEQ, sd=MODEL_DEC_SEQ,
                                                vocab=VOCAB - 4, seed=next(data_iterator))
        out = model(enc, dec, *[m.unsqueeze(1) for m in t5_masks(enc, dec)], lm_labels=labels)

        def loss_func(output):
            total = (output.float() * loss_mask).sum()
            return total, loss_mask.sum().to(torch.int), {"loss": total.detach().clone()}

        return out, loss_func

    return model, forward_step, {"decoder_seq_length": MODEL_DEC_SEQ}


def _gpt_step(pgs):
    from megatron.core.utils import get_batch_on_this_cp_rank

    def forward_step(data_iterator, model):
        seed = next(data_iterator)
        loss_mask = torch.ones(MICRO_BATCH, MODEL_SEQ)
        loss_mask[0, 2] = 0
        batch = get_batch_on_this_cp_rank(
            {"tokens": _tokens(seed, (MICRO_BATCH, MODEL_SEQ)), "labels": _tokens(seed + 1, (MICRO_BATCH, MODEL_SEQ)),
             "position_ids": torch.arange(MODEL_SEQ).expand(MICRO_BATCH, MODEL_SEQ), "loss_mask": loss_mask},
            None if pgs is None else pgs.cp)
        out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=batch["loss_mask"])

        def loss_func(output):
            total = (output.float() * batch["loss_mask"]).sum()
            return total, batch["loss_mask"].sum().to(torch.int), {"loss": total.detach().clone()}

        return out, loss_func

    return forward_step


def _mamba(layout, pgs, first, last):
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba.mamba_layer_specs import get_mamba_stack_spec

    config = tiny_config(tp=layout["tp"], pp=layout["pp"], style="llama", mamba_head_dim=8, mamba_num_groups=2,
                         mamba_state_dim=8)
    model = MambaModel(config, get_mamba_stack_spec(), VOCAB, 16, pre_process=first, post_process=last,
                       hybrid_layer_pattern="M*", share_embeddings_and_output_weights=True, pg_collection=pgs)
    return model, _gpt_step(pgs), {}


def _mla_mtp(layout, pgs, first, last):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
        qk_pos_emb_head_dim=4, v_head_dim=6, rotary_scaling_factor=4.0, original_max_position_embeddings=8,
        qk_layernorm=True, normalization="RMSNorm", add_bias_linear=False, ffn_hidden_size=48, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, tensor_model_parallel_size=layout["tp"],
        context_parallel_size=layout["cp"], pipeline_model_parallel_size=layout["pp"],
        pipeline_dtype=torch.float32, sequence_parallel=layout["tp"] > 1, position_embedding_type="rope",
        mtp_num_layers=1, padded_vocab_size=VOCAB, max_position_embeddings=16)
    spec = get_gpt_layer_local_spec(qk_layernorm=True, multi_latent_attention=True)
    model = GPTModel(config, spec, VOCAB, 16, position_embedding_type="rope", pre_process=first, post_process=last,
                     share_embeddings_and_output_weights=True, pg_collection=pgs)
    return model, _gpt_step(pgs), {}


MODEL_BUILDERS = {"bert": _bert, "t5": _t5, "mamba": _mamba, "mla+mtp": _mla_mtp}


def _model_step(name, layout, pgs):
    """One forward-backward step of ``name`` on ``layout`` (groups: ``pgs``, else parallel_state's): the losses this
    rank reports and every parameter's reduced gradient."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.process_groups_config import pg_rank, pg_size

    torch.manual_seed(5)
    tensor_parallel.model_parallel_cuda_manual_seed(5, tp_rank=pg_rank(pgs, "tp"))
    pp_rank, pp_size = pg_rank(pgs, "pp"), pg_size(pgs, "pp")
    model, forward_step, extra = MODEL_BUILDERS[name.split()[0]](layout, pgs, pp_rank == 0, pp_rank == pp_size - 1)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model, pg_collection=pgs)
    model.config.finalize_model_grads_func = finalize_model_grads
    reported = get_forward_backward_func(pp_size=pp_size)(
        forward_step_func=forward_step, data_iterator=iter([101, 202]), model=[ddp], num_microbatches=2,
        seq_length=MODEL_SEQ, micro_batch_size=MICRO_BATCH, **extra, **({} if pgs is None else {"pg_collection": pgs}))
    return {"losses": [float(r["loss"]) for r in reported],
            "grads": {k: p.main_grad.detach().clone() for k, p in model.named_parameters()}}


def _models_body():
    from megatron.core import parallel_state as ps

    out = {}
    for name, layout in MODEL_LAYOUTS.items():
        ps.initialize_model_parallel(layout["tp"], layout["pp"], context_parallel_size=layout["cp"],
                                     pipeline_model_parallel_split_rank=layout.get("split"))
        a = _model_step(name, layout, None)
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(1, 1)
        # The encoder-decoder split is a stage number (parallel_state's), applied to the collection's pipeline.
        ps.set_pipeline_model_parallel_split_rank(layout.get("split"))
        pgs = _collection(layout)
        pgs.pos_embd = pgs.embd  # PP 2 split at 1: the position embedding lives on both stages
        b = _model_step(name, layout, pgs)
        ps.destroy_model_parallel()
        out[name] = {"losses": (a["losses"], b["losses"]), "names": sorted(a["grads"]) == sorted(b["grads"]),
                     "grad_diff": max(float((a["grads"][k] - b["grads"][k]).abs().max()) for k in a["grads"]),
                     "grad_max": max(float(g.abs().max()) for g in a["grads"].values())}
    # The hybrid model's Mamba layers have no context parallelism: a collection's CP group of 2 is refused in one line.
    ps.initialize_model_parallel(1, 1)
    try:
        _mamba(dict(tp=1, pp=1), _collection(dict(tp=1, cp=2, pp=1, ep=1)), True, True)
        out["mamba cp2"] = "built"
    except NotImplementedError as e:
        out["mamba cp2"] = str(e)
    ps.destroy_model_parallel()
    return out


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


@pytest.mark.parametrize("name", sorted(MODEL_LAYOUTS))
def test_models_train_with_the_collection_groups_like_parallel_state(results, name):
    """BERT (tied embedding over the collection's embd group), T5 (the encoder-decoder pipeline split over the
    collection's pp group, its position embedding over pos_embd), Mamba (the hybrid stack's stages) and a GPT with
    multi-latent attention and multi-token prediction (the CP ring, rotary slice and MTP token roll over the
    collection's cp group, the MTP embedding copy over its embd group): the same losses and gradients as with parallel_state's groups of the same shape."""
    for rank, per_rank in enumerate(results):
        r = per_rank["models"][name]
        (loss_a, loss_b) = r["losses"]
        print(f"{name} rank {rank}: losses {loss_a} vs {loss_b}, max gradient difference {r['grad_diff']:.1e} "
              f"(gradients up to {r['grad_max']:.1e})")
        assert r["names"] and len(loss_a) == len(loss_b)
        assert loss_a == pytest.approx(loss_b, rel=1e-6, abs=1e-6)
        assert r["grad_max"] > 0 and r["grad_diff"] <= 1e-6
    assert any(per_rank["models"][name]["losses"][0] for per_rank in results)


def test_hybrid_model_refuses_context_parallelism(results):
    for per_rank in results:
        assert per_rank["models"]["mamba cp2"] == (
            "MambaModel with a context-parallel group of 2 ranks: context parallelism of the Mamba layers is not "
            "implemented in this library; use context parallel size 1")

"""Explicit process groups (megatron-core's ``ProcessGroupCollection``) and constructors that refuse keywords they do
not know.

On 2 gloo ranks parallel_state is set up with TP=1 (the two ranks are data-parallel replicas), and a GPTModel is built
with a ``pg_collection`` whose ``tp`` group holds both ranks: the model must follow the collection, not
parallel_state — its weights are TP=2 shards and its logits, loss and input-embedding gradients equal those of the
same model built whole (TP=1) in each process. DistributedDataParallel reduces over the collection's ``dp_cp``."""
import pytest
import torch

from helpers.dist_harness import run_distributed
from helpers.models_helpers import gpt_inputs, set_global_weights, single_rank, tiny_config  # noqa: F401


def _gpt(config, pg_collection=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(config, get_gpt_layer_local_spec(), 64, 16, pg_collection=pg_collection,
                    position_embedding_type="rope")


def _mla_gpt(tp, pg_collection):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
        qk_pos_emb_head_dim=4, v_head_dim=6, qk_layernorm=True, normalization="RMSNorm", add_bias_linear=False,
        ffn_hidden_size=48, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, position_embedding_type="rope", mtp_num_layers=1, padded_vocab_size=64,
        max_position_embeddings=16)
    spec = get_gpt_layer_local_spec(qk_layernorm=True, multi_latent_attention=True)
    return GPTModel(config, spec, 64, 16, position_embedding_type="rope", pg_collection=pg_collection)


def body():
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    rank = torch.distributed.get_rank()
    ps.initialize_model_parallel(1, 1)
    tp_group = torch.distributed.new_group([0, 1])
    own = [torch.distributed.new_group([r]) for r in (0, 1)][rank]
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    mpu_tp = pgs.tp
    pgs.tp, pgs.dp, pgs.dp_cp = tp_group, own, own

    torch.manual_seed(5)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    sharded = _gpt(tiny_config(tp=2, style="gpt2"), pgs)  # (a gated fc1 initialises differently at each TP)
    torch.manual_seed(5)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    whole = _gpt(tiny_config(tp=1, style="gpt2"))

    ids, pos, mask, labels = gpt_inputs(vocab=64, seq=16)
    out = {"mpu_tp_size": torch.distributed.get_world_size(mpu_tp),
           "qkv_rows": (sharded.decoder.layers[0].self_attention.linear_qkv.weight.shape[0],
                        whole.decoder.layers[0].self_attention.linear_qkv.weight.shape[0]),
           "vocab_rows": (sharded.embedding.word_embeddings.weight.shape[0],
                          whole.embedding.word_embeddings.weight.shape[0])}
    logits_sharded = sharded(ids, pos, mask)  # [b, s, V/2]
    logits_whole = whole(ids, pos, mask)
    out["logits_err"] = float((logits_sharded - logits_whole.chunk(2, dim=-1)[rank]).abs().max())
    loss_sharded = sharded(ids, pos, mask, labels=labels).mean()
    loss_whole = whole(ids, pos, mask, labels=labels).mean()
    out["loss"] = (float(loss_sharded), float(loss_whole))
    loss_sharded.backward()
    loss_whole.backward()
    grad_sharded = sharded.embedding.word_embeddings.weight.grad
    grad_whole = whole.embedding.word_embeddings.weight.grad.chunk(2)[rank]
    out["grad_err"] = float((grad_sharded - grad_whole).abs().max())

    # The hybrid model (Mamba-2 mixer + attention) follows the collection's TP group too: heads, groups and channels.
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba.mamba_layer_specs import get_mamba_stack_spec

    mamba = dict(style="llama", mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=8)
    hybrid = {}
    for tp, groups in ((2, pgs), (1, None)):
        torch.manual_seed(5)
        tensor_parallel.model_parallel_cuda_manual_seed(5)
        hybrid[tp] = MambaModel(tiny_config(tp=tp, **mamba), get_mamba_stack_spec(), 64, 16,
                                hybrid_layer_pattern="M*", pg_collection=groups)
    out["mamba_heads"] = (hybrid[2].decoder.layers[0].mixer.heads, hybrid[1].decoder.layers[0].mixer.heads)
    out["mamba_logits_err"] = float((hybrid[2](ids, pos, None) - hybrid[1](ids, pos, None).chunk(2, dim=-1)[rank])
                                    .abs().max())
    losses = [hybrid[tp](ids, pos, None, labels=labels).mean() for tp in (2, 1)]
    out["mamba_loss"] = tuple(float(x) for x in losses)
    for x in losses:
        x.backward()
    out["mamba_grad_err"] = float((hybrid[2].embedding.word_embeddings.weight.grad
                                   - hybrid[1].embedding.word_embeddings.weight.grad.chunk(2)[rank]).abs().max())

    # Multi-latent attention with a multi-token-prediction depth, the same: equal weights from their checkpoint keys.
    mla = {}
    for tp, groups in ((2, pgs), (1, None)):
        mla[tp] = _mla_gpt(tp, groups)
        set_global_weights(mla[tp])
    out["mla_logits_err"] = float((mla[2](ids, pos, None) - mla[1](ids, pos, None).chunk(2, dim=-1)[rank])
                                  .abs().max())
    losses = [mla[tp](ids, pos, None, labels=labels).mean() for tp in (2, 1)]
    out["mla_loss"] = tuple(float(x) for x in losses)
    out["mtp_loss"] = tuple(float(mla[tp].mtp.tracked_losses[0]) for tp in (2, 1))
    for x in losses:
        x.backward()
    out["mla_grad_err"] = float((mla[2].embedding.word_embeddings.weight.grad
                                 - mla[1].embedding.word_embeddings.weight.grad.chunk(2)[rank]).abs().max())

    ddp = DistributedDataParallel(sharded.config, DistributedDataParallelConfig(), sharded, pg_collection=pgs)
    out["ddp_group"] = (ddp.data_parallel_group is own,
                        all(b.data_parallel_group is own for b in ddp.param_and_grad_buffers))

    from megatron.core.hyper_comm_grid import HyperCommGrid

    grid = HyperCommGrid([2, 1], ["tp", "dp"])
    group = grid.create_pg("tp")
    out["grid_tp"] = (torch.distributed.get_process_group_ranks(group), grid.get_pg("tp") is group)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(body, 2, timeout=120)


def test_model_follows_the_collections_tp_group_not_parallel_state(results):
    for rank, r in enumerate(results):
        assert r["mpu_tp_size"] == 1, "parallel_state must have TP=1 for this test to mean something"
        assert r["qkv_rows"][0] * 2 == r["qkv_rows"][1] and r["vocab_rows"][0] * 2 == r["vocab_rows"][1], r
        assert r["logits_err"] < 1e-5, r
        assert abs(r["loss"][0] - r["loss"][1]) < 1e-5, r
        assert r["grad_err"] < 1e-6, r


def test_hybrid_model_follows_the_collections_tp_group(results):
    for r in results:
        print(f"MambaModel TP=2 by collection vs whole: logits {r['mamba_logits_err']:.1e}, loss {r['mamba_loss']}, "
              f"embedding grad {r['mamba_grad_err']:.1e}")
        assert r["mamba_heads"] == (4, 8), r
        assert r["mamba_logits_err"] < 1e-5 and abs(r["mamba_loss"][0] - r["mamba_loss"][1]) < 1e-5, r
        assert r["mamba_grad_err"] < 1e-6, r


def test_mla_and_mtp_follow_the_collections_tp_group(results):
    for r in results:
        print(f"MLA + MTP GPT, TP=2 by collection vs whole: logits {r['mla_logits_err']:.1e}, loss {r['mla_loss']}, "
              f"MTP depth-1 loss {r['mtp_loss']}, embedding grad {r['mla_grad_err']:.1e}")
        assert r["mla_logits_err"] < 1e-5 and abs(r["mla_loss"][0] - r["mla_loss"][1]) < 1e-5, r
        assert abs(r["mtp_loss"][0] - r["mtp_loss"][1]) < 1e-5 and r["mla_grad_err"] < 1e-6, r


def test_ddp_reduces_over_the_collections_dp_cp(results):
    assert all(r["ddp_group"] == (True, True) for r in results)


def test_hyper_comm_grid_groups_are_parallel_states(results, monkeypatch):
    """HyperCommGrid's groups are the ones parallel_state's rank layout builds (tp-cp-pp-dp, 120 ranks), and
    create_pg makes real groups (the 2-rank launch)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.rank_grid import RankGenerator

    assert all(r["grid_tp"] == ([0, 1], True) for r in results)
    monkeypatch.setenv("WORLD_SIZE", "120")
    grid = HyperCommGrid([2, 3, 4, 5], ["tp", "cp", "pp", "dp"])
    layout = RankGenerator(tp=2, ep=1, dp=5, pp=4, cp=3, order="tp-cp-pp-dp")
    for dims in ("tp", "dp", "pp", ["cp", "dp"], ["tp", "pp"], ["tp", "cp", "pp", "dp"]):
        token = dims if isinstance(dims, str) else "-".join(dims)
        assert sorted(map(sorted, grid.get_rank_enum(dims))) == sorted(map(sorted, layout.get_ranks(token))), dims
    with pytest.raises(KeyError, match="has not been created"):
        grid.get_pg("dp")


def test_use_mpu_process_groups_and_unknown_names(single_rank):
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection.use_mpu_process_groups()
    assert pgs.tp is ps.get_tensor_model_parallel_group() and pgs.pp is ps.get_pipeline_model_parallel_group()
    assert pgs.dp_cp is ps.get_data_parallel_group(with_context_parallel=True)
    some = ProcessGroupCollection.use_mpu_process_groups(["tp", "dp"])
    assert some.tp is pgs.tp and some.pp is None  # unset fields read as None
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    moe = get_default_pg_collection()
    assert moe.ep is ps.get_expert_model_parallel_group() and moe.tp_dp_cp is pgs.tp_dp_cp and moe.pp is None
    with pytest.raises(ValueError, match="invalid process groups requested: \\['bogus'\\]"):
        ProcessGroupCollection.use_mpu_process_groups(["tp", "bogus"])
    with pytest.raises(ValueError, match="no field bogus"):
        ProcessGroupCollection(bogus=pgs.tp)


def test_constructors_refuse_unknown_keywords(single_rank):
    """The constructors that used to swallow ``**unused`` name the keyword they do not know."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.models.bert.bert_model import BertLMHead
    from megatron.core.models.common.embedding import LanguageModelEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.T5.t5_model import T5Model
    from megatron.core.models.T5.t5_spec import get_t5_decoder_with_local_block_spec, get_t5_encoder_with_local_block_spec
    from megatron.core.transformer.attention import CrossAttention, SelfAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.rotary import RotaryEmbedding
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import TransformerLayer

    config = tiny_config()
    spec = get_gpt_layer_local_spec()
    builders = {
        "GPTModel": lambda **kw: _gpt(config, **kw) if not kw else _gpt_with(config, **kw),
        "TransformerBlock": lambda **kw: TransformerBlock(config, spec, **kw),
        "TransformerLayer": lambda **kw: TransformerLayer(config, spec.submodules, **kw),
        "SelfAttention": lambda **kw: SelfAttention(config, spec.submodules.self_attention.submodules, **kw),
        "CrossAttention": lambda **kw: CrossAttention(config, None, **kw),
        "MLP": lambda **kw: MLP(config, spec.submodules.mlp.submodules, **kw),
        "MoELayer": lambda **kw: MoELayer(tiny_config(num_moe_experts=2, moe_router_topk=2), **kw),
        "SharedExpertMLP": lambda **kw: SharedExpertMLP(tiny_config(moe_shared_expert_intermediate_size=32), **kw),
        "LanguageModelEmbedding": lambda **kw: LanguageModelEmbedding(config, 64, 16, **kw),
        "RotaryEmbedding": lambda **kw: RotaryEmbedding(8, **kw),
        "FusedLayerNorm": lambda **kw: FusedLayerNorm(config, 32, **kw),
        "BertLMHead": lambda **kw: BertLMHead(32, config, **kw),
        "T5Model": lambda **kw: T5Model(config, config, get_t5_encoder_with_local_block_spec(1),
                                        get_t5_decoder_with_local_block_spec(1), 64, 16, **kw),
    }
    for name, build in builders.items():
        with pytest.raises(TypeError, match="unexpected keyword argument 'not_a_megatron_option'"):
            build(not_a_megatron_option=1)
        build()  # and builds without it (the same call is not broken otherwise)


def _gpt_with(config, **kw):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(config, get_gpt_layer_local_spec(), 64, 16, **kw)


def test_models_take_the_collections_pipeline_and_cp_groups(single_rank):
    """BERT, T5, the hybrid model, multi-latent attention and multi-token prediction take a collection whose
    pipeline / context-parallel groups are not parallel_state's (no refusal) and hold those groups; their training
    with such groups is compared with parallel_state's in tests/core/test_core_pg_collection_layouts.py."""
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba.mamba_layer_specs import get_mamba_stack_spec
    from megatron.core.models.T5.t5_model import T5Model
    from megatron.core.models.T5.t5_spec import (get_t5_decoder_with_local_block_spec,
                                                  get_t5_encoder_with_local_block_spec)
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = tiny_config()
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.pp = pgs.cp = torch.distributed.new_group([0])
    models = {
        "BertModel": BertModel(config, 0, vocab_size=64, max_sequence_length=16, pg_collection=pgs),
        "MambaModel": MambaModel(tiny_config(style="llama", mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=8),
                                 get_mamba_stack_spec(), 64, 16, hybrid_layer_pattern="M*", pg_collection=pgs),
        "MLA GPTModel": _mla_gpt(1, pgs),
        "MTP GPTModel": _gpt_with(tiny_config(style="llama", mtp_num_layers=1), pg_collection=pgs,
                                  position_embedding_type="rope"),
    }
    models["T5Model"] = T5Model(config, config, get_t5_encoder_with_local_block_spec(1),
                                get_t5_decoder_with_local_block_spec(1), 64, 16, pg_collection=pgs)
    for name, model in models.items():
        assert (model.pp_group, model.cp_group) == (pgs.pp, pgs.cp), name


def test_schedule_hands_its_groups_to_finalize_and_refuses_shape_hooks(single_rank):
    """The schedule passes its ``pg_collection`` and ``force_all_reduce`` on to ``finalize_model_grads_func`` and
    refuses megatron-core's ``adjust_tensor_shapes_fn`` (one line naming it)."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.process_groups_config import ProcessGroupCollection

    model = torch.nn.Linear(4, 1)
    model.config = tiny_config()
    model.set_input_tensor = lambda tensor: None
    calls = []
    model.config.finalize_model_grads_func = lambda models, **kw: calls.append((models, kw))
    x = torch.ones(2, 4)

    def forward_step(data_iterator, model):
        out = model(x).sum()
        return out, lambda output: (output, torch.tensor(1), {"loss": output.detach()})

    pgs = ProcessGroupCollection.use_mpu_process_groups()
    common = dict(forward_step_func=forward_step, data_iterator=iter([None]), model=model, num_microbatches=1,
                  seq_length=1, micro_batch_size=2)
    forward_backward_no_pipelining(**common, pg_collection=pgs, force_all_reduce=True)
    assert calls == [([model], {"pg_collection": pgs, "force_all_reduce": True})]
    assert float(model.bias.grad) == pytest.approx(2.0)
    with pytest.raises(NotImplementedError, match=r"forward_backward_no_pipelining\(adjust_tensor_shapes_fn=\.\.\.\)"):
        forward_backward_no_pipelining(**common, adjust_tensor_shapes_fn=lambda r, s: (r, s))

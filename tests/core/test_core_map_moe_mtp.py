"""megatron-core 0.16.1 names of the MoE / MTP / rotary area, against independent references.

* moe_utils' layer-wise aux-loss tracker (save / clear / reduce / track_moe_metrics) against the contract computed
  by hand, and ``reduce_moe_losses`` (the training loop's MoE logging) going through it;
* router replay (record, replay in the forward and, first-in first-out, in the backward) against ``torch.topk``
  and gathered scores; ``--moe-enable-routing-replay`` reaching the config;
* ``MoESubmodules.router`` (a ``RouterBuilder``) building the layer's router with keywords;
* ``set_tensor_grad_fn_sequence_sr``: the order in which autograd runs two ready nodes;
* ``MultimodalRotaryEmbedding`` against Hugging Face's Qwen2-VL M-RoPE; ``apply_rotary_pos_emb_with_cos_sin``
  against Hugging Face's Llama rotation and a complex-number rotation;
* ``VocabParallelCrossEntropy``'s steps on two vocabulary shards against ``torch.nn.functional.cross_entropy``;
* the MTP loss log (``MTPLossLoggingHelper``, ``reduce_mtp_losses``) and the tied MTP state-dict entries;
* upcycling: a granularity-1 upcycled MoE GPT gives the dense GPT's logits; granularity 2 splits and scales the
  dense weights as stated.
"""
import pytest
import torch

from helpers.args_test_helpers import clean_env, validated  # noqa: F401  (fixture)
from helpers.models_helpers import single_rank, tiny_config  # noqa: F401  (fixture)


# ------------------------------------------------------------------------------------------ aux-loss tracker
class _Writer:
    def __init__(self):
        self.scalars, self.logs = [], []

    def add_scalar(self, key, value, iteration):
        self.scalars.append((key, float(value), iteration))

    def log(self, values, iteration):
        self.logs.append(({k: float(v) for k, v in values.items()}, iteration))


def test_aux_losses_tracker_contract(single_rank):
    from megatron.core.transformer.moe import moe_utils as mu

    tracker = mu.get_moe_layer_wise_logging_tracker()
    assert tracker is mu.get_moe_layer_wise_logging_tracker()
    tracker.clear()
    world = torch.distributed.group.WORLD
    mu.save_to_aux_losses_tracker("lb", torch.tensor(1.5), 1, 4, reduce_group=world, reduce_group_has_dp=True)
    mu.save_to_aux_losses_tracker("lb", torch.tensor(0.5), 1, 4, reduce_group=world, reduce_group_has_dp=True)
    mu.save_to_aux_losses_tracker("lb", torch.tensor(2.0), 3, 4, reduce_group=world, reduce_group_has_dp=True)
    mu.save_to_aux_losses_tracker("z", torch.tensor(4.0, requires_grad=True), 2, 4)
    mu.save_to_aux_losses_tracker("z", torch.tensor(9.0), None, 4)  # no layer number: not saved
    assert tracker["lb"]["values"].tolist() == [2.0, 0.0, 2.0, 0.0]
    assert tracker["lb"]["reduce_group"] is world and tracker["lb"]["reduce_group_has_dp"]
    assert tracker["z"]["values"].tolist() == [0.0, 4.0, 0.0, 0.0] and not tracker["z"]["values"].requires_grad
    writer, wandb, totals = _Writer(), _Writer(), {"lb": torch.tensor(1.0)}
    # MoE layers: every 2nd of 4 (layers 0 and 2) + 1 MTP layer = 3.
    mu.track_moe_metrics(0.5, 7, writer=writer, wandb_writer=wandb, total_loss_dict=totals, per_layer_logging=True,
                         num_layers=4, moe_layer_freq=2, mtp_num_layers=1)
    assert float(totals["lb"]) == pytest.approx(1.0 + 0.5 * 4.0 / 3) and float(totals["z"]) == pytest.approx(2.0 / 3)
    assert ("lb", pytest.approx(2.0 / 3), 7) in writer.scalars and ("moe/lb_layer_2", 1.0, 7) in writer.scalars
    assert ("moe/z_layer_1", 2.0, 7) in writer.scalars and len(writer.scalars) == 2 * (1 + 4)
    assert wandb.logs[0] == ({"lb": pytest.approx(2.0 / 3)}, 7) and wandb.logs[1][0]["moe/lb_layer_0"] == 1.0
    assert all(float(e["values"].abs().sum()) == 0 for e in tracker.values())  # zeroed after logging
    # A list frequency counts its ones; force_initialize creates the names this rank never saved.
    totals = {}
    mu.track_moe_metrics(1.0, 8, total_loss_dict=totals, force_initialize=True, track_names=["lb", "z", "new"],
                         num_layers=4, moe_layer_freq=[1, 0, 1, 1])
    assert tracker["new"]["values"].tolist() == [0.0] * 4 and set(totals) == {"lb", "z", "new"}
    mu.save_to_aux_losses_tracker("z", torch.tensor(3.0), 4, 4)
    mu.clear_aux_losses_tracker()
    assert tracker["z"]["values"].tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="moe_layer_freq"):
        mu.track_moe_metrics(1.0, 0, num_layers=4, moe_layer_freq="x")
    tracker.clear()


def _moe_config(**overrides):
    kw = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
              moe_ffn_hidden_size=16, add_bias_linear=False)
    kw.update(overrides)
    return tiny_config(**kw)


def test_reduce_moe_losses_goes_through_the_tracker(single_rank):
    from megatron.core.transformer.moe import moe_utils as mu
    from megatron.core.transformer.moe.moe_layer import reduce_moe_losses
    from megatron.core.transformer.moe.router import TopKRouter

    mu.get_moe_layer_wise_logging_tracker().clear()
    config = _moe_config()
    torch.manual_seed(0)
    routers = torch.nn.ModuleList([TopKRouter(config, layer_number=n) for n in (1, 2)]).train()
    expected = {}
    for _ in range(2):  # two micro-batches
        for r in routers:
            r(torch.randn(6, 2, config.hidden_size))
    for r in routers:
        for name, value in r.tracked_losses.items():
            expected.setdefault(name, []).append(float(value))
    # An entry left by an earlier parallel_state initialisation (a restart in the same process) holds dead groups.
    mu.get_moe_layer_wise_logging_tracker()["z_loss"] = {"values": torch.zeros(2), "reduce_group": "dead group",
                                                         "avg_group": "dead group", "reduce_group_has_dp": True}
    out = reduce_moe_losses(routers, num_microbatches=2, num_moe_layers=2, per_layer_logging=True)
    for name, per_layer in expected.items():  # one rank: sum over layers / micro-batches / MoE layers
        assert out[name] == pytest.approx(sum(per_layer) / 2 / 2, rel=1e-6), (name, out)
        for layer, value in enumerate(per_layer):
            assert out[f"moe/{name}_layer_{layer}"] == pytest.approx(value / 2, rel=1e-6)
    assert set(expected) == {"load_balancing_loss", "z_loss"}
    assert all(not r.tracked_losses for r in routers)
    assert reduce_moe_losses(routers, 2, 2) == {}  # nothing tracked since
    mu.get_moe_layer_wise_logging_tracker().clear()


# ------------------------------------------------------------------------------------------ router replay
def test_router_replay_records_and_replays(single_rank):
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    RouterReplay.clear_global_router_replay_instances()
    config = _moe_config(moe_enable_routing_replay=True, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
    torch.manual_seed(1)
    routers = [TopKRouter(config, layer_number=n).eval() for n in (1, 2)]
    assert RouterReplay.global_router_replay_instances == [r.router_replay for r in routers]
    x = torch.randn(5, 2, config.hidden_size)
    logits = [torch.nn.functional.linear(x, r.weight).view(-1, 4) for r in routers]

    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    for r in routers:
        r(x)
    recorded = RouterReplay.get_recorded_data()
    for rec, lg in zip(recorded, logits):
        assert torch.equal(rec, lg.topk(2, dim=1).indices)

    # Replay other experts: the map follows them, the weights are the softmax of the logits gathered there.
    target = [torch.stack([torch.randperm(4)[:2] for _ in range(10)]) for _ in routers]
    RouterReplay.set_replay_data(target)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    for r, tgt, lg in zip(routers, target, logits):
        probs, rmap = r(x)
        ref_map = torch.zeros(10, 4, dtype=torch.bool).scatter(1, tgt, True)
        ref_probs = torch.zeros(10, 4).scatter(1, tgt, torch.softmax(lg.gather(1, tgt), dim=-1))
        assert torch.equal(rmap, ref_map) and torch.allclose(probs, ref_probs, atol=1e-6)
    # Backward replay takes the queued indices first-in first-out.
    second = [t.flip(1) for t in target]
    RouterReplay.set_replay_data(second)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    for round_targets in (target, second):
        for r, tgt in zip(routers, round_targets):
            _, rmap = r(x)
            assert torch.equal(rmap, torch.zeros(10, 4, dtype=torch.bool).scatter(1, tgt, True))
    with pytest.raises(ValueError, match="does not match"):
        RouterReplay.set_replay_data(target[:1])
    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_indices()
    assert all(r.router_replay.router_replay_action is None and r.router_replay.replay_backward_list == []
               for r in routers)
    _, rmap = routers[0](x)  # no action: the normal top-k
    assert torch.equal(rmap, torch.zeros(10, 4, dtype=torch.bool).scatter(1, logits[0].topk(2, dim=1).indices, True))
    RouterReplay.clear_global_router_replay_instances()
    assert RouterReplay.global_router_replay_instances == []


def test_moe_enable_routing_replay_flag_reaches_the_config(clean_env):
    from megatron.training.arguments import core_transformer_config_from_args

    for extra, expected in (("", False), (" --moe-enable-routing-replay", True)):
        args = validated("--num-experts 4 --moe-router-topk 2" + extra)
        assert args.moe_enable_routing_replay is expected
        assert core_transformer_config_from_args(args).moe_enable_routing_replay is expected


def test_moe_layer_builds_its_router_with_a_router_builder(single_rank):
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules, RouterInterface
    from megatron.core.transformer.moe.router import TopKRouter

    calls = []

    def builder(*, config, pg_collection):
        calls.append((config, pg_collection))
        return TopKRouter(config=config, pg_collection=pg_collection)

    config = _moe_config()
    layer = MoELayer(config, MoESubmodules(router=builder), layer_number=3)
    assert calls == [(config, None)] and isinstance(layer.router, TopKRouter)
    assert layer.router.layer_number == 3
    assert all(callable(getattr(layer.router, m)) for m in ('forward', 'set_layer_number'))  # RouterInterface
    assert RouterInterface.__annotations__ is not None
    layer.set_layer_number(5)
    assert layer.layer_number == 5 and layer.router.layer_number == 5
    assert MoESubmodules().router is TopKRouter


# ------------------------------------------------------------------------------------------ autograd order
def test_set_tensor_grad_fn_sequence_sr_orders_backward():
    from megatron.core.transformer.moe.shared_experts import set_tensor_grad_fn_sequence_sr

    def order(first_high):
        x = torch.ones(3, requires_grad=True)
        a, b = x * 2, x * 3
        ran = []
        a.grad_fn.register_prehook(lambda g: ran.append("a"))
        b.grad_fn.register_prehook(lambda g: ran.append("b"))
        set_tensor_grad_fn_sequence_sr(a if first_high else b, 10 ** 6)
        (a.sum() + b.sum()).backward()
        return ran

    assert order(True) == ["a", "b"] and order(False) == ["b", "a"]
    set_tensor_grad_fn_sequence_sr(None, 1)
    set_tensor_grad_fn_sequence_sr(torch.ones(2, requires_grad=True), 1)  # a leaf: nothing to set


# ------------------------------------------------------------------------------------------ rotary
def test_multimodal_rotary_embedding_matches_hf_qwen2_vl():
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    section = [2, 3, 3]  # sums to head_dim / 2 = 8
    hf_config = Qwen2VLTextConfig(hidden_size=64, num_attention_heads=4, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": section})
    hf = Qwen2VLRotaryEmbedding(hf_config)
    g = torch.Generator().manual_seed(0)
    position_ids = torch.randint(0, 50, (3, 2, 7), generator=g)
    hf_cos, hf_sin = hf(torch.zeros(1), position_ids)  # [b, s, d]
    ours = MultimodalRotaryEmbedding(kv_channels=16, rotary_percent=1.0)
    emb = ours(position_ids, section)
    assert emb.shape == (7, 2, 1, 16)
    assert torch.allclose(emb.cos()[:, :, 0].transpose(0, 1), hf_cos, atol=1e-6)
    assert torch.allclose(emb.sin()[:, :, 0].transpose(0, 1), hf_sin, atol=1e-6)
    # Interpolated positions are the positions divided by the factor.
    scaled = MultimodalRotaryEmbedding(16, 1.0, seq_len_interpolation_factor=2.0)(position_ids * 2, section)
    assert torch.allclose(scaled, emb, atol=1e-5)
    # Interleaved layout: each angle twice, in the same order.
    inter = MultimodalRotaryEmbedding(16, 1.0, rotary_interleaved=True)(position_ids, section)
    assert torch.equal(inter[..., 0::2], emb[..., :8]) and torch.equal(inter[..., 1::2], emb[..., :8])
    with pytest.raises(ValueError, match="mrope_section"):
        ours(position_ids, [2, 2, 2])


def _complex_rotation(t, cos, sin, interleaved):
    """The rotation as a product of complex numbers: pair (a, b) -> (a + ib) * (cos + i sin)."""
    half = cos.shape[-1]
    x = t[..., :2 * half].double()
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    z = torch.complex(a, b) * torch.complex(cos.double(), sin.double())[:, None, None, :]
    out = torch.stack((z.real, z.imag), dim=-1).flatten(-2) if interleaved else torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((out, t[..., 2 * half:].double()), dim=-1)


def test_apply_rotary_pos_emb_with_cos_sin():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply

    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb_with_cos_sin

    g = torch.Generator().manual_seed(3)
    s, b, h, d, r = 6, 2, 3, 16, 12  # 12 of 16 channels rotated
    t = torch.randn(s, b, h, d, generator=g)
    angles = torch.randn(s, r // 2, generator=g) * 3
    cos, sin = angles.cos(), angles.sin()
    for interleaved in (False, True):
        out = apply_rotary_pos_emb_with_cos_sin(t, cos, sin, rotary_interleaved=interleaved)
        assert torch.allclose(out.double(), _complex_rotation(t, cos, sin, interleaved), atol=1e-6)
        assert torch.equal(out[..., r:], t[..., r:])
    # Hugging Face's rotate-half rotation on [b, h, s, r] with the full-width cos / sin [b, s, r].
    q = t[..., :r].permute(1, 2, 0, 3)
    full = lambda x: torch.cat((x, x), dim=-1)[None].expand(b, s, r)  # noqa: E731
    hf_q, _ = hf_apply(q, q, full(cos), full(sin))
    ours = apply_rotary_pos_emb_with_cos_sin(t, cos, sin)[..., :r].permute(1, 2, 0, 3)
    assert torch.allclose(ours, hf_q, atol=1e-6)
    half = apply_rotary_pos_emb_with_cos_sin(t.bfloat16(), cos, sin)
    assert half.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------ multi-token prediction
def test_mtp_loss_logging_helper_and_reduce_mtp_losses(single_rank):
    from megatron.core.transformer.multi_token_prediction import (
        MTPLossLoggingHelper,
        MultiTokenPredictionBlock,
        reduce_mtp_losses,
    )

    helper = MTPLossLoggingHelper
    helper.tracker.clear()
    world = torch.distributed.group.WORLD
    helper.save_loss_to_tracker(torch.tensor(3.0), 0, 2, avg_group=world)
    helper.save_loss_to_tracker(torch.tensor(1.0), 0, 2, avg_group=world)
    helper.save_loss_to_tracker(torch.tensor(5.0), 1, 2, avg_group=world)
    helper.save_loss_to_tracker(torch.tensor(7.0), None, 2)  # no layer number: not saved
    assert helper.tracker["values"].tolist() == [4.0, 5.0] and helper.tracker["avg_group"] is world
    writer, wandb, totals = _Writer(), _Writer(), {"mtp_1 loss": torch.tensor(1.0)}
    helper.track_mtp_metrics(0.5, 3, writer, wandb_writer=wandb, total_loss_dict=totals)
    assert float(totals["mtp_1 loss"]) == 3.0 and float(totals["mtp_2 loss"]) == 2.5
    assert writer.scalars == [("mtp_1 loss", 2.0, 3), ("mtp_2 loss", 2.5, 3)]
    assert wandb.logs == [({"mtp_1 loss": 2.0}, 3), ({"mtp_2 loss": 2.5}, 3)]
    assert helper.tracker["values"].tolist() == [0.0, 0.0] and helper.tracker["avg_group"] is None
    # The training loop's reduce_mtp_losses runs through the helper: per depth, sum / micro-batches (one rank).
    block = MultiTokenPredictionBlock.__new__(MultiTokenPredictionBlock)
    torch.nn.Module.__init__(block)
    block.layers = torch.nn.ModuleList([torch.nn.Identity() for _ in range(3)])
    block.pg_collection, block.tracked_losses = None, {0: torch.tensor(2.0), 2: torch.tensor(6.0)}
    assert reduce_mtp_losses(block, 2) == {"mtp_1 loss": 1.0, "mtp_2 loss": 0.0, "mtp_3 loss": 3.0}
    assert block.tracked_losses == {} and reduce_mtp_losses(block, 2) == {}
    helper.tracker.clear()


def test_tie_mtp_state_dict_entries(single_rank):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.multi_token_prediction import (
        tie_output_layer_state_dict,
        tie_word_embeddings_state_dict,
    )

    world = torch.distributed.group.WORLD
    for tie, key in ((tie_word_embeddings_state_dict, "embedding.word_embeddings.weight"),
                     (tie_output_layer_state_dict, "output_layer.weight")):
        weight = torch.randn(12, 4)
        sd = {key: "the stage's own entry", "other": 1}
        tie(sd, weight, key, tp_group=world, dp_cp_group=world)
        leaf = sd[key]
        assert isinstance(leaf, ShardedTensor) and leaf.key == key and leaf.data is weight
        assert leaf.replica_id == (1, 0, 0) and leaf.allow_shape_mismatch and sd["other"] == 1
        assert leaf.global_shape == (12, 4)
        with pytest.raises(KeyError, match="not in the sharded state dict"):
            tie({}, weight, key, tp_group=world, dp_cp_group=world)


# ------------------------------------------------------------------------------------------ cross entropy
def test_vocab_parallel_cross_entropy_steps_match_torch():
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as V

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 3, 16, generator=g, dtype=torch.float64).float() * 3
    target = torch.randint(0, 16, (5, 3), generator=g)
    grad_out = torch.rand(5, 3, generator=g)
    full = logits.clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(full.view(-1, 16), target.view(-1), reduction="none").view(5, 3)
    (ref * grad_out).sum().backward()
    # Two vocabulary shards of 8, the all-reduces done by hand (MAX of the maxima, SUM of the rest).
    shards, maxima = [], []
    for r in range(2):
        local, local_max = V.calculate_logits_max(logits[..., 8 * r:8 * (r + 1)].clone())
        shards.append(local)
        maxima.append(local_max)
    m = torch.maximum(*maxima)
    parts = [V.calculate_predicted_logits(shards[r], target, m, 8 * r, 8 * (r + 1)) for r in range(2)]
    predicted = parts[0][2] + parts[1][2]
    sum_exp = parts[0][3] + parts[1][3]
    grads = []
    for r in range(2):
        mask, masked_1d, _, _, exp_logits = parts[r]
        softmax, loss = V.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        assert torch.allclose(loss, ref.detach(), atol=1e-5)
        grad_2d, rows, update, grad_input = V.prepare_gradient_calculation_operands(softmax, mask)
        assert update.tolist() == (~mask).float().view(-1).tolist()
        grads.append(V.calculate_gradients(grad_2d, rows, masked_1d, update, grad_input, grad_out))
    assert torch.allclose(torch.cat(grads, dim=-1), full.grad, atol=1e-6)
    # fp32 input: the steps work in place on the caller's tensor (megatron-core's contract); bf16 is upcast.
    x = torch.randn(2, 4)
    assert V.calculate_logits_max(x)[0] is x and V.calculate_logits_max(x.bfloat16())[0].dtype == torch.float32


# ------------------------------------------------------------------------------------------ upcycling
def _gpt(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    return GPTModel(config, get_gpt_decoder_block_spec(config), config.padded_vocab_size,
                    config.max_position_embeddings)


def test_upcycling_a_dense_gpt(single_rank):
    from helpers.models_helpers import gpt_inputs
    from megatron.core.transformer.moe.upcycling_utils import load_and_upcycle_model, upcycle_state_dict

    torch.manual_seed(5)
    dense = _gpt(tiny_config(ffn_hidden_size=32))
    # Granularity 1, softmax after top-k: every expert is the dense MLP, so the MoE model computes the dense one.
    moe = _gpt(_moe_config(ffn_hidden_size=32, moe_ffn_hidden_size=32, add_bias_linear=True,
                           moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None))
    router_before = moe.decoder.layers[0].mlp.router.weight.detach().clone()
    loaded = []
    out = load_and_upcycle_model(lambda *a, **k: loaded.append((a, k)) or (7, 1.5e9), [moe], [dense],
                                 load_args=("ckpt",), load_kwargs={"strict": True})
    assert out == (7, 1.5e9) and loaded == [(("ckpt",), {"strict": True})]
    assert torch.equal(moe.decoder.layers[0].mlp.router.weight, router_before)  # g = 1: rows kept
    ids, pos, mask, _ = gpt_inputs(vocab=64)
    dense.eval(), moe.eval()
    with torch.no_grad():
        assert torch.allclose(moe(ids, pos, mask), dense(ids, pos, mask), atol=1e-5)
    # Granularity 2 (dense width 32, experts 16), 4 experts: expert e holds block e mod 2 scaled by sqrt(2) (gelu);
    # fc2's bias is repeated unscaled; the router's first 2 rows each appear twice.
    fine = _gpt(_moe_config(ffn_hidden_size=32, moe_ffn_hidden_size=16, add_bias_linear=True))
    sd = upcycle_state_dict([fine], [dense])["model"]
    d1 = dense.state_dict()["decoder.layers.1.mlp.linear_fc1.weight"]
    d2 = dense.state_dict()["decoder.layers.1.mlp.linear_fc2.weight"]
    b2 = dense.state_dict()["decoder.layers.1.mlp.linear_fc2.bias"]
    for e in range(4):
        prefix = f"decoder.layers.1.mlp.experts.local_experts.{e}."
        block = e % 2
        assert torch.allclose(sd[prefix + "linear_fc1.weight"], d1[16 * block:16 * (block + 1)] * 2 ** 0.5)
        assert torch.allclose(sd[prefix + "linear_fc2.weight"], d2[:, 16 * block:16 * (block + 1)] * 2 ** 0.5)
        assert torch.equal(sd[prefix + "linear_fc2.bias"], b2)
    router = fine.state_dict()["decoder.layers.1.mlp.router.weight"]
    assert torch.equal(sd["decoder.layers.1.mlp.router.weight"], router[[0, 0, 1, 1]])
    assert torch.equal(sd["embedding.word_embeddings.weight"], dense.state_dict()["embedding.word_embeddings.weight"])
    with pytest.raises(ValueError, match="divisible"):
        upcycle_state_dict([_gpt(_moe_config(ffn_hidden_size=32, moe_ffn_hidden_size=12))], [dense])

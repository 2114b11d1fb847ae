"""Aux-loss-free load balancing (``--moe-router-enable-expert-bias``) in a GPT model, one rank.

A training forward counts each router's tokens per expert (recomputed here by hand from the router's input: sigmoid
scores plus the bias, top-k); ``finalize_model_grads`` then moves every bias by ``rate * sign(mean - count)`` and
clears the counts. Evaluation does not count; the bias picks the experts but does not scale their weights; bf16
leaves the bias and the counts in fp32. finalize_model_grads also restarts global_aux_loss's running counts.
"""
import pytest
import torch

from helpers.models_helpers import single_rank  # noqa: F401  (fixture)

E, K, H, SEQ, BATCH, RATE = 4, 2, 32, 8, 3, 0.05


def _model(**extra):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=4, ffn_hidden_size=48,
                               num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=24,
                               moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                               moe_router_bias_update_rate=RATE, add_bias_linear=False, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True, **extra)
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_decoder_block_spec(config), 64, SEQ)
    routers = [layer.mlp.router for layer in model.decoder.layers]
    with torch.no_grad():
        for r in routers:
            r.weight.normal_(0, 0.5)
            r.expert_bias.copy_(torch.randn(E) * 0.3)
    return config, model, routers


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=g)
    return ids, torch.arange(SEQ).expand(BATCH, SEQ), None


def _hand_counts(router, x):
    """Tokens per expert: top-k of sigmoid(x W^T) + expert_bias."""
    scores = torch.sigmoid(x.reshape(-1, H).double() @ router.weight.double().t())
    chosen = torch.topk(scores + router.expert_bias.double(), K, dim=-1).indices
    return torch.bincount(chosen.reshape(-1), minlength=E).float()


def test_training_step_counts_tokens_and_updates_the_bias(single_rank):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    config, model, routers = _model()
    inputs = {}
    hooks = [r.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0].detach().clone()))
             for i, r in enumerate(routers)]
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    before = [r.expert_bias.clone() for r in routers]

    model.eval()
    with torch.no_grad():
        ddp(*_batch())
    assert all(int(r.local_tokens_per_expert.sum()) == 0 for r in routers), "evaluation must not count tokens"

    model.train()
    ddp(*_batch()).sum().backward()
    counts = [_hand_counts(r, inputs[i]) for i, r in enumerate(routers)]
    for r, c in zip(routers, counts):
        assert int(c.sum()) == SEQ * BATCH * K
        assert torch.equal(r.local_tokens_per_expert, c), (r.local_tokens_per_expert, c)
    assert any(len(set(c.tolist())) > 1 for c in counts), "the batch should load the experts unevenly"

    finalize_model_grads([ddp])
    for r, c, b in zip(routers, counts, before):
        expected = b + RATE * torch.sign(c.mean() - c)
        assert torch.allclose(r.expert_bias, expected, atol=1e-7), (r.expert_bias, expected)
        assert int(r.local_tokens_per_expert.abs().sum()) == 0, "counts restart after the update"
    for h in hooks:
        h.remove()


def test_bias_chooses_experts_but_does_not_weight_them(single_rank):
    """Routing weights are the sigmoid scores of the chosen experts, normalised over k, without the bias."""
    _, _, routers = _model()
    router = routers[0].train()
    x = torch.randn(SEQ, BATCH, H, generator=torch.Generator().manual_seed(2))
    probs, routing_map = router(x)
    scores = torch.sigmoid(x.reshape(-1, H) @ router.weight.t())
    chosen = torch.topk(scores + router.expert_bias, K, dim=-1).indices
    expected_map = torch.zeros_like(routing_map).scatter_(1, chosen, True)
    assert torch.equal(routing_map, expected_map)
    picked = scores * expected_map
    assert torch.allclose(probs, picked / picked.sum(-1, keepdim=True), atol=1e-6)
    # A large bias on expert 0 sends every token there.
    with torch.no_grad():
        router.expert_bias.zero_()
        router.expert_bias[0] = 10.0
    _, routing_map = router(x)
    assert bool(routing_map[:, 0].all())


@pytest.mark.parametrize("wrap", ["bf16", "fp16"])
def test_bias_and_counts_stay_fp32_under_float16_module(single_rank, wrap):
    from megatron.core.transformer.module import Float16Module

    config, model, routers = _model(**{wrap: True, "params_dtype": torch.bfloat16 if wrap == "bf16" else
                                       torch.float16})
    wrapped = Float16Module(config, model)
    assert routers[0].expert_bias.dtype != torch.float32  # the wrapper cast the buffers...
    wrapped.train()
    wrapped(*_batch())
    for r in routers:  # ...and the router put them back in fp32 before using them
        assert r.expert_bias.dtype == torch.float32 and r.local_tokens_per_expert.dtype == torch.float32
        assert int(r.local_tokens_per_expert.sum()) == SEQ * BATCH * K
    state = model.state_dict()
    assert state["decoder.layers.0.mlp.router.expert_bias"].dtype == torch.float32
    assert "decoder.layers.0.mlp.router.local_tokens_per_expert" not in state  # not persistent, as in Megatron


def test_finalize_model_grads_restarts_global_aux_loss_counts(single_rank):
    """The other per-step router state: global_aux_loss's running counts restart after every step."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    config, model, routers = _model(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1e-2)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    model.train()
    for _ in range(2):  # two micro-batches accumulate
        ddp(*_batch()).sum().backward()
    assert all(float(r.ga_steps) == 2 and float(r.global_tokens_per_expert.sum()) == 2 * SEQ * BATCH * K
               for r in routers)
    finalize_model_grads([ddp])
    assert all(float(r.ga_steps) == 0 and float(r.global_tokens_per_expert.abs().sum()) == 0 for r in routers)

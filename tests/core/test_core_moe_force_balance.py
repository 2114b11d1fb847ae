"""``--moe-router-force-load-balancing`` (megatron-core's benchmarking mode): the router routes on N(0, 1) logits drawn
from the expert-parallel RNG stream, whatever its weights, and passes the logits' gradient straight through.

Checked by hand, one rank: the routing equals softmax top-k of the draws that the expert-parallel stream gives
(reproduced with torch's generator seeded as megatron-core seeds that stream: seed + 1024 + 100 * ep_rank +
etp_rank); the load is balanced even for a router whose weights send every token to one expert; the router
weight's gradient equals ``grad_logits^T x`` for the gradient of the loss with respect to the random logits.
"""
import torch

from helpers.models_helpers import single_rank  # noqa: F401  (fixture)

E, K, H, T, SEED = 8, 2, 16, 4096, 1234


def _router(force: bool):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E,
                               moe_router_topk=K, moe_router_force_load_balancing=force, add_bias_linear=False,
                               use_cpu_initialization=True)
    router = TopKRouter(config).train()
    with torch.no_grad():
        router.weight.zero_()
        router.weight[3] = 5.0  # without forcing, every token goes to expert 3
    model_parallel_cuda_manual_seed(SEED)
    return router


def test_forced_routing_is_softmax_topk_of_the_expert_parallel_draws(single_rank):
    x = torch.rand(T // 4, 4, H, generator=torch.Generator().manual_seed(0)) + 0.1
    _, unforced_map = _router(False)(x)
    assert bool(unforced_map[:, 3].all())

    router = _router(True)
    probs, routing_map = router(x)
    draws = torch.empty(T, E).normal_(generator=torch.Generator().manual_seed(SEED + 1024))  # ep_rank = etp_rank = 0
    top = torch.topk(draws, K, dim=-1)
    expected_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, top.indices, True)
    assert torch.equal(routing_map, expected_map)
    expected_probs = torch.zeros(T, E).scatter_(1, top.indices, torch.softmax(top.values, dim=-1))
    assert torch.allclose(probs, expected_probs, atol=1e-6)
    counts = routing_map.sum(0).float()
    assert ((counts - T * K / E).abs() < 0.1 * T * K / E).all(), counts  # balanced within 10%

    # The next forward draws new numbers (the stream advances), the default generator is untouched.
    before = torch.get_rng_state()
    _, second_map = router(x)
    assert not torch.equal(second_map, routing_map)
    assert torch.equal(torch.get_rng_state(), before)


def test_forced_routing_passes_the_gradient_straight_through(single_rank):
    router = _router(True)
    x = torch.rand(64, 2, H, generator=torch.Generator().manual_seed(1))
    weights = torch.rand(128, E, generator=torch.Generator().manual_seed(2))
    probs, _ = router(x)
    (probs * weights).sum().backward()

    draws = torch.empty(128, E).normal_(generator=torch.Generator().manual_seed(SEED + 1024)).requires_grad_()
    top = torch.topk(draws, K, dim=-1)
    hand = torch.zeros(128, E).scatter(1, top.indices, torch.softmax(top.values, dim=-1))
    (hand * weights).sum().backward()
    expected = draws.grad.t() @ x.reshape(-1, H)
    assert torch.allclose(router.weight.grad, expected, atol=1e-5)
    assert router.weight.grad.abs().sum() > 0

"""Selective recompute by module (``--recompute-granularity selective --recompute-modules ...``, and the deprecated
``--moe-layer-recompute``), one rank.

For each module (``layernorm``: the input and pre-MLP norms; ``mla_up_proj``: multi-latent attention's latent norms,
up projections and RoPE) the loss and every parameter gradient equal those of the same model without recompute, and the
forward keeps fewer bytes for backward (counted with ``saved_tensors_hooks``): the module really is recomputed.
For the MoE layer, the router's logged losses and the expert-bias token counts are those of one forward, not two.
"""
import pytest
import torch

from helpers.models_helpers import single_rank  # noqa: F401  (fixture)

SEQ, BATCH, VOCAB = 16, 2, 64


def _model(moe=False, mla=False, **extra):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, add_bias_linear=True,
              hidden_dropout=0.1, attention_dropout=0.1, use_cpu_initialization=True)
    if moe:
        kw.update(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, add_bias_linear=False,
                  moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=40,
                  moe_shared_expert_gate=True, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                  bias_activation_fusion=False, moe_input_jitter_eps=0.05)
    if mla:  # multi-latent attention with query compression and latent norms
        kw.update(q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
                  qk_layernorm=True, rotary_scaling_factor=4.0)
    kw.update(extra)
    config = (MLATransformerConfig if mla else TransformerConfig)(**kw)
    torch.manual_seed(0)
    return GPTModel(config, get_gpt_decoder_block_spec(config), VOCAB, SEQ).train()


def _step(model):
    """(loss, grads by name, bytes saved for backward, router losses, expert-bias counts) of one forward/backward."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_layer import moe_routers

    model_parallel_cuda_manual_seed(5)  # dropout and jitter: the same random numbers in both models
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=labels).float().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    routers = moe_routers(model)
    tracked = [{k: float(v) for k, v in r.tracked_losses.items()} for r in routers]
    counts = [r.local_tokens_per_expert.clone() for r in routers if r.expert_bias is not None]
    return float(loss), grads, saved[0], tracked, counts


CASES = {
    "core_attn": (False, {}, ["core_attn"]),
    "layernorm": (False, {}, ["layernorm"]),
    "mla_up_proj": ("mla", {}, ["mla_up_proj"]),
    # (layernorm with an MoE layer changes the order in which the norm output's gradients from the router, experts and
    # shared experts are summed: equal only up to fp32 rounding, so it is checked on the dense model)
    "mla_core_attn_moe": ("mla_moe", {}, ["core_attn", "mla_up_proj", "moe"]),
    "mlp": (False, {}, ["mlp"]),
    "moe": (True, {}, ["moe"]),
    "shared_experts": (True, {}, ["shared_experts"]),
    "moe_act": (True, {"moe_grouped_gemm": True}, ["moe_act"]),
    "moe_everything_alltoall_bias": (True, {"moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall",
                                            "moe_router_score_function": "sigmoid",
                                            "moe_router_enable_expert_bias": True},
                                     ["core_attn", "moe", "shared_experts", "moe_act"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_recomputed_module_gives_the_same_gradients_and_keeps_less(single_rank, name):
    kind, extra, modules = CASES[name]
    moe, mla = kind in (True, "mla_moe"), kind in ("mla", "mla_moe")
    loss0, grads0, saved0, tracked0, counts0 = _step(_model(moe, mla, **extra))
    model = _model(moe, mla, recompute_granularity="selective", recompute_modules=modules, **extra)
    loss1, grads1, saved1, tracked1, counts1 = _step(model)
    assert loss1 == loss0
    assert set(grads1) == set(grads0)
    for n, g in grads0.items():
        assert torch.allclose(grads1[n], g, rtol=1e-6, atol=1e-9), (n, (grads1[n] - g).abs().max())
    assert saved1 < saved0, f"{name}: {saved1} bytes kept for backward, {saved0} without recompute"
    assert tracked1 == tracked0 and (bool(tracked0) and all(tracked0)) == moe  # logged once, not once per pass
    assert all(torch.equal(a, b) for a, b in zip(counts1, counts0)) and len(counts1) == len(counts0)
    print(f"{name}: {saved0} -> {saved1} bytes saved for backward")


def test_moe_layer_recompute_is_selective_recompute_of_moe(single_rank):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=4)
    config = TransformerConfig(moe_layer_recompute=True, **base)
    assert config.recompute_granularity == "selective" and config.recompute_modules == ["core_attn", "moe"]
    assert TransformerConfig(**base).recompute_modules == ["core_attn"]
    with pytest.raises(ValueError, match="full"):
        TransformerConfig(moe_layer_recompute=True, recompute_granularity="full", recompute_method="uniform",
                          recompute_num_layers=1, **base)


@pytest.mark.parametrize("modules, message", [
    (["attention"], "invalid choices"),
    (["moe_act"], "moe-grouped-gemm"),
    (["mla_up_proj"], "needs --multi-latent-attention"),
])
def test_bad_recompute_modules_are_one_line_errors(modules, message):
    from helpers.args_test_helpers import validated
    from megatron.training.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=message) as info:
        validated("--num-experts 4 --recompute-granularity selective --recompute-modules " + " ".join(modules))
    assert "\n" not in str(info.value)


def test_recompute_flags_reach_the_config():
    from helpers.args_test_helpers import validated
    from megatron.training.arguments.transformer_config import core_transformer_config_from_args
    from megatron.training.errors import ConfigurationError

    args = validated("--num-experts 4 --swiglu --disable-bias-linear --recompute-granularity selective "
                     "--recompute-modules moe shared_experts")
    config = core_transformer_config_from_args(args)
    assert config.recompute_granularity == "selective" and config.recompute_modules == ["moe", "shared_experts"]
    config = core_transformer_config_from_args(validated("--num-experts 4 --moe-layer-recompute"))
    assert config.recompute_granularity == "selective" and "moe" in config.recompute_modules
    with pytest.raises(ConfigurationError, match="--moe-layer-recompute cannot be combined"):
        validated("--num-experts 4 --moe-layer-recompute --recompute-granularity full --recompute-method uniform")


def test_grouped_gemm_probe_leaves_the_rng_alone_and_works_under_no_grad(monkeypatch):
    """The one-time ``torch._grouped_mm`` probe runs inside the first forward: it must not draw random numbers
    (dropout after it would change) and must give the same answer when that forward runs under no_grad (the first
    pass of a recompute, or an evaluation). A working kernel is simulated with a loop of matmuls."""
    from megatron.core.transformer.moe import experts

    def fake_grouped_mm(a, b, offs):
        starts = [0] + offs.tolist()[:-1]
        return torch.cat([a[s:e] @ b[j] for j, (s, e) in enumerate(zip(starts, offs.tolist()))])

    monkeypatch.setattr(torch, "_grouped_mm", fake_grouped_mm, raising=False)
    experts.grouped_mm_works.cache_clear()
    try:
        state = torch.get_rng_state()
        with torch.no_grad():
            assert experts.grouped_mm_works("cpu", torch.float32)
        assert torch.equal(torch.get_rng_state(), state)
    finally:
        experts.grouped_mm_works.cache_clear()

"""megatron-core GPTModel with MoE layers against Hugging Face ``MixtralForCausalLM`` with the same random weights
(fp32, CPU, top-2 of 4 experts, dropless): logits and loss within 1e-5 relative for SequentialMLP and GroupedMLP,
the conversion round trip, and the load-balancing / z losses against hand computations from HF's router logits
(reference §3.3: ``aux = E * coeff / (k * T^2) * sum_e P_e * c_e`` per layer; ``z = coeff * mean(lse^2)``)."""
import pytest
import torch

from helpers.numerics import rel_err
from helpers.models_helpers import causal_mask, single_rank, tiny_hf_mixtral  # noqa: F401  (fixture)

transformers = pytest.importorskip("transformers")

from megatron.core.models.conversion import hf_moe  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.core.transformer.moe.moe_layer import moe_routers  # noqa: E402

SEQ, BATCH, E, K = 12, 2, 4, 2


def _ours(cfg, grouped, **extra):
    config = hf_moe.moe_config_to_megatron(cfg, make_vocab_size_divisible_by=32, use_cpu_initialization=True,
                                           moe_grouped_gemm=grouped, **extra)
    model = GPTModel(config, get_gpt_decoder_block_spec(config), config.padded_vocab_size,
                     config.max_position_embeddings, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", rotary_base=config.rotary_base)
    return config, model


def test_mixtral_logits_loss_and_round_trip(single_rank):
    cfg, hf_model = tiny_hf_mixtral(96, E, K)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    with torch.no_grad():
        ref = hf_model(ids).logits
        hf_loss = hf_model(ids, labels=ids).loss
    errs = {}
    for grouped in (False, True):
        config, model = _ours(cfg, grouped)
        sd = hf_moe.moe_hf_to_megatron(hf_model.state_dict(), cfg, config.padded_vocab_size, grouped_gemm=grouped)
        model.load_state_dict(sd)
        model.eval()
        with torch.no_grad():
            logits = model(ids, pos, causal_mask(SEQ))
            per_token = model(ids, pos, causal_mask(SEQ), labels=torch.roll(ids, -1, dims=1))
        name = "GroupedMLP" if grouped else "SequentialMLP"
        errs[name] = rel_err(logits, ref)
        loss = per_token[:, :-1].mean()
        errs[name + " loss"] = abs(loss.item() - hf_loss.item()) / abs(hf_loss.item())
        back = hf_moe.moe_megatron_to_hf(model.state_dict(), cfg)
        hf_sd = hf_model.state_dict()
        assert set(back) == set(hf_sd)
        assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd), name
    print(f"Mixtral (top-2 of 4) relative errors vs HF: {errs}")
    for name, err in errs.items():
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"


def test_mixtral_router_losses_against_hand_computation(single_rank):
    cfg, hf_model = tiny_hf_mixtral(96, E, K)
    config, model = _ours(cfg, False, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    model.load_state_dict(hf_moe.moe_hf_to_megatron(hf_model.state_dict(), cfg, config.padded_vocab_size))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    with torch.no_grad():
        router_logits = hf_model(ids, output_router_logits=True).router_logits  # per layer [B*S, E]
    model.train()
    model(ids, pos, causal_mask(SEQ)).sum().backward()
    routers = moe_routers(model)
    assert len(routers) == 2
    for layer, (router, logits) in enumerate(zip(routers, router_logits)):
        logits = logits.double()
        T = logits.shape[0]
        scores = torch.softmax(logits, dim=-1)
        chosen = torch.zeros_like(scores).scatter(1, scores.topk(K, dim=-1).indices, 1.0)
        hand_aux = E / (K * T * T) * float((scores.sum(0) * chosen.sum(0)).sum())
        hand_z = float(torch.logsumexp(logits, dim=-1).pow(2).mean())
        ours = {k: float(v) for k, v in router.tracked_losses.items()}  # loss / coeff, as Megatron tracks it
        assert abs(ours["load_balancing_loss"] - hand_aux) <= 1e-5 * hand_aux, (layer, ours, hand_aux)
        assert abs(ours["z_loss"] - hand_z) <= 1e-5 * hand_z, (layer, ours, hand_z)
    # The aux loss trained the router: its gradient differs from the gradient without the aux loss.
    grad_with = routers[0].weight.grad.clone()
    config2, plain = _ours(cfg, False)
    plain.load_state_dict(hf_moe.moe_hf_to_megatron(hf_model.state_dict(), cfg, config.padded_vocab_size))
    plain.train()
    plain(ids, pos, causal_mask(SEQ)).sum().backward()
    assert not torch.allclose(moe_routers(plain)[0].weight.grad, grad_with)


def _qwen2_moe_block(norm_topk_prob):
    torch.manual_seed(3)
    cfg = transformers.Qwen2MoeConfig(hidden_size=32, moe_intermediate_size=48, shared_expert_intermediate_size=40,
                                      num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm_topk_prob,
                                      hidden_act="silu", num_attention_heads=4, num_key_value_heads=2)
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    block = Qwen2MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(0, 0.5 if name == "gate.weight" else 0.1)
    return block


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
@pytest.mark.parametrize("norm_topk_prob", [False, True], ids=["pre_softmax", "renormalised"])
def test_moe_layer_with_gated_shared_expert_equals_qwen2_moe_block(single_rank, norm_topk_prob, grouped):
    """MoELayer with --moe-shared-expert-intermediate-size and --moe-shared-expert-gate against Hugging Face's
    Qwen2MoeSparseMoeBlock (routed SwiGLU experts + shared SwiGLU expert scaled by sigmoid(x . g)), same weights.
    HF's router is softmax over all experts then top-k: without norm_topk_prob that is --moe-router-pre-softmax, with
    it Megatron's default (softmax over the top-k logits). Output and input gradient within 1e-5."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    block = _qwen2_moe_block(norm_topk_prob)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                               num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=48,
                               moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True,
                               moe_router_pre_softmax=not norm_topk_prob, moe_grouped_gemm=grouped,
                               gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                               add_bias_linear=False, bias_activation_fusion=False, use_cpu_initialization=True)
    layer = GPTModel(config, get_gpt_decoder_block_spec(config), 64, 16).decoder.layers[0].mlp
    hf_sd = block.state_dict()
    ours = {"router.weight": hf_sd["gate.weight"],
            "shared_experts.linear_fc1.weight": torch.cat([hf_sd["shared_expert.gate_proj.weight"],
                                                           hf_sd["shared_expert.up_proj.weight"]]),
            "shared_experts.linear_fc2.weight": hf_sd["shared_expert.down_proj.weight"],
            "shared_experts.gate_weight": hf_sd["shared_expert_gate.weight"]}
    fc1, fc2 = hf_sd["experts.gate_up_proj"], hf_sd["experts.down_proj"]  # [E, 2F, h] ([gate; up]), [E, h, F]
    if grouped:
        ours["experts.weight1"] = torch.cat([w.t() for w in fc1], dim=1)
        ours["experts.weight2"] = torch.cat([w.t() for w in fc2], dim=0)
    else:
        for e in range(E):
            ours[f"experts.local_experts.{e}.linear_fc1.weight"] = fc1[e]
            ours[f"experts.local_experts.{e}.linear_fc2.weight"] = fc2[e]
    missing, unexpected = layer.load_state_dict(ours, strict=False)
    assert not unexpected and not [k for k in missing if "_extra_state" not in k], (missing, unexpected)

    x = torch.randn(SEQ, BATCH, 32, generator=torch.Generator().manual_seed(4))
    x_ours, x_hf = x.clone().requires_grad_(True), x.transpose(0, 1).contiguous().requires_grad_(True)
    g = torch.randn(SEQ, BATCH, 32, generator=torch.Generator().manual_seed(5))
    out, _ = layer(x_ours)
    ref = block(x_hf).transpose(0, 1)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    assert rel_err(out.detach(), ref.detach()) <= 1e-5, rel_err(out.detach(), ref.detach())
    assert rel_err(x_ours.grad, x_hf.grad.transpose(0, 1)) <= 1e-5
    # The shared expert and its gate really contribute: without them the output differs.
    assert rel_err((out - layer.shared_experts(x)).detach(), ref.detach()) > 1e-2

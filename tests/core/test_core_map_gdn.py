"""Gated DeltaNet (megatron.core.ssm.gated_delta_net) against Hugging Face transformers' Qwen3-Next layer
(``Qwen3NextGatedDeltaNet``, its PyTorch reference path) with the same weights, the chunked delta rule against the
token-by-token recurrence written here, and megatron-core's experimental-attention-variant specs (patterns, a GPT with
GDN and attention layers that trains one step)."""
import pytest
import torch
import torch.nn.functional as F

from helpers.models_helpers import single_rank  # noqa: F401  (fixture)

H, NK, NV, DK, DV, K = 32, 2, 4, 8, 6, 4


def _recurrence(q, k, v, g, beta):
    """S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T, o_t = S_t^T q_t / sqrt(d_k), float64, one token
    at a time ([b, s, H, d] inputs)."""
    b, s, h, d_k = k.shape
    state = torch.zeros(b, h, d_k, v.shape[-1], dtype=torch.float64)
    out = torch.zeros(b, s, h, v.shape[-1], dtype=torch.float64)
    for t in range(s):
        a = g[:, t].double().exp()[..., None, None]
        kt, vt, qt = k[:, t].double(), v[:, t].double(), q[:, t].double() / d_k ** 0.5
        decayed = a * state
        u = beta[:, t].double()[..., None] * (vt - torch.einsum("bhkv,bhk->bhv", decayed, kt))
        state = decayed + kt[..., :, None] * u[..., None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, qt)
    return out


def test_chunked_delta_rule_equals_the_recurrence():
    from megatron.core.ssm.gated_delta_net import chunk_gated_delta_rule, l2norm

    torch.manual_seed(0)
    b, s, h = 2, 11, 3
    q, k = l2norm(torch.randn(b, s, h, DK)), l2norm(torch.randn(b, s, h, DK))
    v = torch.randn(b, s, h, DV)
    g = -torch.rand(b, s, h) * 2
    beta = torch.rand(b, s, h)
    expected = _recurrence(q, k, v, g, beta)
    for chunk in (4, 64):
        out, state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, output_final_state=True)
        assert torch.allclose(out.double(), expected, atol=1e-5), (chunk, (out.double() - expected).abs().max())
        assert state.shape == (b, h, DK, DV)


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=H, num_attention_heads=4, normalization="RMSNorm", layernorm_epsilon=1e-6,
                activation_func=F.silu, experimental_attention_variant="gated_delta_net", linear_attention_freq=2,
                linear_conv_kernel_dim=K, linear_key_head_dim=DK, linear_value_head_dim=DV,
                linear_num_key_heads=NK, linear_num_value_heads=NV)
    base.update(overrides)
    return TransformerConfig(**base)


def test_gated_delta_net_equals_transformers_qwen3_next(single_rank):  # noqa: F811
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    torch.manual_seed(1)
    hf = Qwen3NextGatedDeltaNet(Qwen3NextConfig(
        hidden_size=H, linear_num_key_heads=NK, linear_num_value_heads=NV, linear_key_head_dim=DK,
        linear_value_head_dim=DV, linear_conv_kernel_dim=K, num_hidden_layers=1, layer_types=["linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8), 0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = GatedDeltaNet(_config(), layer_number=1)
    r = NV // NK
    # HF groups in_proj rows per key head g: [q_g, k_g, v_g (r heads), z_g] and [b_g (r), a_g (r)]; ours keeps each
    # kind whole: [q; k; v; z; beta; alpha] (value head g*r + i).
    qkvz = hf.in_proj_qkvz.weight.view(NK, 2 * DK + 2 * r * DV, H)
    ba = hf.in_proj_ba.weight.view(NK, 2 * r, H)
    q, k, v, z = torch.split(qkvz, [DK, DK, r * DV, r * DV], dim=1)
    beta, alpha = torch.split(ba, [r, r], dim=1)
    with torch.no_grad():
        ours.in_proj.weight.copy_(torch.cat([t.reshape(-1, H) for t in (q, k, v, z, beta, alpha)]))
        ours.conv1d.weight.copy_(hf.conv1d.weight)
        ours.dt_bias.copy_(hf.dt_bias)
        ours.A_log.copy_(hf.A_log)
        ours.out_norm.weight.copy_(hf.norm.weight)
        ours.out_proj.weight.copy_(hf.out_proj.weight)
    x = torch.randn(2, 9, H)
    with torch.no_grad():
        expected = hf(x)
        out, bias = ours(x.transpose(0, 1).contiguous(), None)
    assert bias is None
    err = (out.transpose(0, 1) - expected).abs().max() / expected.abs().max()
    assert err < 1e-5, err


def test_experimental_attention_specs_build_a_gpt_that_trains(single_rank):  # noqa: F811
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    config = _config(num_layers=4, num_moe_experts=2, moe_layer_freq=[0, 1, 0, 1], moe_router_topk=2,
                     moe_token_dispatcher_type="alltoall")
    assert specs.get_linear_attention_pattern(config) == [1, 0, 1, 0]
    assert specs.get_moe_layer_pattern(config) == [0, 1, 0, 1]
    assert specs.is_linear_attention_variant("gated_delta_net") and not specs.is_linear_attention_variant("dsa")
    block = specs.get_transformer_block_with_experimental_attention_variant_spec(config)
    model = GPTModel(config, block, vocab_size=64, max_sequence_length=16, position_embedding_type="rope")
    kinds = [type(layer.self_attention).__name__ for layer in model.decoder.layers]
    assert kinds[0] == kinds[2] == "GatedDeltaNet" and kinds[1] == kinds[3] == "SelfAttention", kinds
    assert [type(layer.mlp).__name__ for layer in model.decoder.layers] == ["MLP", "MoELayer", "MLP", "MoELayer"]
    assert isinstance(model.decoder.layers[0].self_attention, GatedDeltaNet)
    tokens = torch.randint(0, 64, (2, 12))
    position_ids = torch.arange(12).expand(2, -1)
    mask = torch.triu(torch.ones(1, 1, 12, 12, dtype=torch.bool), 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        loss = model(tokens, position_ids, mask, labels=tokens).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    with pytest.raises(ValueError, match="linear_attention_freq"):
        _config(linear_attention_freq=None)

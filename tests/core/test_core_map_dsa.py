"""DeepSeek sparse attention (megatron.core.transformer.experimental_attention_variant.dsa) against a plain PyTorch
computation written here from the definitions: the indexer's scores and top-k (complex-number RoPE on adjacent pairs,
no Hadamard rotation: it is orthonormal, so it leaves the dot products unchanged), the sparse attention (a loop over
queries, softmax over the selected causal keys), the indexer's KL loss and its gradient into the indexer's weights;
the Hadamard rotation against the Sylvester matrix; the config's refusals."""
import math

import pytest
import torch

from helpers.models_helpers import single_rank  # noqa: F401  (fixture)

S, B, H, HEADS, R_Q, R_KV, D_N, D_R, D_V = 7, 2, 32, 4, 16, 12, 8, 4, 8
INDEX_HEADS, INDEX_DIM, TOPK, COEFF = 3, 8, 3, 0.7


def _config(**overrides):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    base = dict(num_layers=2, hidden_size=H, num_attention_heads=HEADS, q_lora_rank=R_Q, kv_lora_rank=R_KV,
                qk_head_dim=D_N, qk_pos_emb_head_dim=D_R, v_head_dim=D_V, rope_type="rope", qk_layernorm=True,
                experimental_attention_variant="dsa", dsa_indexer_n_heads=INDEX_HEADS,
                dsa_indexer_head_dim=INDEX_DIM, dsa_indexer_topk=TOPK, dsa_indexer_loss_coeff=COEFF)
    base.update(overrides)
    return MLATransformerConfig(**base)


def _sylvester(m):
    h = torch.ones(1, 1)
    while h.size(0) < m:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("n", [8, 6])
def test_rotate_activation_is_the_normalised_sylvester_hadamard(n):
    from megatron.core.transformer.experimental_attention_variant.dsa import rotate_activation

    x = torch.randn(3, 5, n, dtype=torch.float64)
    m = 1 << (n - 1).bit_length()
    expected = (torch.nn.functional.pad(x, (0, m - n)) @ _sylvester(m).double())[..., :n] / math.sqrt(n)
    assert torch.allclose(rotate_activation(x), expected, atol=1e-12)


def _rope_pairs(x, base=10000.0):
    """Adjacent pairs (x_2i, x_2i+1) as complex numbers rotated by pos * base^(-2i/d); [re..., im...] out."""
    s, d = x.shape[0], x.shape[-1]
    freqs = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * freqs[None, :]
    shape = (s,) + (1,) * (x.dim() - 2) + (d // 2,)
    z = torch.complex(x[..., 0::2].double(), x[..., 1::2].double()) * torch.polar(torch.ones_like(angle),
                                                                                  angle).reshape(shape)
    return torch.cat([z.real, z.imag], dim=-1)


def _indexer_weights(m):
    idx = m.core_attention.indexer
    return {"wq_b": idx.linear_wq_b.weight, "wk": idx.linear_wk.weight, "w": idx.linear_weights_proj.weight,
            "norm_w": idx.k_norm.weight, "norm_b": idx.k_norm.bias}


def _reference(m, weights, x, query, key, value):
    """(index scores [b, s, s], top-k, output [s, b, n d_v], indexer loss) from the layer's weights (the indexer's
    from ``weights``), float64."""
    w_qb, w_k, w_w = (weights[name].double() for name in ("wq_b", "wk", "w"))
    qr = x.double() @ m.linear_q_down_proj.weight.double().T          # the query latent before its norm
    q = (qr @ w_qb.T).reshape(S, B, INDEX_HEADS, INDEX_DIM)
    k = torch.nn.functional.layer_norm(x.double() @ w_k.T, (INDEX_DIM,), weights["norm_w"].double(),
                                       weights["norm_b"].double(), eps=m.config.layernorm_epsilon)
    q = torch.cat([q[..., :INDEX_DIM - D_R], _rope_pairs(q[..., INDEX_DIM - D_R:])], -1)
    k = torch.cat([k[..., :INDEX_DIM - D_R], _rope_pairs(k[..., INDEX_DIM - D_R:])], -1)
    weights = (x.double() @ w_w.T) / math.sqrt(INDEX_HEADS) / math.sqrt(INDEX_DIM)
    scores = torch.zeros(B, S, S, dtype=torch.float64)
    for b in range(B):
        for t in range(S):
            for s in range(S):
                dots = torch.relu(q[t, b] @ k[s, b])                    # [index heads]
                scores[b, t, s] = (weights[t, b] * dots).sum() if s <= t else float("-inf")
    topk = scores.topk(min(TOPK, S), dim=-1)[1]
    scale = m.core_attention.softmax_scale
    out = torch.zeros(S, B, HEADS, D_V, dtype=torch.float64)
    target = torch.zeros(B, S, S, dtype=torch.float64)
    for b in range(B):
        for t in range(S):
            chosen = sorted(s for s in topk[b, t].tolist() if s <= t)
            for n in range(HEADS):
                logits = torch.stack([query[t, b, n].double() @ key[s, b, n].double() for s in chosen]) * scale
                out[t, b, n] = torch.softmax(logits, 0) @ value[chosen, b, n].double()
                dense = torch.stack([query[t, b, n].double() @ key[s, b, n].double() for s in range(t + 1)]) * scale
                target[b, t, :t + 1] += torch.softmax(dense, 0)
    target = target / target.sum(-1, keepdim=True)
    predicted = torch.softmax(scores, -1)
    kl = (target * (torch.log(target + 1e-10) - torch.log(predicted + 1e-10))).sum(-1).mean()
    return scores, topk, out.reshape(S, B, HEADS * D_V), COEFF * kl


def test_sparse_attention_indexer_and_loss_match_the_definitions(single_rank):  # noqa: F811
    from megatron.core.transformer.experimental_attention_variant.dsa import (DSAIndexerLossLoggingHelper,
                                                                               DSAttention, DSAttentionSubmodules)
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    torch.manual_seed(3)
    sub = MLASelfAttentionSubmodules(core_attention=ModuleSpec(module=DSAttention, submodules=DSAttentionSubmodules()))
    m = MLASelfAttention(_config(), sub, layer_number=2)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.4)
    seen = {}
    m.core_attention.register_forward_pre_hook(lambda mod, args: seen.update(qkv=args[:3]))
    captured = {}
    indexer = m.core_attention.indexer
    original = indexer.forward_with_scores

    def spy(*args, **kwargs):
        captured["scores"], captured["topk"] = original(*args, **kwargs)
        return captured["scores"], captured["topk"]

    indexer.forward_with_scores = spy
    x = torch.randn(S, B, H)
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    out, _ = m(x, None)
    scores, topk, ref_context, ref_loss = _reference(m, _indexer_weights(m), x, *seen["qkv"])
    finite = torch.isfinite(scores)
    assert torch.equal(finite, torch.isfinite(captured["scores"]))
    assert torch.allclose(captured["scores"][finite].double(), scores[finite], rtol=1e-5, atol=1e-6)
    assert torch.equal(captured["topk"].sort(-1)[0], topk.sort(-1)[0])
    # the core attention's output, through linear_proj
    context = torch.nn.functional.linear(ref_context.float(), m.linear_proj.weight)
    assert torch.allclose(out, context, rtol=1e-4, atol=1e-5), (out - context).abs().max()
    # the indexer loss recorded for layer 2 of 2, and its gradient (scale 1) into the indexer's weights only
    recorded = DSAIndexerLossLoggingHelper.tracker["values"]
    assert recorded[0] == 0 and abs(recorded[1].item() - ref_loss.item()) < 1e-5 * max(1.0, ref_loss.item())
    assert ref_loss.item() > 1e-3
    out.sum().backward()
    leaves = {name: w.detach().double().requires_grad_() for name, w in _indexer_weights(m).items()}
    _reference(m, leaves, x, *(t.detach() for t in seen["qkv"]))[3].backward()
    for name, w in _indexer_weights(m).items():
        assert w.grad is not None and torch.allclose(w.grad.double(), leaves[name].grad, rtol=1e-4, atol=1e-7), name


def test_config_refusals():
    with pytest.raises(ValueError, match="needs multi-latent attention"):
        from megatron.core.transformer.transformer_config import TransformerConfig

        TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=HEADS, experimental_attention_variant="dsa",
                          dsa_indexer_n_heads=2, dsa_indexer_head_dim=8, dsa_indexer_topk=2)
    with pytest.raises(ValueError, match="dsa_indexer_topk > 0"):
        _config(dsa_indexer_topk=None)
    with pytest.raises(ValueError, match="context parallelism"):
        _config(context_parallel_size=2)
    with pytest.raises(ValueError, match="must be .dsa. or .gated_delta_net."):
        _config(experimental_attention_variant="gdn")

"""Packed sequences (megatron-core's ``PackedSeqParams``, ``qkv_format='thd'``) in the local attention path.

A tiny GPT (rotary, grouped-query attention) on one packed row of 3 documents must give, per document, the logits
and per-token losses of running that document alone (an ordinary causal batch of one document), and its gradients
must be the sum of the separate runs' gradients. The core attention with padded ``cu_seqlens`` is checked against
plain ``scaled_dot_product_attention`` per document; the rotary rows against positions written by hand. What is
still unsupported (a format other than thd / sbhd, padded documents under CP without a causal mask) is refused
with a clear message. On 2 gloo ranks (one launch): a tiny GPT trained through the hybrid context-parallel schedule,
and the same documents as one THD row with CP 2, against the documents run alone.
"""
import pytest
import torch
import torch.nn.functional as F

from helpers.models_helpers import causal_mask, single_rank  # noqa: F401  (fixture)

VOCAB, LENGTHS = 64, (5, 7, 4)


def _config(**extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                  hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                  position_embedding_type="rope")
    fields.update(extra)
    return TransformerConfig(**fields)


def _packed(lengths, padded=None):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_pad = None if padded is None else torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()],
                                                      dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                           cu_seqlens_kv_padded=cu_pad, max_seqlen_q=max(padded or lengths),
                           max_seqlen_kv=max(padded or lengths))


@pytest.fixture(scope="module")
def gpt(single_rank):  # noqa: F811
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(0)
    return GPTModel(_config(), get_gpt_layer_local_spec(), VOCAB, 32)


def test_packed_gpt_matches_documents_run_alone(gpt):
    g = torch.Generator().manual_seed(1)
    total = sum(LENGTHS)
    ids = torch.randint(0, VOCAB, (1, total), generator=g)
    labels = torch.randint(0, VOCAB, (1, total), generator=g)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    packed = _packed(LENGTHS)

    gpt.zero_grad(set_to_none=True)
    logits = gpt(ids, positions, None, packed_seq_params=packed)
    loss = gpt(ids, positions, None, labels=labels, packed_seq_params=packed)
    loss.sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in gpt.named_parameters()}

    gpt.zero_grad(set_to_none=True)
    start = 0
    for n in LENGTHS:
        doc = slice(start, start + n)
        ref_logits = gpt(ids[:, doc], torch.arange(n).unsqueeze(0), causal_mask(n))
        ref_loss = gpt(ids[:, doc], torch.arange(n).unsqueeze(0), causal_mask(n), labels=labels[:, doc])
        torch.testing.assert_close(logits[:, doc], ref_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss[:, doc], ref_loss, rtol=1e-5, atol=1e-5)
        ref_loss.sum().backward()
        start += n
    # Not the same as attending across documents: the packed row run as one sequence differs.
    whole = gpt(ids, torch.arange(total).unsqueeze(0), causal_mask(total))
    assert not torch.allclose(whole[:, LENGTHS[0]:], logits[:, LENGTHS[0]:], atol=1e-3)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, gpt.get_parameter(name).grad, rtol=1e-4, atol=1e-6, msg=name)
    _same_with_recompute_and_unfused(gpt, ids, positions, labels, packed, loss, packed_grads)


def _same_with_recompute_and_unfused(gpt, ids, positions, labels, packed, loss, grads):
    """The packed batch through selective (core attention) / full recompute and the explicit (unfused) softmax."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnBackend

    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    for extra in (dict(recompute_granularity="selective", attention_backend=AttnBackend.unfused),
                  dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)):
        other = GPTModel(_config(**extra), get_gpt_layer_local_spec(), VOCAB, 32)
        other.load_state_dict(gpt.state_dict())
        got = other(ids, positions, None, labels=labels, packed_seq_params=packed)
        got.sum().backward()
        torch.testing.assert_close(got, loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(other.get_parameter(name).grad, grads[name], rtol=1e-4, atol=1e-6)


def test_packed_mla_gpt_matches_documents_run_alone(single_rank):  # noqa: F811
    """Multi-latent attention (its own YaRN rotary on the d_r channels) on the packed row: logits per document and
    summed gradients as the documents run alone."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                                  multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=8, qk_head_dim=8,
                                  qk_pos_emb_head_dim=4, v_head_dim=6, original_max_position_embeddings=16,
                                  rotary_scaling_factor=2.0, hidden_dropout=0.0, attention_dropout=0.0,
                                  use_cpu_initialization=True, position_embedding_type="none")
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_layer_local_spec(multi_latent_attention=True), VOCAB, 32,
                     position_embedding_type="none")
    ids = torch.randint(0, VOCAB, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(5))
    logits = model(ids, None, None, packed_seq_params=_packed(LENGTHS))
    logits.square().sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    start = 0
    for n in LENGTHS:
        ref = model(ids[:, start:start + n], None, causal_mask(n))
        torch.testing.assert_close(logits[:, start:start + n], ref, rtol=1e-5, atol=1e-5)
        ref.square().sum().backward()
        start += n
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, model.get_parameter(name).grad, rtol=1e-4, atol=1e-5, msg=name)


def test_core_attention_padded_thd_matches_sdpa_per_document(single_rank):  # noqa: F811
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    attn = DotProductAttention(_config(num_query_groups=4), 1, AttnMaskType.causal)
    lengths, padded = (3, 6, 2), (4, 6, 4)
    total, heads, hn = sum(padded) + 2, 4, 8  # two trailing rows beyond the last document
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(total, heads, hn, generator=g) for _ in range(3))
    out = attn(q, k, v, None, packed_seq_params=_packed(lengths, padded))  # megatron-core's squeezed [t, np, hn]
    assert out.shape == (total, heads * hn)
    start = 0
    for n, p in zip(lengths, padded):
        rows = slice(start, start + n)
        ref = F.scaled_dot_product_attention(*(x[rows].transpose(0, 1) for x in (q, k, v)), is_causal=True)
        torch.testing.assert_close(out[rows], ref.transpose(0, 1).reshape(n, -1), rtol=1e-5, atol=1e-6)
        assert out[start + n:start + p].abs().sum() == 0  # padding rows
        start += p
    assert out[start:].abs().sum() == 0


def test_packed_rotary_rows_restart_per_document():
    from megatron.core.transformer.rotary import packed_sequence_rotary_freqs

    freqs = torch.arange(16.0).view(16, 1, 1, 1)  # row i holds position i
    cu = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
    got = packed_sequence_rotary_freqs(freqs, cu).flatten().tolist()
    assert got == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]
    # Context parallelism 2, rank 1: chunks 1 and 2 of each document's 4 chunks.
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    assert packed_sequence_rotary_freqs(freqs, cu, cp_size=2, cp_rank=1).flatten().tolist() == [1, 2, 2, 3, 4, 5]
    # One row per packed token: each document reads from its own offset.
    assert packed_sequence_rotary_freqs(freqs[:12], cu).flatten().tolist() == list(range(12))


def test_rope_utils_apply_rotary_pos_emb_thd_restarts_per_document():
    """megatron-core's ``apply_rotary_pos_emb(t, freqs, config, cu_seqlens)`` on a packed ``[t, np, hn]`` tensor
    against the rotate-half rotation written out with each document's positions 0, 1, ..."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    d, lengths = 8, (3, 5)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    angles = torch.arange(16).float()[:, None] * inv_freq  # [positions, d/2] (not 8 rows: one per packed token)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    t = torch.randn(sum(lengths), 2, d + 4, generator=torch.Generator().manual_seed(4))  # 4 channels pass through
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    out = apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, cp_group=None)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cos, sin = angles[pos].cos()[:, None, :], angles[pos].sin()[:, None, :]
    a, b = t[..., :d // 2], t[..., d // 2:d]
    ref = torch.cat((a * cos - b * sin, a * sin + b * cos, t[..., d:]), dim=-1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    # Without cu_seqlens: [s, b, np, hn], positions 0 .. s-1 (the second document is no longer restarted).
    plain = apply_rotary_pos_emb(t.unsqueeze(1), freqs[:8], config).squeeze(1)
    torch.testing.assert_close(plain[:3], ref[:3])
    assert not torch.allclose(plain[3:], ref[3:])


def test_unsupported_packed_cases_are_refused(single_rank):  # noqa: F811
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    q = torch.randn(8, 4, 8)
    attn = DotProductAttention(_config(), 1, AttnMaskType.causal)
    other = _packed((3, 5))
    other.qkv_format = "bshd"
    with pytest.raises(NotImplementedError, match="'thd' and 'sbhd' formats only"):
        attn(q.unsqueeze(1), q.unsqueeze(1), q.unsqueeze(1), None, packed_seq_params=other)
    other.qkv_format = "sbhd"  # documents of different lengths in one row
    with pytest.raises(NotImplementedError, match="pack them in the 'thd' format"):
        attn(q.unsqueeze(1), q.unsqueeze(1), q.unsqueeze(1), None, packed_seq_params=other)


# Hybrid context parallelism, 2 gloo ranks (DP 1 x CP 2, at most 4 tokens per rank): one packed sample of 4
# documents; the document of 8 tokens runs on both ranks (ring attention over its own group), the others on one.
_HYBRID_DOCS = (8, 3, 4, 2)


def _hybrid_config(**extra):
    return _config(calculate_per_token_loss=True, max_seqlen_per_dp_cp_rank=4, **extra)


def _hybrid_docs():
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (n,), generator=g), torch.randint(0, VOCAB, (n,), generator=g))
            for n in _HYBRID_DOCS]


def _hybrid_train_body():
    from megatron.core import parallel_state as ps
    from megatron.core.datasets.data_schedule import HybridCPDataLoaderWrapper
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.utils import get_batch_on_this_hybrid_cp_rank

    ps.initialize_model_parallel(1, 1, context_parallel_size=2, hybrid_context_parallel=True)
    config = _hybrid_config(context_parallel_size=2, hybrid_context_parallel=True)
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, 32)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    docs = _hybrid_docs()
    bounds = torch.tensor([0, *torch.tensor(_HYBRID_DOCS).cumsum(0).tolist()])
    packed = {"tokens": torch.cat([t for t, _ in docs]), "labels": torch.cat([lab for _, lab in docs]),
              "position_ids": torch.cat([torch.arange(n) for n in _HYBRID_DOCS]), "cu_seqlens": bounds,
              "max_seqlen": torch.tensor([max(_HYBRID_DOCS)])}
    seen = []

    def forward_step_func(data_iterator, model):
        sample = next(data_iterator)
        local_cp_size = int(sample.pop("local_cp_size"))
        batch, params = get_batch_on_this_hybrid_cp_rank(sample, local_cp_size)
        seen.append((params.max_seqlen_q, local_cp_size))
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=params)
        n = torch.tensor(loss.numel())
        return loss.sum(), lambda out: (out, n, {"loss": torch.stack([out.detach(), n.float()])})

    wrapper = HybridCPDataLoaderWrapper(iter([[packed]]), config)
    store = forward_backward_no_pipelining(forward_step_func=forward_step_func, data_iterator=wrapper, model=model,
                                           num_microbatches=1, seq_length=8, micro_batch_size=1)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ps.destroy_model_parallel()
    out = {"initial": initial, "grads": grads, "seen": seen, "loss": sum(float(d["loss"][0]) for d in store),
           "tokens": sum(int(d["loss"][1]) for d in store)}
    out.update(_thd_context_parallel(initial, docs))
    return out


def _thd_context_parallel(initial, docs):
    """The same documents packed in one THD row (each padded to a multiple of 2 x CP), CP 2 with the model's CP
    group (``get_thd_batch_on_this_cp_rank``): this rank's masked loss sum and gradients."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.utils import get_thd_batch_on_this_cp_rank

    ps.initialize_model_parallel(1, 1, context_parallel_size=2)
    config = _config(context_parallel_size=2)
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, 32)
    model.load_state_dict(initial)
    padded = [-(-n // 4) * 4 for n in _HYBRID_DOCS]
    pad = [torch.zeros(p - n, dtype=torch.long) for n, p in zip(_HYBRID_DOCS, padded)]
    batch = {"tokens": torch.cat([x for (t, _), z in zip(docs, pad) for x in (t, z)])[None],
             "labels": torch.cat([x for (_, lab), z in zip(docs, pad) for x in (lab, z)])[None],
             "loss_mask": torch.cat([x for n, z in zip(_HYBRID_DOCS, pad) for x in (torch.ones(n), z.float())])[None],
             "position_ids": torch.cat([torch.arange(p) for p in padded])[None]}
    cu = torch.tensor([0, *torch.tensor(_HYBRID_DOCS).cumsum(0).tolist()], dtype=torch.int32)
    cu_pad = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    batch, params = get_thd_batch_on_this_cp_rank(batch, cu, cu_pad, torch.tensor([max(_HYBRID_DOCS)]))
    loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=params)
    loss = (loss * batch["loss_mask"]).sum()
    loss.backward()
    refused = ""
    attn = DotProductAttention(config, 1, AttnMaskType.padding)  # no causal mask: padding keys would be seen
    q = torch.randn(int(cu_pad[-1]) // 2, 4, 8)
    try:
        attn(q, q, q, None, packed_seq_params=params)
    except NotImplementedError as err:
        refused = str(err)
    ps.destroy_model_parallel()
    return {"thd_loss": float(loss.detach()), "thd_grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "thd_refused": refused}


def test_tiny_gpt_trains_through_hybrid_context_parallel_schedule(single_rank):  # noqa: F811
    """Sum over the 2 ranks of the hybrid schedule's losses and gradients = the documents run alone (1 process);
    the same for the documents packed in one THD row with CP 2 (and a non-causal layer refusing padded documents
    with CP)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from helpers.dist_harness import run_distributed

    results = run_distributed(_hybrid_train_body, world_size=2)
    assert sorted(s for out in results for s in out["seen"]) == [(2, 1), (3, 1), (4, 1), (8, 2), (8, 2)]
    assert sum(out["tokens"] for out in results) == sum(_HYBRID_DOCS)
    ref = GPTModel(_hybrid_config(), get_gpt_layer_local_spec(), VOCAB, 32)
    ref.load_state_dict(results[0]["initial"])
    total = 0.0
    for tokens, labels in _hybrid_docs():
        n = tokens.numel()
        loss = ref(tokens[None], torch.arange(n)[None], causal_mask(n), labels=labels[None]).sum()
        loss.backward()
        total += float(loss.detach())
    assert abs(sum(out["loss"] for out in results) - total) <= 1e-5 * abs(total)
    assert abs(sum(out["thd_loss"] for out in results) - total) <= 1e-5 * abs(total)
    for name, param in ref.named_parameters():
        for key in ("grads", "thd_grads"):
            got = sum(out[key][name] for out in results)
            torch.testing.assert_close(got, param.grad, rtol=1e-4, atol=1e-6, msg=f"{key} {name}")
    assert all("need a causal attention layer" in out["thd_refused"] for out in results)

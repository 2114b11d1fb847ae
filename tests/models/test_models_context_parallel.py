"""Context parallelism equals no context parallelism: the attention itself against softmax attention written from
the math, and GPT models with CP = 2 and 4 (and TP = 2 + SP) against the CP = 1 model: logits, per-token loss,
total loss and every parameter gradient within 1e-5 relative, for --cp-comm-type p2p, all_gather and a2a (a2a where
the heads divide by CP: the attention test's 2 key/value heads at CP = 2, the models at CP = 2 and 4).

One gloo run of 4 ranks does it all (process spawns cost seconds): it also checks the CP process groups of each
layout against the hand-written tables of tests/helpers/cp_helpers.py. Each rank first computes the TP=1, CP=1
reference (the whole sequence, SDPA attention), then, per layout, rebuilds the model from the reference weights
(its TP shard), feeds its CP chunks of the same batch, and compares with the matching rows of the reference.
Gradients are what training reduces: summed over the CP group (the objective is the global token mean, each
rank's loss sums its own tokens), SP-replicated weights summed over TP.
"""
import torch

from helpers.cp_helpers import check_cp_groups
from helpers.dist_harness import run_distributed
from helpers.models_helpers import gpt_inputs, tiny_config
from helpers.numerics import rel_err

SEQ, BATCH, VOCAB = 16, 2, 64
TOL = 1e-5


def zigzag(seq, cp, r):
    """Positions of CP rank r, written from the definition: chunk r, then chunk 2cp-1-r, of 2cp chunks."""
    c = seq // (2 * cp)
    return list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))


# --------------------------------------------------------------------------------------------- attention alone
def reference_attention(q, k, v, causal):
    """softmax(q k^T / sqrt(d) [+ causal -inf]) v in float64, heads repeated for grouped-query attention."""
    s, b, np_, hn = q.shape
    rep = np_ // k.size(2)
    qh = q.permute(1, 2, 0, 3)
    kh = k.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
    vh = v.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
    scores = qh @ kh.transpose(-1, -2) / hn ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vh).permute(2, 0, 1, 3).reshape(s, b, np_ * hn)


def attention_errors(cp):
    """Output and dQ/dK/dV of context_parallel_attention on this rank's chunks vs the reference's rows."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.context_parallel import context_parallel_attention

    r = ps.get_context_parallel_rank()
    idx = torch.tensor(zigzag(SEQ, cp, r))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(SEQ, BATCH, n, 8, generator=g, dtype=torch.float64) for n in (4, 2, 2))
    weight = torch.randn(SEQ, BATCH, 32, generator=g, dtype=torch.float64)
    errs = {}
    for causal in (True, False):
        fq, fk, fv = (t.clone().requires_grad_() for t in (q, k, v))
        ref = reference_attention(fq, fk, fv, causal)
        (ref * weight).sum().backward()
        for comm in ("p2p", "all_gather") + (("a2a",) if k.size(2) % cp == 0 else ()):
            lq, lk, lv = (t[idx].float().requires_grad_() for t in (q, k, v))
            out = context_parallel_attention(lq, lk, lv, group=ps.get_context_parallel_group(),
                                             global_ranks=ps.get_context_parallel_global_ranks(), comm_type=comm,
                                             causal=causal)
            (out.double() * weight[idx]).sum().backward()
            name = f"attention cp={cp} {comm} {'causal' if causal else 'no mask'}"
            errs[name] = max(rel_err(out, ref[idx]), rel_err(lq.grad, fq.grad[idx]), rel_err(lk.grad, fk.grad[idx]),
                             rel_err(lv.grad, fv.grad[idx]))
    return errs


# ------------------------------------------------------------------------------------------------------ models
def build(config, style):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ,
                    position_embedding_type="rope" if style == "llama" else "learned_absolute",
                    share_embeddings_and_output_weights=style != "llama")


def run_model(model, ids, pos, labels, count):
    """logits, per-token loss, loss (sum of this rank's token losses / the global count) after backward."""
    logits = model(ids, pos, None)
    loss = model(ids, pos, None, labels=labels)
    total = loss.sum() / count
    total.backward()
    return logits.detach(), loss.detach(), total.detach()


def model_errors(style, tp, cp, sp, comm, reference):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.conversion.tp import split_tensor_parallel
    from megatron.core.utils import get_batch_on_this_cp_rank

    check_cp_groups(tp, cp)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    config = tiny_config(tp=tp, sp=sp, style=style, context_parallel_size=cp, cp_comm_type=comm,
                         max_position_embeddings=SEQ)
    model = build(config, style)
    tp_rank, r = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
    model.load_state_dict(split_tensor_parallel(reference["weights"], tp, config.gated_linear_unit)[tp_rank])
    ids, pos, _, labels = gpt_inputs(batch=BATCH, seq=SEQ, vocab=VOCAB - 4)
    batch = get_batch_on_this_cp_rank({"tokens": ids, "position_ids": pos, "labels": labels, "attention_mask": None})
    idx = zigzag(SEQ, cp, r)
    assert torch.equal(batch["tokens"], ids[:, idx]) and torch.equal(batch["labels"], labels[:, idx])
    assert torch.equal(batch["position_ids"], pos[:, idx]) and batch["attention_mask"] is None
    logits, loss, total = run_model(model, batch["tokens"], batch["position_ids"], batch["labels"], BATCH * SEQ)
    torch.distributed.all_reduce(total, group=ps.get_context_parallel_group())
    for p in model.parameters():
        torch.distributed.all_reduce(p.grad, group=ps.get_context_parallel_group())
        if getattr(p, "sequence_parallel", False):
            torch.distributed.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    grad_shard = split_tensor_parallel(reference["grads"], tp, config.gated_linear_unit)[tp_rank]
    grads = {k: p.grad for k, p in model.named_parameters()}
    assert set(grads) == set(grad_shard), set(grads) ^ set(grad_shard)
    errs = {"logits": rel_err(logits, torch.chunk(reference["logits"][:, idx], tp, dim=-1)[tp_rank]),
            "loss": rel_err(loss, reference["loss"][:, idx]), "total": rel_err(total, reference["total"]),
            "grads": max(rel_err(grads[k], grad_shard[k]) for k in grads)}
    ps.destroy_model_parallel()
    return errs


def cp_body(layouts):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    out = {}
    check_cp_groups(1, 4)
    out.update(attention_errors(4))
    ps.destroy_model_parallel()
    check_cp_groups(1, 2)
    out.update(attention_errors(2))
    ps.destroy_model_parallel()
    for style in ("llama", "gpt2"):
        ps.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        ref = build(tiny_config(style=style, max_position_embeddings=SEQ), style)
        ids, pos, _, labels = gpt_inputs(batch=BATCH, seq=SEQ, vocab=VOCAB - 4)
        logits, loss, total = run_model(ref, ids, pos, labels, BATCH * SEQ)
        reference = {"weights": ref.state_dict(), "grads": {k: p.grad for k, p in ref.named_parameters()},
                     "logits": logits, "loss": loss, "total": total}
        ps.destroy_model_parallel()
        for lay_style, tp, cp, sp, comm in layouts:
            if lay_style == style:
                out[f"{style} TP={tp} CP={cp}{' SP' if sp else ''} {comm}"] = model_errors(style, tp, cp, sp, comm,
                                                                                           reference)
    return out


LAYOUTS = [  # (style, TP, CP, SP, --cp-comm-type): llama = RoPE, GQA, swiglu, RMSNorm; gpt2 = learned positions
    ("llama", 1, 4, False, "p2p"),
    ("llama", 1, 4, False, "all_gather"),
    ("llama", 2, 2, True, "p2p"),
    ("llama", 2, 2, True, "all_gather"),
    ("llama", 1, 2, False, "p2p"),
    ("gpt2", 1, 2, False, "all_gather"),
    ("gpt2", 2, 2, True, "p2p"),
    ("llama", 1, 4, False, "a2a"),
    ("llama", 2, 2, True, "a2a"),
    ("gpt2", 1, 2, False, "a2a"),
]


def test_context_parallel_equals_cp1():
    outs = run_distributed(cp_body, 4, LAYOUTS, timeout=240)
    for rank, out in enumerate(outs):
        assert len(out) == 10 + len(LAYOUTS)  # attention: CP 4 x (p2p, all_gather), CP 2 x (+ a2a), x 2 masks
        for name, err in out.items():
            worst = max(err.values()) if isinstance(err, dict) else err
            assert worst < TOL, (rank, name, err)
    print({name: (max(e.values()) if isinstance(e, dict) else e) for name, e in outs[0].items()})

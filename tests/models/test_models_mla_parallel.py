"""A multi-latent-attention GPT split over tensor, sequence and context parallel ranks equals the unsharded model.

One gloo run of 4 ranks. Each rank first computes the TP = CP = 1 reference (query compression, latent norms, YaRN,
a dense and an MLA layer of each kind), then per layout rebuilds the model from the reference weights (its TP shard:
heads split as Megatron splits them, down projections duplicated), feeds its CP chunks of the same batch and
compares logits, per-token loss, total loss and every parameter gradient within 1e-5 relative. Gradients are what
training reduces: summed over the CP group, sequence-parallel replicated weights (norms, down projections) summed over
TP. Layouts: TP 2 (with and without SP), TP 2 + SP x CP 2 (p2p), CP 2 all_gather and a2a, CP 4 p2p, and TP 2 without
query compression; the last one runs with selective recompute of ``mla_up_proj``, ``core_attn`` and ``layernorm``.
DeepSeek sparse attention (the indexer's top-5 of 16 keys, its KL loss training the indexer) at TP 2 + SP: the
indexer's replicated weights get the unsharded gradient on every rank without a TP sum (within 1e-4: the indexer's
gradient is a difference of near-equal fp32 probabilities).

Multi-token prediction (2 depths, a loss mask with holes): at TP 2 + SP every gradient (the MTP block's included) and
each depth's logged loss equal the unsharded model's; at CP 2 each depth's hidden states equal the reference's rows
(the token shift is global across the zig-zag chunks); gradients are not compared there (Megatron's MTP loss with CP is
each rank's own token mean, so its gradient is not the CP = 1 one).
"""
import torch

from helpers.dist_harness import run_distributed
from helpers.models_helpers import gpt_inputs
from helpers.numerics import rel_err

SEQ, BATCH, VOCAB = 16, 2, 64
TOL = 1e-5


def mla_config(tp=1, sp=False, cp=1, comm=None, **extra):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
              qk_pos_emb_head_dim=4, v_head_dim=6, rotary_scaling_factor=4.0, original_max_position_embeddings=8,
              mscale=1.0, mscale_all_dim=0.5, qk_layernorm=True, normalization="RMSNorm", layernorm_epsilon=1e-6,
              add_bias_linear=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
              ffn_hidden_size=48, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
              tensor_model_parallel_size=tp, sequence_parallel=sp, context_parallel_size=cp, cp_comm_type=comm,
              bias_activation_fusion=False, position_embedding_type="rope")
    kw.update(extra)
    return MLATransformerConfig(**kw)


def build(config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if config.experimental_attention_variant == "dsa":
        spec = get_transformer_block_with_experimental_attention_variant_spec(config)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=True, multi_latent_attention=True)
    return GPTModel(config, spec, VOCAB, SEQ, position_embedding_type="rope")


def run_model(model, ids, pos, labels, count, loss_mask):
    """logits, per-token loss, loss; with MTP also each depth's hidden states and logged loss."""
    logits = model(ids, pos, None)
    captured = {}
    if getattr(model, "mtp", None) is not None:
        def keep(module, inputs, outputs):  # (returns None: the outputs stay the module's)
            captured["mtp"] = [h.detach() for h in outputs]

        model.mtp.register_forward_hook(keep)
    loss = model(ids, pos, None, labels=labels, loss_mask=loss_mask)
    total = (loss * loss_mask).sum() / count
    total.backward()
    if captured:
        captured["tracked"] = torch.stack([model.mtp.tracked_losses[k] for k in sorted(model.mtp.tracked_losses)])
    return logits.detach(), loss.detach(), total.detach(), captured


def batch_mask():
    mask = torch.ones(BATCH, SEQ)
    mask[0, 3] = mask[1, 10:] = 0  # padding and a hole: the rolled masks differ per depth
    return mask


def reference(extra):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    torch.manual_seed(3)
    model = build(mla_config(**extra))
    ids, pos, _, labels = gpt_inputs(batch=BATCH, seq=SEQ, vocab=VOCAB - 4)
    logits, loss, total, mtp = run_model(model, ids, pos, labels, BATCH * SEQ, batch_mask())
    ps.destroy_model_parallel()
    return {"weights": model.state_dict(), "grads": {k: p.grad for k, p in model.named_parameters()},
            "logits": logits, "loss": loss, "total": total, "mtp": mtp}


def layout_errors(tp, sp, cp, comm, ref, extra):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.conversion.tp import split_tensor_parallel
    from megatron.core.utils import context_parallel_chunk_indices, get_batch_on_this_cp_rank

    ps.initialize_model_parallel(tp, 1, context_parallel_size=cp)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    config = mla_config(tp, sp, cp, comm, **extra)
    model = build(config)
    tp_rank = ps.get_tensor_model_parallel_rank()
    model.load_state_dict(split_tensor_parallel(ref["weights"], tp, True)[tp_rank])
    ids, pos, _, labels = gpt_inputs(batch=BATCH, seq=SEQ, vocab=VOCAB - 4)
    batch = get_batch_on_this_cp_rank({"tokens": ids, "position_ids": pos, "labels": labels, "attention_mask": None,
                                       "loss_mask": batch_mask()})
    idx = context_parallel_chunk_indices(SEQ, cp, ps.get_context_parallel_rank()) if cp > 1 else torch.arange(SEQ)
    logits, loss, total, mtp = run_model(model, batch["tokens"], batch["position_ids"], batch["labels"], BATCH * SEQ,
                                         batch["loss_mask"])
    torch.distributed.all_reduce(total, group=ps.get_context_parallel_group())
    for p in model.parameters():
        torch.distributed.all_reduce(p.grad, group=ps.get_context_parallel_group())
        if getattr(p, "sequence_parallel", False):
            torch.distributed.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    grad_shard = split_tensor_parallel(ref["grads"], tp, True)[tp_rank]
    grads = {k: p.grad for k, p in model.named_parameters()}
    assert set(grads) == set(grad_shard), set(grads) ^ set(grad_shard)
    errs = {"logits": rel_err(logits, torch.chunk(ref["logits"][:, idx], tp, dim=-1)[tp_rank]),
            "loss": rel_err(loss, ref["loss"][:, idx])}
    if mtp:  # each depth's hidden states at this rank's positions (SP: its sequence shard)
        rows = [h[idx] for h in ref["mtp"]["mtp"]]
        if sp:
            rows = [torch.chunk(h, tp, dim=0)[tp_rank] for h in rows]
        errs["mtp hidden"] = max(rel_err(a, b) for a, b in zip(mtp["mtp"], rows))
    if cp == 1:  # (with CP, Megatron's MTP loss is each rank's own token mean, averaged: not the CP=1 loss)
        errs.update(total=rel_err(total, ref["total"]), grads=max(rel_err(grads[k], grad_shard[k]) for k in grads))
        if mtp:
            errs["mtp logged loss"] = rel_err(mtp["tracked"], ref["mtp"]["tracked"])
    elif not mtp:
        errs["grads"] = max(rel_err(grads[k], grad_shard[k]) for k in grads)
    ps.destroy_model_parallel()
    return errs


LAYOUTS = [  # (TP, SP, CP, --cp-comm-type, reference variant)
    (2, True, 1, None, "q_lora"),
    (2, False, 1, None, "q_lora"),
    (2, True, 2, "p2p", "q_lora"),
    (1, False, 2, "all_gather", "q_lora"),
    (1, False, 2, "a2a", "q_lora"),
    (1, False, 4, "p2p", "q_lora"),
    (2, True, 1, None, "no_q_lora_recompute"),
    (2, True, 1, None, "mtp"),
    (2, False, 2, "p2p", "mtp"),
    (2, True, 1, None, "dsa"),
]
VARIANTS = {"q_lora": {}, "no_q_lora_recompute": dict(q_lora_rank=None, recompute_granularity="selective",
                                                      recompute_modules=["mla_up_proj", "core_attn", "layernorm"]),
            "mtp": dict(mtp_num_layers=2, mtp_loss_scaling_factor=0.3),
            "dsa": dict(experimental_attention_variant="dsa", dsa_indexer_n_heads=2, dsa_indexer_head_dim=8,
                        dsa_indexer_topk=5, dsa_indexer_loss_coeff=0.5)}


def body():
    out = {}
    for variant, extra in VARIANTS.items():
        ref = reference(extra)
        for tp, sp, cp, comm, v in LAYOUTS:
            if v == variant:
                out[f"{variant} TP={tp}{' SP' if sp else ''} CP={cp} {comm or ''}"] = layout_errors(tp, sp, cp, comm,
                                                                                                   ref, extra)
    return out


def test_mla_parallel_layouts_equal_the_unsharded_model():
    outs = run_distributed(body, 4, timeout=240)
    for rank, out in enumerate(outs):
        assert len(out) == len(LAYOUTS)
        for name, err in out.items():
            # the indexer's gradient is coeff * (softmax(I) - A): a difference of near-equal fp32 terms (2.6e-5)
            tol = 1e-4 if name.startswith("dsa") else TOL
            assert max(err.values()) < tol, (rank, name, err)
    print({name: max(e.values()) for name, e in outs[0].items()})

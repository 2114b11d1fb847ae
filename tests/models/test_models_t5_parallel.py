"""T5 under tensor parallelism (TP=2, with and without sequence parallelism, with full recompute) equals TP=1:
logits, per-token loss and every parameter's gradient, for the legacy and the megatron-core T5Model.

Every rank builds the TP=1 model, runs a fixed batch, then rebuilds it with TP=2, loads its shard of the TP=1
weights (megatron.core.models.conversion.tp) and compares its logits and gradient shards with the TP=1 slices.
"""
import torch

from helpers.dist_harness import run_distributed
from helpers.models_helpers import tiny_config
from helpers.numerics import rel_err
from helpers.t5_helpers import VOCAB, randomize_, t5_inputs, t5_masks

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.T5 import T5Model as CoreT5Model
from megatron.core.models.T5.t5_spec import (get_t5_decoder_with_local_block_spec,
                                             get_t5_encoder_with_local_block_spec)
from megatron.core.models.conversion.tp import split_tensor_parallel
from megatron.model import T5Model


def _build(kind, config):
    if kind == "core":
        return CoreT5Model(config, config, get_t5_encoder_with_local_block_spec(2),
                           get_t5_decoder_with_local_block_spec(2), vocab_size=VOCAB, max_sequence_length=16,
                           share_embeddings_and_output_weights=True)
    return T5Model(config)


def _run(kind, model):
    enc, dec, labels, loss_mask = t5_inputs(se=8, sd=6)
    masks = t5_masks(enc, dec)
    if kind == "core":
        masks = [m.unsqueeze(1) for m in masks]
    logits = model(enc, dec, *masks)
    loss = model(enc, dec, *masks, lm_labels=labels)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    total = (loss * loss_mask).sum() / loss_mask.sum() + 1e-3 * logits.square().sum() / (logits.numel() * tp)
    total.backward()
    return logits.detach(), loss.detach()


CASES = [  # (name, kind, config overrides)
    ("legacy T5Model", "legacy", {}),
    ("megatron-core T5Model", "core", {}),
    ("legacy T5Model, full recompute", "legacy", dict(recompute_granularity="full", recompute_method="uniform",
                                                       recompute_num_layers=1)),
    ("megatron-core T5Model, selective recompute", "core", dict(recompute_granularity="selective")),
]


def tp_body(tp):
    rank = torch.distributed.get_rank()
    errors = {}
    for name, kind, overrides in CASES:
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        ref = _build(kind, tiny_config(init_method_std=0.2))
        randomize_(ref)
        ref_logits, ref_loss = _run(kind, ref)
        full_sd = ref.state_dict()
        full_grads = {k: p.grad for k, p in ref.named_parameters()}
        parallel_state.destroy_model_parallel()
        weight_shard = split_tensor_parallel(full_sd, tp)[rank]
        grad_shard = split_tensor_parallel(full_grads, tp)[rank]
        for sp in ((False, True) if not overrides else (True,)):
            parallel_state.initialize_model_parallel(tp, 1)
            tensor_parallel.model_parallel_cuda_manual_seed(7)
            model = _build(kind, tiny_config(tp=tp, sp=sp, **overrides)).train()
            model.load_state_dict(weight_shard)
            logits, loss = _run(kind, model)
            if sp:  # what finalize_model_grads does: sum partial grads of replicated params over TP
                for p in model.parameters():
                    if getattr(p, "sequence_parallel", False) and p.grad is not None:
                        torch.distributed.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
            errs = {"logits": rel_err(logits, torch.chunk(ref_logits, tp, dim=-1)[rank]), "loss": rel_err(loss, ref_loss)}
            grads = {k: p.grad for k, p in model.named_parameters()}
            assert set(grads) == set(grad_shard), set(grads) ^ set(grad_shard)
            errs["grads"] = max(rel_err(grads[k], grad_shard[k]) for k in grads)
            errors[f"{name}, TP={tp}{', SP' if sp else ''}"] = errs
            parallel_state.destroy_model_parallel()
    return errors


def test_t5_tensor_and_sequence_parallel_equal_tp1():
    results = run_distributed(tp_body, 2, 2, timeout=150)
    worst = {}
    for rank_errors in results:
        for case, errs in rank_errors.items():
            for what, err in errs.items():
                worst[(case, what)] = max(worst.get((case, what), 0.0), err)
    for (case, what), err in sorted(worst.items()):
        print(f"{case}: {what} max relative error {err:.2e}")
    bad = {k: v for k, v in worst.items() if v > 1e-5}
    assert not bad, bad

"""TP in {2, 4}, with and without sequence parallelism, equals TP=1: logits, loss and every parameter's gradient.

Each rank first builds the TP=1 model (data-parallel layout), runs it, then rebuilds the model with TP=world size,
loads its shard of the TP=1 weights (megatron.core.models.conversion.tp), runs the same batch and compares its
logits shard and gradient shards with the corresponding slices of the TP=1 results.
"""
import pytest
import torch
import torch.nn.functional as F

from helpers.numerics import rel_err
from helpers.dist_harness import run_distributed
from helpers.models_helpers import bert_inputs, gpt_inputs, tiny_config

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.conversion import keys
from megatron.core.models.conversion.tp import split_tensor_parallel
from megatron.core.models.gpt import GPTModel as CoreGPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.model import BertModel, GPTModel


def _build(kind, config):
    if kind == "bert":
        return BertModel(config, num_tokentypes=2)
    if kind == "mcore_gpt":
        return CoreGPTModel(config, get_gpt_layer_local_spec(), 64, 16, share_embeddings_and_output_weights=True)
    return GPTModel(config)


def _logit_term(logits):
    # A term on the logits themselves (not only through the loss); the mean is over the FULL vocabulary.
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return 1e-3 * logits.square().sum() / (logits.numel() * tp)


def _run(kind, model):
    """Forward + backward on a fixed batch; returns (logits [.., V/tp], per-token loss)."""
    if kind == "bert":
        ids, padding, types, labels = bert_inputs()
        logits, binary = model(ids, padding, tokentype_ids=types)
        loss, binary = model(ids, padding, tokentype_ids=types, lm_labels=labels)
        total = loss.mean() + F.cross_entropy(binary, torch.tensor([0, 1])) + _logit_term(logits)
    else:
        ids, pos, mask, labels = gpt_inputs()
        logits = model(ids, pos, mask)
        loss = model(ids, pos, mask, labels=labels)
        total = loss.mean() + _logit_term(logits)
    total.backward()
    return logits.detach(), loss.detach()


def _sync_sequence_parallel_grads(model):
    """What the trainer does with SP: sum the partial grads of replicated params over the TP group."""
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            torch.distributed.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())


CASES = [  # (name, model kind, config style)
    ("gpt2-style GPTModel", "gpt", "gpt2"),
    ("llama-style GPTModel (GQA, RoPE, swiglu, RMSNorm, untied)", "gpt", "llama"),
    ("megatron-core GPTModel", "mcore_gpt", "gpt2"),
    ("BertModel", "bert", "gpt2"),
]


def tp_body(tp):
    rank = torch.distributed.get_rank()
    errors = {}
    for name, kind, style in CASES:
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        ref_config = tiny_config(style=style)
        ref = _build(kind, ref_config)
        ref_logits, ref_loss = _run(kind, ref)
        full_sd = ref.state_dict()
        full_grads = {k: p.grad for k, p in ref.named_parameters()}
        parallel_state.destroy_model_parallel()

        gated = ref_config.gated_linear_unit
        weight_shard = split_tensor_parallel(full_sd, tp, gated)[rank]
        grad_shard = split_tensor_parallel(full_grads, tp, gated)[rank]
        for sp in (False, True):
            parallel_state.initialize_model_parallel(tp, 1)
            tensor_parallel.model_parallel_cuda_manual_seed(7)
            model = _build(kind, tiny_config(tp=tp, sp=sp, style=style))
            model.load_state_dict(weight_shard)
            logits, loss = _run(kind, model)
            if sp:
                _sync_sequence_parallel_grads(model)
            errs = {"logits": rel_err(logits, torch.chunk(ref_logits, tp, dim=-1)[rank]), "loss": rel_err(loss, ref_loss)}
            grads = {k: p.grad for k, p in model.named_parameters()}
            assert set(grads) == set(grad_shard), (set(grads) ^ set(grad_shard))
            errs["grads"] = max(rel_err(grads[k], grad_shard[k]) for k in grads)
            errors[f"{name}, TP={tp}{', SP' if sp else ''}"] = errs
            parallel_state.destroy_model_parallel()
    return errors


def _check(results):
    worst = {}
    for rank_errors in results:
        for case, errs in rank_errors.items():
            for what, err in errs.items():
                worst[(case, what)] = max(worst.get((case, what), 0.0), err)
    for (case, what), err in sorted(worst.items()):
        print(f"{case}: {what} max relative error {err:.2e}")
    bad = {k: v for k, v in worst.items() if v > 1e-5}
    assert not bad, bad


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_and_sequence_parallel_equal_tp1(tp):
    _check(run_distributed(tp_body, tp, tp, timeout=150))


def test_key_mapping_round_trip():
    """Legacy <-> megatron-core names are inverse to each other on every GPT and BERT key kind."""
    for model, names in (("gpt", ["language_model.embedding.word_embeddings.weight",
                                  "language_model.encoder.layers.3.self_attention.query_key_value.bias",
                                  "language_model.encoder.layers.0.mlp.dense_4h_to_h.weight",
                                  "language_model.encoder.layers.1.post_attention_layernorm.weight",
                                  "language_model.encoder.final_layernorm.weight", "language_model.output_layer.weight"]),
                         ("bert", ["language_model.pooler.dense.weight", "lm_head.bias", "lm_head.layernorm.weight",
                                   "lm_head.dense.weight", "binary_head.bias", "word_embeddings.weight",
                                   "language_model.encoder.layers.0.self_attention.dense.weight"])):
        for name in names:
            assert keys.mcore_to_legacy_key(keys.legacy_to_mcore_key(name, model), model) == name
    assert keys.legacy_to_mcore_key("language_model.encoder.layers.2.self_attention.dense.weight") == \
        "decoder.layers.2.self_attention.linear_proj.weight"
    assert keys.legacy_to_mcore_key("language_model.encoder.layers.2.post_attention_layernorm.bias", "bert") == \
        "encoder.layers.2.pre_mlp_layernorm.bias"

"""Activation recompute (full uniform/block, selective, distributed saved activations, with SP) gives the same
gradients as no recompute, with attention and hidden dropout active (TP=2, so the RNG tracker is exercised)."""
import torch

from helpers.numerics import rel_err
from helpers.dist_harness import run_distributed
from helpers.models_helpers import gpt_inputs, tiny_config

from megatron.core import parallel_state, tensor_parallel
from megatron.model import GPTModel

RECOMPUTE_MODES = {  # name -> (config, expected number of checkpointed calls per forward of 4 layers)
    "none": ({}, 0),
    "full uniform, 2 layers per chunk": (dict(recompute_granularity="full", recompute_method="uniform",
                                             recompute_num_layers=2), 2),
    "full uniform, 1 layer, distributed saved activations": (dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        distribute_saved_activations=True), 4),
    "full block, first 3 layers": (dict(recompute_granularity="full", recompute_method="block",
                                        recompute_num_layers=3), 3),
    "selective (core attention)": (dict(recompute_granularity="selective"), 4),
}
_CALLS = []


def _counting_checkpoint(function, distribute_saved_activations, *args):
    _CALLS.append(distribute_saved_activations)
    return _ORIGINAL_CHECKPOINT(function, distribute_saved_activations, *args)


_ORIGINAL_CHECKPOINT = tensor_parallel.checkpoint


def _grads(config, weights):
    model = GPTModel(config)
    model.load_state_dict(weights)
    model.train()
    ids, pos, mask, labels = gpt_inputs(seq=8)
    tensor_parallel.model_parallel_cuda_manual_seed(99)  # same dropout masks in every run
    loss = model(ids, pos, mask, labels=labels)
    loss.mean().backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def recompute_body():
    tensor_parallel.checkpoint = _counting_checkpoint  # count the recomputed regions (this process only)
    parallel_state.initialize_model_parallel(2, 1)
    dropout = dict(hidden_dropout=0.2, attention_dropout=0.2, num_layers=4)
    # One set of weights for every run: build a TP=2 model once and reuse this rank's shard. Seeding first makes
    # the replicated parameters identical on both TP ranks (as Megatron's _set_random_seed does).
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    weights = GPTModel(tiny_config(tp=2, **dropout)).state_dict()
    errors = {}
    for sp in (False, True):
        base_loss, base = _grads(tiny_config(tp=2, sp=sp, **dropout), weights)
        no_dropout_loss, _ = _grads(tiny_config(tp=2, sp=sp, num_layers=4), weights)
        assert rel_err(base_loss, no_dropout_loss) > 1e-3, "dropout had no effect: the test would prove nothing"
        for name, (mode, expected_calls) in RECOMPUTE_MODES.items():
            if name == "none" or (sp and mode.get("distribute_saved_activations")):
                continue
            _CALLS.clear()
            loss, grads = _grads(tiny_config(tp=2, sp=sp, **dropout, **mode), weights)
            assert len(_CALLS) == expected_calls, (name, _CALLS)
            assert all(_CALLS) == bool(mode.get("distribute_saved_activations")), (name, _CALLS)
            errors[f"{name}{' + SP' if sp else ''}"] = max(
                [rel_err(loss, base_loss)] + [rel_err(grads[k], base[k]) for k in base])
    parallel_state.destroy_model_parallel()
    return errors


def test_recompute_equals_no_recompute():
    results = run_distributed(recompute_body, 2, timeout=120)
    worst = {}
    for errors in results:
        for name, err in errors.items():
            worst[name] = max(worst.get(name, 0.0), err)
    for name, err in worst.items():
        print(f"recompute {name}: max relative error of loss and gradients vs no recompute {err:.2e}")
    assert all(err <= 1e-6 for err in worst.values()), worst

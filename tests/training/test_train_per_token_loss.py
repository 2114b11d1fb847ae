"""--calculate-per-token-loss and the (loss_sum, num_tokens, report) loss contract, against hand computations.

Two gloo ranks (DP = 2), three micro-batches each, every micro-batch with a different number of unmasked
"tokens" (rows of a toy regression batch; the per-token loss is the row's squared error). The reference is
one process over the concatenated data:

* flag on: the loss is sum(l * mask) / sum(mask) over the *global* batch and every main_grad must equal the
  autograd gradient of that token mean (finalize_model_grads sums the token count over DP and divides);
* flag off (3-tuple): the mean over (DP ranks x micro-batches) of each micro-batch's token mean;
* the 2023 contract (loss, {'lm loss': value}) still runs and gives the flag-off gradient.

The reported value (train_step's reduction of the [sum, count] reports) must be the global token mean.
"""
import copy
from functools import partial

import torch

from helpers.dist_harness import run_distributed
from helpers.numerics import rel_err
from helpers.optim_helpers import IN, OUT, ToyModel, init_parallel, main_grads, make_config

DP, MICRO, ROWS = 2, 3, 4
# Unmasked rows of every (rank, micro-batch): unequal on purpose (one micro-batch has a single token).
MASK_COUNTS = [[4, 1, 3], [2, 4, 3]]


class _StageModel(ToyModel):
    """The toy model as a (single) pipeline stage: the schedules hand it its input tensor."""

    def set_input_tensor(self, input_tensor):
        pass


def _data():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(DP, MICRO, ROWS, IN, generator=g)
    y = torch.randn(DP, MICRO, ROWS, OUT, generator=g)
    mask = torch.zeros(DP, MICRO, ROWS)
    for r in range(DP):
        for m in range(MICRO):
            mask[r, m, :MASK_COUNTS[r][m]] = 1.0
    return x, y, mask


def _per_token(model, x, y):
    return ((model(x).float() - y) ** 2).sum(dim=-1)


def _loss_3tuple(mask, y, output):
    losses = ((output.float() - y) ** 2).sum(dim=-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1).float()])}


def _loss_2tuple(mask, y, output):
    losses = ((output.float() - y) ** 2).sum(dim=-1)
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach()}


def _forward_step(loss_fn, data_iterator, model):
    x, y, mask = next(data_iterator)
    return model(x), partial(loss_fn, mask, y)


def per_token_body():
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.training.training import _sum_reported_losses

    init_parallel()
    r = parallel_state.get_data_parallel_rank()
    x, y, mask = _data()
    base = _StageModel()

    # Hand references over the concatenated data of both ranks.
    ref = copy.deepcopy(base)
    token_mean = (_per_token(ref, x, y) * mask).sum() / mask.sum()
    token_mean.backward()
    ref_per_token = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref_value = float(token_mean.detach())
    ref = copy.deepcopy(base)
    micro_means = (_per_token(ref, x, y) * mask).sum(dim=-1) / mask.sum(dim=-1)  # [DP, MICRO]
    micro_means.mean().backward()
    ref_micro_mean = {n: p.grad.clone() for n, p in ref.named_parameters()}

    out = {}
    for name, per_token, loss_fn in [("per_token", True, _loss_3tuple), ("token_mean_per_micro", False, _loss_3tuple),
                                     ("legacy_2tuple", False, _loss_2tuple)]:
        config = make_config(calculate_per_token_loss=per_token)
        config.finalize_model_grads_func = finalize_model_grads
        model = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=True,
                                                                              bucket_size=100), copy.deepcopy(base))
        model.zero_grad_buffer()
        batches = iter([(x[r, m], y[r, m], mask[r, m]) for m in range(MICRO)])
        reports = forward_backward_no_pipelining(
            forward_step_func=partial(_forward_step, loss_fn), data_iterator=batches, model=model,
            num_microbatches=MICRO, seq_length=1, micro_batch_size=ROWS)
        expected = ref_per_token if per_token else ref_micro_mean
        out[name + "_grad_err"] = max(rel_err(g, expected[n]) for n, g in main_grads(model).items())
        numerator, denominator = _sum_reported_losses(reports)["lm loss"]
        out[name + "_reported"] = float(numerator / denominator)
    out["ref_value"] = ref_value
    out["ref_micro_mean_value"] = float(micro_means.mean().detach())
    return out


def test_per_token_loss_matches_global_token_mean():
    outs = run_distributed(per_token_body, DP, timeout=120)
    for out in outs:
        assert out["per_token_grad_err"] < 1e-6, out
        assert out["token_mean_per_micro_grad_err"] < 1e-6, out
        assert out["legacy_2tuple_grad_err"] < 1e-6, out
        # The two objectives really differ on this data (so the test can tell them apart).
        assert abs(out["ref_value"] - out["ref_micro_mean_value"]) > 1e-3 * abs(out["ref_value"])
        # [sum, count] reports summed over micro-batches and DP: the global token mean, flag on or off.
        assert abs(out["per_token_reported"] - out["ref_value"]) < 1e-6 * abs(out["ref_value"])
        assert abs(out["token_mean_per_micro_reported"] - out["ref_value"]) < 1e-6 * abs(out["ref_value"])
        # 2023 reports (one value per micro-batch) are averaged over micro-batches only.
        assert out["legacy_2tuple_reported"] > 0


# --num-layers stays GPT_ARGS's 8: run_pretrain's deterministic init computes the pipeline layer offsets from it.
PIPE_BASE = ["--mock-data", "--use-mcore-models", "--train-iters", "6", "--log-interval", "1",
             "--eval-interval", "1000", "--eval-iters", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size",
             "255", "--seq-length", "128", "--max-position-embeddings", "128", "--eod-mask-loss",
             "--calculate-per-token-loss", "--untie-embeddings-and-output-weights"]


def pipeline_body(runs):
    from helpers.train_helpers import run_pretrain

    return {name: [r["loss"].get("lm loss") for r in run_pretrain("pretrain_gpt", PIPE_BASE + extra)]
            for name, extra in runs}


def test_per_token_loss_through_1f1b_matches_data_parallel():
    """pretrain_gpt with --calculate-per-token-loss (EOD tokens masked, so micro-batches hold unequal token
    counts): the 1F1B pipeline (PP = 2, the token count broadcast from the last stage) gives the same losses as
    DP = 2 (the count summed over DP) — both the token mean over the global batch."""
    runs = [("dp2", []), ("pp2", ["--pipeline-model-parallel-size", "2"])]
    out = run_distributed(pipeline_body, 2, runs, timeout=300)[-1]
    assert len(out["dp2"]) == 6 and all(x == x for x in out["dp2"])
    for a, b in zip(out["pp2"], out["dp2"]):
        assert abs(a - b) <= 1e-5 * abs(b), (out["pp2"], out["dp2"])

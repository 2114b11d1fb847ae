"""Today's training flags: types, defaults and validation (one clear ConfigurationError line each), and the
--step-batch-size-schedule calculator against tables worked out by hand."""
import re

import pytest

from helpers.dist_harness import run_distributed
from helpers.args_test_helpers import BASE_ARGV, clean_env, parse, validated  # noqa: F401  (fixture)
from megatron.training.arguments import parse_args, validate_args
from megatron.training.errors import ConfigurationError
from megatron.training.microbatches import build_num_microbatches_calculator

GPT3_SCHEDULE = "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"


def test_defaults_and_types(clean_env):
    args = parse()
    assert args.calculate_per_token_loss is False
    assert args.decoupled_lr is None and args.decoupled_min_lr is None
    assert args.grad_reduce_in_bf16 is False
    assert args.overlap_param_gather is False and args.overlap_param_gather_with_optimizer_step is False
    assert args.align_param_gather is True
    assert args.manual_gc is False and args.manual_gc_interval == 0 and args.manual_gc_eval is True
    assert args.empty_unused_memory_level == 0
    assert args.profile is False and args.use_pytorch_profiler is False
    assert (args.profile_step_start, args.profile_step_end, args.profile_ranks) == (10, 12, [])
    assert args.step_batch_size_schedule is None and args.rampup_batch_size is None
    args = parse("--decoupled-lr 1e-3 --decoupled-min-lr 1e-5 --manual-gc-interval 3 --no-manual-gc-eval "
                 "--no-align-param-gather --profile-ranks 0 1")
    assert (args.decoupled_lr, args.decoupled_min_lr, args.manual_gc_interval) == (1e-3, 1e-5, 3)
    assert args.manual_gc_eval is False and args.align_param_gather is False and args.profile_ranks == [0, 1]
    with pytest.raises(SystemExit):
        parse("--empty-unused-memory-level 3")


@pytest.mark.parametrize("extra, words", [
    ("--overlap-param-gather --overlap-grad-reduce", "--use-distributed-optimizer"),
    ("--overlap-param-gather --use-distributed-optimizer", "--overlap-grad-reduce"),
    ("--use-mcore-models --overlap-param-gather-with-optimizer-step --use-distributed-optimizer "
     "--overlap-grad-reduce --overlap-param-gather", "interleaved"),
    ("--overlap-param-gather-with-optimizer-step --use-distributed-optimizer", "--overlap-param-gather"),
    ("--manual-gc --manual-gc-interval -1", "--manual-gc-interval"),
    ("--profile --use-pytorch-profiler", "--tensorboard-dir"),
    ("--profile --profile-step-start 5 --profile-step-end 5", "--profile-step-end"),
    ("--calculate-per-token-loss --DDP-impl torch", "--DDP-impl local"),
    ("--use-mcore-models --decoupled-lr 1e-4 --decoupled-min-lr 1e-3", "--decoupled-lr"),
    ("LEGACY --decoupled-lr 1e-4", "need the megatron-core models"),
    ("LEGACY --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather",
     "--overlap-param-gather is not supported with legacy models"),
])
def test_validation_errors(clean_env, extra, words):
    legacy = "--use-legacy-models --ckpt-format torch"  # legacy models need the torch format, as in Megatron
    with pytest.raises(ConfigurationError) as e:
        validated(extra.replace("LEGACY", legacy))
    message = str(e.value)
    assert words in message and "\n" not in message


def test_valid_combinations(clean_env):
    args = validated("--use-mcore-models --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
                     "--decoupled-lr 1e-3 --calculate-per-token-loss --manual-gc")
    assert args.overlap_param_gather and args.align_param_gather is False  # no VPP: alignment off
    # --grad-reduce-in-bf16 keeps bf16 gradient buffers; plain --bf16 forces fp32 ones.
    assert validated("--bf16 --grad-reduce-in-bf16").accumulate_allreduce_grads_in_fp32 is False
    assert validated("--bf16").accumulate_allreduce_grads_in_fp32 is True
    assert validated("--grad-reduce-in-bf16").accumulate_allreduce_grads_in_fp32 is False  # fp32: no effect


def _schedule_args(schedule, extra=(), world_size=8, seq=2048):
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", str(seq),
            "--max-position-embeddings", str(seq), "--micro-batch-size", "1", "--train-iters", "10",
            "--step-batch-size-schedule", schedule, *extra]
    args = parse_args(argv=argv)
    args.world_size = world_size
    return validate_args(args, {})


# consumed samples -> (global batch size, micro-batches with micro 1 x DP 8). Sample thresholds are the token
# thresholds // 2048: 2.4e9 // 2048 = 1 171 875, 4.8e9 -> 2 343 750, 7.2e9 -> 3 515 625, 9.6e9 -> 4 687 500,
# 12e9 -> 5 859 375.
GPT3_TABLE = [(0, 16, 2), (1_171_874, 16, 2), (1_171_875, 320, 40), (3_000_000, 624, 78),
              (3_515_625, 928, 116), (5_859_374, 1232, 154), (5_859_375, 1536, 192), (10**8, 1536, 192)]


def test_gpt3_schedule_table(clean_env):
    # The gpt3 example passes --global-batch-size 1536 next to the schedule: accepted because it ends at 1536.
    args = _schedule_args(GPT3_SCHEDULE, ["--global-batch-size", "1536"])
    calculator = build_num_microbatches_calculator(args)
    for consumed, batch_size, micro_batches in GPT3_TABLE:
        calculator.update(consumed, True)
        assert (calculator.get_current_global_batch_size(), calculator.get()) == (batch_size, micro_batches), consumed
    # Without --global-batch-size Megatron's default (micro x DP) stands.
    assert _schedule_args(GPT3_SCHEDULE).global_batch_size == 8


def test_small_schedule_table(clean_env):
    # Thresholds in tokens, seq 32: 1K -> 1000 // 32 = 31 samples, 2k -> 62; commas and lower-case suffixes work.
    args = _schedule_args("2k:32, 0:8 1K:16", world_size=4, seq=32)
    calculator = build_num_microbatches_calculator(args)
    table = [(0, 8, 2), (30, 8, 2), (31, 16, 4), (61, 16, 4), (62, 32, 8), (1000, 32, 8)]
    for consumed, batch_size, micro_batches in table:
        calculator.update(consumed, True)
        assert (calculator.get_current_global_batch_size(), calculator.get()) == (batch_size, micro_batches)


@pytest.mark.parametrize("schedule, extra, words", [
    (GPT3_SCHEDULE, ["--global-batch-size", "1024"], "--global-batch-size (1024) must equal"),
    ("1K:16 2K:32", [], "must start at threshold 0"),
    ("0:16 10:32", [], "strictly increase"),  # 10 tokens // 2048 = sample 0 again
    ("0:16 1M:x", [], "THRESHOLD:BATCH_SIZE"),
    ("0:12", [], "multiple of --micro-batch-size"),
    ("0:16", ["--rampup-batch-size", "8", "8", "100"], "pass only one"),
])
def test_schedule_errors(clean_env, schedule, extra, words):
    with pytest.raises(ConfigurationError) as e:
        _schedule_args(schedule, extra)
    assert words in str(e.value) and "\n" not in str(e.value)


def schedule_run_body():
    from helpers.train_helpers import run_pretrain

    records = run_pretrain("pretrain_gpt", ["--mock-data", "--use-mcore-models", "--num-layers", "2",
                                            "--train-iters", "6", "--log-interval", "1", "--eval-interval", "1000",
                                            "--eval-iters", "1", "--step-batch-size-schedule", "0:2 192:4"])
    return [(int(re.search(r"global batch size:\s+(\d+)", r["line"]).group(1)),
             int(re.search(r"consumed samples:\s+(\d+)", r["line"]).group(1))) for r in records]


def test_training_run_with_changing_batch_size():
    """seq 32: 192 tokens = sample 6. Batch 2 while fewer than 6 samples were consumed (iterations 1-3), then 4;
    --global-batch-size 4 (from the test command line) is accepted because the schedule ends at 4."""
    (rows,) = run_distributed(schedule_run_body, 1, timeout=200)
    assert rows == [(2, 2), (2, 4), (2, 6), (4, 10), (4, 14), (4, 18)], rows

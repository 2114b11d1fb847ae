"""Today's Megatron-LM options implemented beside the registry's tables: --num-virtual-stages-per-pipeline-rank,
--use-dist-ckpt / --dist-ckpt-format, --exit-signal, --logging-level, --disable-bf16-reduced-precision-matmul,
--wandb-entity, --start-eval-at-iter, --adlr-autoresume-interval (each against what the option must do, written out
by hand)."""
import argparse
import logging
import signal
import sys
import types

import pytest
import torch
from helpers.args_test_helpers import clean_env, validated  # noqa: F401  (fixture)

from megatron.training.errors import ConfigurationError


def test_num_virtual_stages_per_pipeline_rank_is_the_other_spelling_of_the_interleaved_schedule(clean_env):
    # 8 layers, PP 4: 2 virtual stages per rank = 1 layer per virtual stage.
    a = validated("--num-layers 8 --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
                  "--global-batch-size 8", world_size=4)
    b = validated("--num-layers 8 --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1 "
                  "--global-batch-size 8", world_size=4)
    assert (a.virtual_pipeline_model_parallel_size, a.num_layers_per_virtual_pipeline_stage) == (2, 1)
    assert (b.virtual_pipeline_model_parallel_size, b.num_layers_per_virtual_pipeline_stage) == (2, 1)
    for extra, words in (("--num-virtual-stages-per-pipeline-rank 3", r"must be divisible by pipeline stages \(4\) x"),
                         ("--num-virtual-stages-per-pipeline-rank 2 --num-layers-per-virtual-pipeline-stage 1",
                          "pass only one")):
        with pytest.raises(ConfigurationError, match=words):
            validated(f"--num-layers 8 --pipeline-model-parallel-size 4 {extra}", world_size=4)


def test_deprecated_dist_ckpt_flags_set_the_format(clean_env):
    assert validated("--ckpt-format torch --use-dist-ckpt").ckpt_format == "torch_dist"
    assert validated("--dist-ckpt-format torch").ckpt_format == "torch"
    with pytest.raises(ConfigurationError, match="--dist-ckpt-format zarr: use --ckpt-format torch_dist or torch"):
        validated("--dist-ckpt-format zarr")


def test_exit_signal_chooses_the_signal_the_handler_catches(clean_env):
    from megatron.training import global_vars

    before = signal.getsignal(signal.SIGUSR1)
    global_vars._set_signal_handler(validated("--exit-signal-handler --exit-signal 10").exit_signal)
    try:
        assert signal.getsignal(signal.SIGUSR1) is not before  # SIGUSR1 = 10 is caught now
        assert not global_vars.get_signal_handler()._signal_received
        signal.raise_signal(signal.SIGUSR1)
        assert global_vars.get_signal_handler()._signal_received
    finally:
        global_vars.destroy_global_vars()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_logging_level_and_bf16_reduced_precision(clean_env):
    from megatron.training.initialize import _apply_process_settings

    root, matmul = logging.getLogger(), torch.backends.cuda.matmul
    level, reduced = root.level, matmul.allow_bf16_reduced_precision_reduction
    try:
        _apply_process_settings(validated("--logging-level 10 --disable-bf16-reduced-precision-matmul"))
        assert root.level == logging.DEBUG and matmul.allow_bf16_reduced_precision_reduction is False
        _apply_process_settings(validated(""))  # not given: both left as they are
        assert root.level == logging.DEBUG and matmul.allow_bf16_reduced_precision_reduction is False
    finally:
        root.setLevel(level)
        matmul.allow_bf16_reduced_precision_reduction = reduced


def test_wandb_entity_and_start_eval_at_iter(clean_env, monkeypatch):
    from megatron.training import training
    from megatron.training.training import _wandb_run, periodic_evaluation_due

    # the last rank of the last pipeline stage logs to Weights & Biases: be it, without process groups
    monkeypatch.setattr(training.parallel_state, "is_pipeline_last_stage", lambda **kwargs: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 1)
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: calls.append(kw) or "run"))
    args = validated("--wandb-project p --wandb-entity team --wandb-exp-name e")
    assert _wandb_run(args) == "run" and (calls[0]["project"], calls[0]["entity"], calls[0]["name"]) == ("p", "team", "e")
    args = argparse.Namespace(eval_interval=10, start_eval_at_iter=25)
    assert [i for i in range(1, 61) if periodic_evaluation_due(args, i)] == [30, 40, 50, 60]
    args.start_eval_at_iter = None
    assert [i for i in range(1, 31) if periodic_evaluation_due(args, i)] == [10, 20, 30]
    args.eval_interval = None  # today's default: no periodic evaluation
    assert not any(periodic_evaluation_due(args, i) for i in range(1, 31))


def test_adlr_autoresume_termination_saves_asks_for_a_resume_and_exits(clean_env, monkeypatch):
    from megatron.training import training

    events = []

    class AutoResume:  # ADLR's userlib.auto_resume interface
        stop = False

        @classmethod
        def termination_requested(cls):
            return cls.stop

        @staticmethod
        def request_resume():
            events.append("resume requested")

    args = validated("--save /tmp/h27-autoresume --save-interval 100 --adlr-autoresume-interval 2")
    args.num_floating_point_operations_so_far = 0  # set by pretrain
    monkeypatch.setattr(training, "get_args", lambda: args)
    monkeypatch.setattr(training, "get_adlr_autoresume", lambda: AutoResume)
    monkeypatch.setattr(training, "save_checkpoint", lambda it, *rest: events.append(f"saved {it}"))
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a: None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)
    monkeypatch.setattr(training, "_exit", lambda: events.append("exit"))
    training.check_adlr_autoresume_termination(4, [], None, None)
    assert events == []  # no request: training goes on
    AutoResume.stop = True
    training.check_adlr_autoresume_termination(6, [], None, None)
    assert events == ["saved 6", "resume requested", "exit"]

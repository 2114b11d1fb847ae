"""Timers in one process (semantics, levels, report format) and the micro-batch calculators."""
import re
import time

import pytest
from helpers.args_test_helpers import clean_env, validated  # noqa: F401  (fixture)

from megatron.training.errors import ConfigurationError
from megatron.training.global_vars import (
    get_current_global_batch_size,
    get_num_microbatches,
    set_global_variables,
    update_num_microbatches,
)
from megatron.training.microbatches import ConstantNumMicroBatches, RampupBatchsizeNumMicroBatches
from megatron.training.timers import DummyTimer, Timer, Timers


def test_timer_accumulates_and_resets():
    timer = Timer("t")
    for _ in range(2):
        timer.start()
        time.sleep(0.02)
        timer.stop()
    assert 0.035 < timer.elapsed(reset=False) < 0.5
    timer.start()
    running = timer.elapsed(reset=True)  # a running timer keeps running after elapsed()
    assert running >= 0.035 and timer._started
    timer.stop()
    assert timer.elapsed() < 0.02  # reset above dropped the earlier 40 ms
    with pytest.raises(AssertionError, match="timer is not started"):
        timer.stop()
    timer.start()
    with pytest.raises(AssertionError, match="timer has already been started"):
        timer.start()


def test_timer_levels():
    timers = Timers(log_level=1, log_option="minmax")
    coarse = timers("coarse", log_level=1)
    assert isinstance(coarse, Timer) and timers("coarse") is coarse
    assert isinstance(timers("fine", log_level=2), DummyTimer)
    assert isinstance(timers("unspecified"), DummyTimer)  # no level: the maximum (2)
    with pytest.raises(Exception, match="dummy timer should not be used"):
        timers("fine", log_level=2).elapsed()
    with pytest.raises(AssertionError, match="does not match already existing log level 1"):
        timers("coarse", log_level=0)
    with pytest.raises(AssertionError, match="larger than max supported log level 2"):
        timers("x", log_level=3)
    with pytest.raises(ValueError, match="unknown timing log option"):
        Timers(0, "median")


def test_timers_log_format_single_process(capsys):
    timers = Timers(log_level=2, log_option="minmax")
    timers("forward-compute", log_level=1).start()
    time.sleep(0.05)
    timers("forward-compute").stop()
    timers("never-started", log_level=1)
    timers.log(["forward-compute", "never-started", "not-a-timer"], normalizer=2.0)
    out = capsys.readouterr().out
    match = re.fullmatch(r"\(min, max\) time across ranks \(ms\):\n    forward-compute \.{32}: "
                         r"\((\d+\.\d\d), (\d+\.\d\d)\)\n", out)
    assert match, out
    low, high = float(match.group(1)), float(match.group(2))
    assert low == high and 24.0 < low < 150.0  # 50 ms / normalizer 2
    timers.log(["forward-compute"])  # reset by the previous log: nothing to report
    assert capsys.readouterr().out == ""


def test_constant_num_microbatches():
    calc = ConstantNumMicroBatches(global_batch_size=32, micro_batch_size=2, data_parallel_size=4)
    assert (calc.get(), calc.get_current_global_batch_size()) == (4, 32)
    calc.update(10_000, True)
    assert calc.get() == 4
    with pytest.raises(ConfigurationError, match=r"^global batch size \(10\) is not divisible by micro batch size "
                                                 r"\(4\) times data parallel size \(1\)$"):
        ConstantNumMicroBatches(10, 4, 1)


def test_rampup_num_microbatches():
    # 4 -> 16 in steps of 4 over 90 samples: 3 increments, one every 30 samples; mbs 2 x dp 1.
    calc = RampupBatchsizeNumMicroBatches(4, 4, 90, 16, 2, 1)
    assert (calc.get_current_global_batch_size(), calc.get()) == (4, 2)
    for consumed, batch in ((29, 4), (30, 8), (59, 8), (60, 12), (89, 12), (90, 16), (91, 16), (10_000, 16)):
        calc.update(consumed, True)
        assert (calc.get_current_global_batch_size(), calc.get()) == (batch, batch // 2), consumed
    uneven = RampupBatchsizeNumMicroBatches(4, 4, 90, 16, 3, 1)
    uneven.update(0, False)
    with pytest.raises(ConfigurationError, match=r"current global batch size \(4\) is not divisible by "
                                                 r"micro-batch-size \(3\) times data parallel size \(1\)"):
        uneven.update(0, True)
    with pytest.raises(ConfigurationError, match=r"global batch size interval \(12\) to be divisible by global "
                                                 r"batch size increment \(5\)"):
        RampupBatchsizeNumMicroBatches(4, 5, 90, 16, 2, 1)
    flat = RampupBatchsizeNumMicroBatches(16, 4, 90, 16, 2, 1)  # nothing to ramp
    assert flat.get_current_global_batch_size() == 16


def test_global_rampup_calculator(clean_env, capsys):
    args = validated("--micro-batch-size 2 --global-batch-size 16 --rampup-batch-size 4 4 90 --train-samples 1000",
                     world_size=1)
    set_global_variables(args, build_tokenizer=False)
    assert "will use batch size rampup starting from global batch size 4 to global batch size 16 with batch size " \
           "increments 4 over 90 samples." in capsys.readouterr().out
    assert (get_num_microbatches(), get_current_global_batch_size()) == (2, 4)
    update_num_microbatches(60)
    assert (get_num_microbatches(), get_current_global_batch_size()) == (6, 12)
    update_num_microbatches(91)
    assert (get_num_microbatches(), get_current_global_batch_size()) == (8, 16)


def test_global_constant_calculator_message(clean_env, capsys):
    set_global_variables(validated("--global-batch-size 12", world_size=2), build_tokenizer=False)
    assert "setting number of micro-batches to constant 3" in capsys.readouterr().out  # 12 / (2 x 2)

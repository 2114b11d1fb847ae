"""The iteration log line: TFLOP/s digits on slow (CPU) runs and the time-to-finish field.

``training_log`` is called with hand-made args and a fake interval timer (no process group), so the expected
numbers are computed by hand from the elapsed time, the batch and the model size."""
import re
import types

import pytest

from megatron.training import training_log as tl


@pytest.mark.parametrize("value, text", [
    (0.0312, "0.031"), (0.5049, "0.50"), (3.47, "3.5"), (9.96, "10.0"), (12.34, "12.3"), (312.0, "312.0"),
    (0.0000012, "0.000001"), (0.0, "0.0"),
])
def test_tflops_format(value, text):
    assert tl.format_tflops(value) == text


@pytest.mark.parametrize("seconds, text", [(0, "0:00:00"), (59.6, "0:01:00"), (3725, "1:02:05"),
                                           (90061, "25:01:01"), (-3, "0:00:00")])
def test_eta_format(seconds, text):
    assert tl.format_eta(seconds) == text


class _Timer:
    def __init__(self, seconds):
        self.seconds = seconds

    def elapsed(self, barrier=False):
        return self.seconds


class _Timers:
    def __init__(self, seconds):
        self.interval = _Timer(seconds)

    def __call__(self, name, log_level=None):
        assert name == "interval-time"
        return self.interval

    def log(self, names, normalizer=1):
        pass


def _log_line(monkeypatch, iteration, train_iters, interval_seconds, log_interval=10):
    import torch

    args = types.SimpleNamespace(
        micro_batch_size=4, data_parallel_size=1, seq_length=128, hidden_size=64, num_layers=2,
        ffn_hidden_size=256, num_attention_heads=4, padded_vocab_size=8192, world_size=1, swiglu=False,
        group_query_attention=False, log_interval=log_interval, train_iters=train_iters,
        consumed_train_samples=4 * iteration, log_throughput=True, tensorboard_log_interval=1)
    printed = []
    monkeypatch.setattr(tl, "get_args", lambda: args)
    monkeypatch.setattr(tl, "get_timers", lambda: _Timers(interval_seconds))
    monkeypatch.setattr(tl, "get_num_microbatches", lambda: 1)
    monkeypatch.setattr(tl, "get_tensorboard_writer", lambda: None)
    monkeypatch.setattr(tl, "print_rank_last", printed.append)
    monkeypatch.setattr(tl, "report_memory", lambda *a: None)
    state = tl.LogState()
    state.advanced_iters = log_interval - 1  # the call below adds the interval's last iteration
    line = tl.training_log(state, {"lm loss": torch.tensor(5.0)}, 1e-3, iteration, torch.tensor(1.0), 0, 1.5,
                           None, None)
    assert printed == [line]
    return args, line


def test_cpu_line_has_tflops_digits_and_eta(monkeypatch):
    # 10 iterations in 25 s: 2.5 s each, 70 iterations left -> 175 s.
    args, line = _log_line(monkeypatch, iteration=30, train_iters=100, interval_seconds=25.0)
    assert " elapsed time per iteration (ms): 2500.0 | time to finish (h:mm:ss): 0:02:55 |" in line
    # By hand: 12 B s L h^2 (1 + ffn/h + 1 + s/h + V/(2 L h)) = 12*4*128*2*64^2 * (1 + 4 + 1 + 2 + 32)
    flops = 12 * 4 * 128 * 2 * 64 ** 2 * (1 + 4 + 1 + 2 + 8192 / (2 * 2 * 64))
    tflops = flops / 2.5 / 1e12
    assert 0.0001 < tflops < 0.001
    match = re.search(r" throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \| tokens per second: ([\d.]+) \|", line)
    assert match, line
    assert match.group(1) == "{:.5f}".format(tflops)  # two significant digits, not "0.0"
    assert float(match.group(2)) == pytest.approx(4 * 128 / 2.5)
    assert line.startswith(" iteration       30/     100 | consumed samples:          120 |")


def test_last_iteration_eta_is_zero_and_fast_runs_keep_megatron_format(monkeypatch):
    # A big model on a fast device: >= 10 TFLOP/s is printed with Megatron's one decimal.
    args, line = _log_line(monkeypatch, iteration=100, train_iters=100, interval_seconds=1e-7)
    assert " time to finish (h:mm:ss): 0:00:00 |" in line
    value = re.search(r"\(TFLOP/s/GPU\): ([\d.]+) \|", line).group(1)
    assert float(value) >= 10 and re.fullmatch(r"\d+\.\d", value), value

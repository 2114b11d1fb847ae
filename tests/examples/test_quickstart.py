"""examples/quickstart_cpu.sh as a 4-iteration smoke run (the full run trains for 600), and the report it prints
(tools/quickstart_report.py) on hand-written log text."""
from __future__ import annotations

import math
import os
import subprocess

import pytest

from helpers.examples_helpers import REPO

pytestmark = pytest.mark.timeout(400)

from tools import quickstart_report as report  # noqa: E402

LOG = """\
 iteration       25/     100 | consumed samples:          400 | elapsed time per iteration (ms): 300.0 | time to finish (h:mm:ss): 0:00:22 | throughput per GPU (TFLOP/s/GPU): 0.12 | tokens per second: 6000.0 | learning rate: 1.000E-03 | global batch size:    16 | lm loss: 8.000000E+00 | loss scale: 1.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
 iteration       50/     100 | consumed samples:          800 | elapsed time per iteration (ms): 300.0 | time to finish (h:mm:ss): 0:00:15 | throughput per GPU (TFLOP/s/GPU): 0.12 | tokens per second: 6400.0 | learning rate: 1.000E-03 | global batch size:    16 | lm loss: 6.000000E+00 | loss scale: 1.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
-----
 validation loss at iteration 50 | lm loss value: 5.900000E+00 | lm loss PPL: 3.651234E+02 |
-----
 iteration      100/     100 | consumed samples:         1600 | elapsed time per iteration (ms): 300.0 | time to finish (h:mm:ss): 0:00:00 | throughput per GPU (TFLOP/s/GPU): 0.12 | tokens per second: 6200.0 | learning rate: 1.000E-04 | global batch size:    16 | lm loss: 4.500000E+00 | loss scale: 1.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
 validation loss at iteration 100 on validation set | lm loss value: 4.400000E+00 | lm loss PPL: 8.145087E+01 |
"""


def test_report_parses_megatron_lines_and_draws_table():
    train, valid, speed = report.parse_log(LOG)
    assert train == [(25, 8.0), (50, 6.0), (100, 4.5)]
    assert valid == [(50, 5.9), (100, 4.4)]
    assert speed == [6000.0, 6400.0, 6200.0]
    table = report.loss_table(train, valid).splitlines()
    assert table[2].split("|")[:2] == ["        25 ", "      8.000 "] and table[2].endswith("#" * 30)
    assert "5.900" in table[3] and table[4].split("|")[2].strip() == "4.400" and table[4].endswith("| #")


def test_report_collapses_blank_lines_in_samples_only():
    raw = "== prompt: 'A'\n== generated text:\nA b  \n\n\n\n c\n\n\n== prompt: 'B'\n== generated text:\nB\n\n\n\n\n"
    samples = report.generated_samples(raw)
    assert [p for p, _ in samples] == ["'A'", "'B'"]
    assert report.readable(samples[0][1]) == "A b\n\n c"
    assert report.readable(samples[1][1]) == "B"


def test_quickstart_smoke(tmp_path):
    out = tmp_path / "qs"
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OUT=str(out), ITERS="4", LOG_INTERVAL="2", EVAL_INTERVAL="4", GEN_TOKENS="8", PYTHONPATH=path)
    proc = subprocess.run(["bash", os.path.join(REPO, "examples", "quickstart_cpu.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=380)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    # Console: the iteration lines with the ETA field, the table, the perplexity, the three prompts' text.
    assert text.count(" iteration ") >= 1 and "time to finish (h:mm:ss):" in text, text[-4000:]
    assert " iteration | train loss | valid loss |" in text
    assert "validation loss at iteration 4: " in text and "(perplexity " in text
    for prompt in ("The function returns", "This module provides", "If the argument is"):
        assert f"== prompt: '{prompt}'" in text
    shown = text[text.index("== prompt: "):]
    assert "\n\n\n" not in shown, shown
    # Files: a torch-layout checkpoint (whatever --ckpt-format defaults to), plot and TensorBoard or a message.
    assert (out / "checkpoints" / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    assert (out / "train.log").is_file() and (out / "generate.log").is_file()
    try:
        import matplotlib  # noqa: F401
        assert (out / "loss.png").stat().st_size > 1000
    except ImportError:
        assert "loss plot skipped: matplotlib is not installed" in text
    try:
        import tensorboard  # noqa: F401
        assert any(name.startswith("events.out.tfevents") for name in os.listdir(out / "tensorboard"))
    except ImportError:
        assert "TensorBoard writing requested but is not available" in text
    assert math.isfinite(float(text.split("validation loss at iteration 4: ")[1].split()[0]))

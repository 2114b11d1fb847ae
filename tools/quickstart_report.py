"""Summarise a training run from its console log: the loss curve as a text table, ``loss.png``, and readable
generated text.

    python tools/quickstart_report.py --train-log runs/quickstart/train.log [--plot runs/quickstart/loss.png] \
        [--generate-log runs/quickstart/generate.log]

Reads Megatron's iteration lines (`` iteration  N/  T | ... | lm loss: X | ...``, the loss averaged over the
``--log-interval`` iterations that end at N) and validation blocks (`` validation loss at iteration N ... |
lm loss value: X | lm loss PPL: P |``). The plot needs matplotlib (``pip install -e ".[quickstart]"``); without
it the table is printed and the plot is skipped with a message. Generated text is shown with runs of blank
lines collapsed to one and trailing spaces dropped: a small model emits many newline tokens, and the raw text
stays in the generation log.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from typing import Dict, List, Tuple

ITERATION_LINE = re.compile(r"^ iteration\s+(\d+)/\s*(\d+) \|.*?\| lm loss: ([\d.E+-]+) \|")
TOKENS_PER_SECOND = re.compile(r"tokens per second: ([\d.]+) \|")
VALIDATION_LINE = re.compile(r"^ validation loss at (?:iteration (\d+)|(.*?)) .*?\| lm loss value: ([\d.E+-]+) \|")


def parse_log(text: str) -> Tuple[List[Tuple[int, float]], List[Tuple[int, float]], List[float]]:
    """(iteration, training loss) and (iteration, validation loss) pairs, and the tokens/s of each log line.

    The validation block printed after training (``validation loss at iteration N on validation set``) gets
    the iteration in its text, like the periodic ones."""
    train, valid, speed = [], [], []
    for line in text.splitlines():
        match = ITERATION_LINE.match(line)
        if match:
            train.append((int(match.group(1)), float(match.group(3))))
            tps = TOKENS_PER_SECOND.search(line)
            if tps:
                speed.append(float(tps.group(1)))
            continue
        match = VALIDATION_LINE.match(line)
        if match and match.group(1) is not None:
            valid.append((int(match.group(1)), float(match.group(3))))
    return train, valid, speed


def loss_table(train: List[Tuple[int, float]], valid: List[Tuple[int, float]], rows: int = 12) -> str:
    """A text table of about ``rows`` training log points (evenly spaced; the last one and every iteration with
    a validation loss always kept), with a bar per row and the validation loss where one was measured."""
    if not train:
        return "(no iteration lines with an lm loss found)"
    valid_at: Dict[int, float] = dict(valid)
    step = max(1, math.ceil(len(train) / rows))
    picked = [point for index, point in enumerate(train)
              if index % step == 0 or point[0] in valid_at or index == len(train) - 1]
    high = max(loss for _, loss in picked)
    low = min(loss for _, loss in picked)
    lines = [" iteration | train loss | valid loss | ", "-----------+------------+------------+-" + "-" * 30]
    for iteration, loss in picked:
        width = 1 + int(round(29 * (loss - low) / (high - low))) if high > low else 1
        val = "{:10.3f}".format(valid_at[iteration]) if iteration in valid_at else " " * 10
        lines.append(" {:9d} | {:10.3f} | {} | {}".format(iteration, loss, val, "#" * width))
    return "\n".join(lines)


def write_plot(train, valid, path: str) -> str:
    """Write the curve to ``path``; returns a one-line message (written, or why it was skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (f"loss plot skipped: matplotlib is not installed (pip install -e \".[quickstart]\" "
                f"to get {path})")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([i for i, _ in train], [v for _, v in train], label="training loss (mean over log interval)")
    if valid:
        ax.plot([i for i, _ in valid], [v for _, v in valid], "o-", label="validation loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"loss plot written to {path}"


def readable(text: str) -> str:
    """Collapse runs of blank lines into one, drop trailing spaces and leading/trailing blank lines."""
    lines = [line.rstrip() for line in text.splitlines()]
    out: List[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out)


def generated_samples(text: str) -> List[Tuple[str, str]]:
    """(prompt, completion) pairs from tools/generate_text.py's output (``== prompt: 'p'`` then
    ``== generated text:`` and the text, up to the next ``== prompt``)."""
    samples = []
    for block in re.split(r"^== prompt: ", text, flags=re.M)[1:]:
        head, _, body = block.partition("\n== generated text:\n")
        samples.append((head.strip(), body))
    return samples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-log", required=True, help="console output of pretrain_gpt.py")
    parser.add_argument("--plot", default=None, help="write the loss curve to this PNG file")
    parser.add_argument("--generate-log", default=None, help="output of tools/generate_text.py")
    parser.add_argument("--samples-only", action="store_true",
                        help="print only the final validation perplexity and the generated text")
    args = parser.parse_args(argv)
    with open(args.train_log, encoding="utf-8", errors="replace") as f:
        train, valid, speed = parse_log(f.read())
    if not args.samples_only:
        print(loss_table(train, valid))
        if speed:
            print("training speed: {:.0f} tokens/s (median of the log lines)".format(
                sorted(speed)[len(speed) // 2]))
    if valid:
        iteration, loss = valid[-1]
        print("validation loss at iteration {}: {:.3f} (perplexity {:.1f})".format(iteration, loss, math.exp(loss)))
    if args.plot and not args.samples_only:
        print(write_plot(train, valid, args.plot))
    if args.generate_log:
        with open(args.generate_log, encoding="utf-8", errors="replace") as f:
            samples = generated_samples(f.read())
        if not samples:
            print(f"no generated text found in {args.generate_log}", file=sys.stderr)
            return 1
        for prompt, completion in samples:
            print("\n== prompt: {}\n{}".format(prompt, readable(completion)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

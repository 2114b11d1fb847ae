"""Throughput of tools/preprocess_data.py on GPT-2 BPE with --workers 1 and --workers 2, side by side.

The input is the shipped corpus (data/stdlib_prose.jsonl.gz) written out as plain JSON lines, repeated
--repeat times. Each configuration runs the real command line in a fresh process; the table shows:
  wall MB/s   input file bytes / wall-clock time of the whole command (start-up included)
  tool MB/s   Megatron's progress-line figure (characters of JSON / time after start-up), last line
  docs/s      documents / wall-clock time
  cpu s       CPU seconds of the command and its workers (user + system): on a shared machine, wall time
              above cpu s / cores means other processes took the cores
Both runs must produce byte-identical outputs, which is checked.

    python benchmarks/bench_preprocess.py [--repeat 4] [--workers 1 2]
"""
from __future__ import annotations

import argparse
import filecmp
import gzip
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
CORPUS = os.path.join(REPO, "data", "stdlib_prose.jsonl.gz")
VOCAB = os.path.join(REPO, "data", "tokenizers", "gpt2", "vocab.json")
MERGES = os.path.join(REPO, "data", "tokenizers", "gpt2", "merges.txt")


def make_input(path: str, repeat: int) -> int:
    with gzip.open(CORPUS, "rb") as f:
        corpus = f.read()
    with open(path, "wb") as out:
        for _ in range(repeat):
            out.write(corpus)
    return corpus.count(b"\n") * repeat


def run(input_path: str, output_prefix: str, workers: int):
    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", input_path,
           "--output-prefix", output_prefix, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB,
           "--merge-file", MERGES, "--append-eod", "--workers", str(workers), "--log-interval", "500"]
    env = dict(os.environ, PYTHONPATH=REPO)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise SystemExit(f"preprocess_data.py failed:\n{done.stderr}")
    rates = re.findall(r"\(([\d.e+-]+) docs/s, ([\d.e+-]+) MB/s\)", done.stderr)
    return elapsed, cpu, float(rates[-1][1]) if rates else float("nan")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=4, help="copies of the corpus in the input")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="bench_preprocess_")
    try:
        input_path = os.path.join(workdir, "corpus.jsonl")
        num_docs = make_input(input_path, args.repeat)
        size_mb = os.path.getsize(input_path) / 1024 / 1024
        print(f"input: {input_path} ({size_mb:.1f} MB, {num_docs} documents = shipped corpus x{args.repeat}); "
              f"GPT-2 BPE, --append-eod; {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.2f}")
        print(f"{'workers':>7} | {'seconds':>7} | {'wall MB/s':>9} | {'tool MB/s':>9} | {'docs/s':>8} | {'cpu s':>6}")
        print("-" * 62)
        outputs = []
        for workers in args.workers:
            prefix = os.path.join(workdir, f"w{workers}")
            elapsed, cpu, tool_mbs = run(input_path, prefix, workers)
            outputs.append(prefix + "_text_document")
            print(f"{workers:>7} | {elapsed:>7.2f} | {size_mb / elapsed:>9.2f} | {tool_mbs:>9.2f} | "
                  f"{num_docs / elapsed:>8.0f} | {cpu:>6.2f}")
        for other in outputs[1:]:
            for ext in (".bin", ".idx"):
                if not filecmp.cmp(outputs[0] + ext, other + ext, shallow=False):
                    raise SystemExit(f"{other}{ext} differs from {outputs[0]}{ext}")
        print("outputs of all runs are byte-identical")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

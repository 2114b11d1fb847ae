"""Throughput of tools/preprocess_data.py (GPT-2 BPE), side by side with Megatron-LM's own tool when given.

The input is the shipped corpus (data/stdlib_prose.jsonl.gz) written out as plain JSON lines, repeated
--repeat times. Each configuration runs the real command line in a fresh process (start-up included, as a user
sees it), --rounds times, alternating the tools; the table shows medians:
  seconds     wall-clock time of the whole command
  wall MB/s   input file bytes / seconds
  docs/s      documents / seconds
  cpu s       CPU seconds of the command and its workers (user + system): on a shared machine, wall time
              above cpu s / cores means other processes took the cores
With ``--megatron-root DIR`` (a Megatron-LM checkout whose ``tools/preprocess_data.py`` runs with
``PYTHONPATH=DIR`` and takes ``--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file --append-eod
--workers``), the same rows are measured for that tool and the last column gives Megatron's seconds / ours
for the same number of workers. Every run's ``.bin``/``.idx`` must be byte-identical to the first, which is
checked.

    python benchmarks/bench_preprocess.py [--repeat 1] [--workers 1 2] [--rounds 3] [--megatron-root DIR]
"""
from __future__ import annotations

import argparse
import filecmp
import gzip
import os
import resource
import shutil
import statistics
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


def run(root: str, input_path: str, output_prefix: str, workers: int):
    """(wall seconds, CPU seconds) of one run of ``root``/tools/preprocess_data.py."""
    cmd = [sys.executable, os.path.join(root, "tools", "preprocess_data.py"), "--input", input_path,
           "--output-prefix", output_prefix, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB,
           "--merge-file", MERGES, "--append-eod", "--workers", str(workers)]
    env = dict(os.environ, PYTHONPATH=root)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise SystemExit(f"{cmd[1]} failed:\n{done.stderr[-3000:]}")
    return elapsed, cpu


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="copies of the corpus in the input")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each configuration (medians are shown)")
    parser.add_argument("--megatron-root", default=None,
                        help="a Megatron-LM checkout: also time its tools/preprocess_data.py and compare")
    args = parser.parse_args(argv)
    tools = [("ours", REPO)]
    if args.megatron_root:
        root = os.path.abspath(args.megatron_root)
        if not os.path.isfile(os.path.join(root, "tools", "preprocess_data.py")):
            raise SystemExit(f"--megatron-root {root} has no tools/preprocess_data.py")
        tools.append(("Megatron-LM", root))
    workdir = tempfile.mkdtemp(prefix="bench_preprocess_")
    try:
        input_path = os.path.join(workdir, "corpus.jsonl")
        num_docs = make_input(input_path, args.repeat)
        size_mb = os.path.getsize(input_path) / 1024 / 1024
        print(f"input: {input_path} ({size_mb:.1f} MB, {num_docs} documents = shipped corpus x{args.repeat}); "
              f"GPT-2 BPE, --append-eod; {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.2f}; "
              f"{args.rounds} rounds, medians")
        times = {}
        reference = None
        for round_index in range(args.rounds):
            for workers in args.workers:
                for name, root in tools:
                    prefix = os.path.join(workdir, f"{name.replace('-', '')}_w{workers}_r{round_index}")
                    elapsed, cpu = run(root, input_path, prefix, workers)
                    times.setdefault((name, workers), []).append((elapsed, cpu))
                    output = prefix + "_text_document"
                    if reference is None:
                        reference = output
                    else:
                        for ext in (".bin", ".idx"):
                            if not filecmp.cmp(reference + ext, output + ext, shallow=False):
                                raise SystemExit(f"{name} --workers {workers}: {output}{ext} differs from "
                                                 f"{reference}{ext}")
                        for ext in (".bin", ".idx"):
                            os.remove(output + ext)
        header = f"{'tool':>11} | {'workers':>7} | {'seconds':>7} | {'wall MB/s':>9} | {'docs/s':>8} | {'cpu s':>6}"
        if len(tools) > 1:
            header += " | Megatron / ours"
        print(header)
        print("-" * len(header))
        for workers in args.workers:
            for name, _ in tools:
                runs = times[(name, workers)]
                elapsed = statistics.median(r[0] for r in runs)
                cpu = statistics.median(r[1] for r in runs)
                line = (f"{name:>11} | {workers:>7} | {elapsed:>7.2f} | {size_mb / elapsed:>9.2f} | "
                        f"{num_docs / elapsed:>8.0f} | {cpu:>6.2f}")
                if len(tools) > 1 and name != "ours":
                    ours = statistics.median(r[0] for r in times[("ours", workers)])
                    line += f" | {elapsed / ours:.2f}x"
                print(line)
        print(f"outputs of all runs are byte-identical; load average now {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

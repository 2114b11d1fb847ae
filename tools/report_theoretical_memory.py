#!/usr/bin/env python
"""Print the theoretical memory per rank (weights, gradients, optimizer state, activations) of a run.

    python tools/report_theoretical_memory.py --world-size 1024 [--model gpt|bert] <the run's Megatron flags>

    python tools/report_theoretical_memory.py --world-size 64 --memory-budget-gb 80 <flags>

e.g. the flags of examples/pretrain_gpt3_175B.sh with --world-size 1024. The flags are parsed and validated by
megatron.training.arguments exactly as pretrain_gpt.py would (with the given world size instead of the
launcher's), so the data-parallel size, FFN size, padded vocabulary etc. are the ones the run would use. Then
one table per pipeline stage for the configuration as given, the totals of the most loaded rank with and
without --use-distributed-optimizer and under each recompute mode, and the data-parallel sharding strategies
(DDP, ZeRO-1 = the distributed optimizer, Megatron-FSDP's optim_grads and optim_grads_params = --use-torch-fsdp2)
side by side. With --memory-budget-gb B it also prints, per strategy, the largest model of this width (the most
layers, a multiple of the pipeline size) whose most loaded rank fits in B GB. The formulas are in
megatron/training/theoretical_memory.py.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.arguments import parse_args, validate_args  # noqa: E402
from megatron.training.theoretical_memory import (GB, MB, SHARDING_STRATEGIES,  # noqa: E402
                                                  report_theoretical_memory)
from megatron.tokenizer.vocab_padding import vocab_size_with_padding  # noqa: E402

TOKENIZER_DEFAULTS = {"gpt": "GPT2BPETokenizer", "bert": "BertWordPieceLowerCase"}


def parse(argv):
    pre = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                  add_help=False)
    pre.add_argument("--world-size", type=int, default=None,
                     help="number of GPUs (ranks) of the job; default: the launcher's environment, else 1")
    pre.add_argument("--model", choices=["gpt", "bert"], default="gpt", help="which model the flags describe")
    pre.add_argument("--verbose", action="store_true", help="also print Megatron's argument table")
    pre.add_argument("--memory-budget-gb", type=float, default=None,
                     help="per-rank memory budget: print the largest model (most layers at this width) that fits, "
                          "for each data-parallel sharding strategy")
    pre.add_argument("-h", "--help", action="store_true")
    tool, megatron_argv = pre.parse_known_args(argv)
    if tool.help:
        pre.print_help()
        sys.exit(0)
    # Sequence parallelism validates this variable on GPU machines (FSDP wants it above 1); a report never launches
    # kernels.
    fsdp = any(flag in megatron_argv for flag in ("--use-torch-fsdp2", "--use-megatron-fsdp"))
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "8" if fsdp else "1")
    args = parse_args(argv=megatron_argv)
    if tool.world_size is not None:
        if tool.world_size < 1:
            sys.exit("error: --world-size must be >= 1")
        args.world_size, args.rank = tool.world_size, 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        validate_args(args, {"tokenizer_type": TOKENIZER_DEFAULTS[tool.model]})
    if tool.verbose:
        print(out.getvalue())
    args.model_name = tool.model
    args.padded_vocab_size = padded_vocab(args)
    args.memory_budget_gb = tool.memory_budget_gb
    return args


def padded_vocab(args) -> int:
    if args.vocab_size is not None:
        size = args.vocab_size
    elif args.vocab_file is not None:
        from megatron.tokenizer import build_tokenizer
        with contextlib.redirect_stdout(io.StringIO()):
            size = build_tokenizer(args).vocab_size
    else:
        sys.exit("error: the vocabulary size is needed: pass --vocab-size N, or --vocab-file (and --merge-file)")
    return vocab_size_with_padding(size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size,
                                   log=False)


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    report = report_theoretical_memory(args)
    total_params = sum(report.params) * args.tensor_model_parallel_size  # replicated norms counted per TP rank
    print(f"model: {args.model_name}, {args.num_layers} layers, hidden {args.hidden_size}, "
          f"{args.num_attention_heads} heads, seq {args.seq_length}, padded vocab {args.padded_vocab_size}; "
          f"~{total_params / 1e9:.3f}B parameters")
    print(f"layout: world {args.world_size} = TP {args.tensor_model_parallel_size} x PP "
          f"{args.pipeline_model_parallel_size} x DP {args.data_parallel_size}; micro-batch {args.micro_batch_size}, "
          f"global batch {args.global_batch_size}; sequence parallel {bool(args.sequence_parallel)}")
    bpp = report.bytes_per_param
    print(f"precision {report.precision}, distributed optimizer {report.distributed_optimizer}, "
          f"recompute {report.recompute}: bytes per parameter: weights {bpp['weights']:g} + grads {bpp['grads']:g} "
          f"+ optimizer {bpp['optimizer']:.3g}")
    print()
    print("memory per rank of each pipeline stage (MB):")
    print(report.table())
    print()
    print("most loaded rank (GB): distributed optimizer x recompute")
    print("dist. optimizer  recompute   weights+grads+optimizer  activations  total")
    for dist in (False, True):
        for recompute in ("none", "selective", "full"):
            r = report_theoretical_memory(args, distributed_optimizer=dist, recompute=recompute)
            stage = max(range(len(r.params)), key=r.total)
            static = r.weights[stage] + r.grads[stage] + r.optimizer[stage]
            print(f"{str(dist):15s}  {recompute:9s}  {static / GB:23.2f}  {r.activations[stage] / GB:11.2f}  "
                  f"{r.total(stage) / GB:5.2f}")
    print()
    print(f"data-parallel sharding strategies over DP x CP = {dp_cp(args)} ranks, recompute {report.recompute} (GB, most "
          "loaded rank):")
    print("strategy             bytes/param  weights  grads  optimizer  activations  total")
    for sharding in SHARDING_STRATEGIES:
        r = report_theoretical_memory(args, sharding=sharding)
        stage = max(range(len(r.params)), key=r.total)
        print(f"{sharding:19s}  {sum(r.bytes_per_param.values()):11.3g}  {r.weights[stage] / GB:7.2f}  "
              f"{r.grads[stage] / GB:5.2f}  {r.optimizer[stage] / GB:9.2f}  {r.activations[stage] / GB:11.2f}  "
              f"{r.total(stage) / GB:5.2f}")
    if args.memory_budget_gb:
        print()
        print(f"largest model fitting {args.memory_budget_gb:g} GB per rank (hidden {args.hidden_size}, TP "
              f"{args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size} x DP "
              f"{args.data_parallel_size}, recompute {report.recompute}):")
        print("strategy             layers  parameters  total (GB)")
        for sharding in SHARDING_STRATEGIES:
            fit = largest_fitting(args, args.memory_budget_gb * GB, sharding)
            if fit is None:
                print(f"{sharding:19s}  none: even {args.pipeline_model_parallel_size} layer(s) exceed the budget")
                continue
            layers, params, total = fit
            print(f"{sharding:19s}  {layers:6d}  {params / 1e9:9.3f}B  {total / GB:10.2f}")
    print()
    print("Activations follow Korthikanti et al. 2022 (16-bit activations: 34 sbh + 5 a s^2 b bytes per layer); "
          "they are an estimate, weights/grads/optimizer are exact for this library. "
          f"({MB:.0f} bytes per MB)")


def dp_cp(args) -> int:
    return args.data_parallel_size * (getattr(args, "context_parallel_size", 1) or 1)


def largest_fitting(args, budget_bytes: float, sharding: str):
    """(layers, parameters, bytes) of the deepest model of ``args``' width whose most loaded rank fits
    ``budget_bytes`` under ``sharding``; None when even one layer per pipeline stage does not fit."""
    if isinstance(getattr(args, "moe_layer_freq", 1), list):
        sys.exit("error: --memory-budget-gb scales the number of layers; a --moe-layer-freq list fixes it")
    pp = args.pipeline_model_parallel_size

    def peak(layers):
        trial = copy.copy(args)
        trial.num_layers = layers
        r = report_theoretical_memory(trial, sharding=sharding)
        total = max(r.total(s) for s in range(pp))
        return total, sum(r.params) * args.tensor_model_parallel_size // pp * pp

    if peak(pp)[0] > budget_bytes:
        return None
    low, high = pp, pp
    while peak(high)[0] <= budget_bytes and high < 1_000_000:
        low, high = high, high * 2
    while high - low > pp:  # peak(low) fits, peak(high) does not
        mid = (low + high) // (2 * pp) * pp
        low, high = (mid, high) if peak(mid)[0] <= budget_bytes else (low, mid)
    total, params = peak(low)
    return low, params, total


if __name__ == "__main__":
    main()

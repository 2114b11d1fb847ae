"""Training throughput of a GPT configuration: this library's training step against a Hugging Face baseline.

    python benchmarks/train_throughput.py --preset cpu --train-iters 20 --warmup-steps 3 --json-out out.json
    python benchmarks/train_throughput.py --preset gpt-125m --bf16 --micro-batch-size 8 --json-out out.json
    python benchmarks/train_throughput.py --num-layers 4 --hidden-size 256 --num-attention-heads 8 \\
        --seq-length 256 --micro-batch-size 2 --global-batch-size 4 --train-iters 10

Every flag that is not one of this script's own (``--preset --train-iters --warmup-steps --json-out --threads
--rounds --steps-per-window --no-hf``) is a Megatron flag, parsed by this library's own argument parser.

* **ours**: ``pretrain_gpt.model_provider`` + ``setup_model_and_optimizer`` (get_model: Float16Module / DDP with
  contiguous grad buffers; get_megatron_optimizer; the LR scheduler) + ``train_step`` (the schedule from
  get_forward_backward_func, ``pretrain_gpt.forward_step`` with its loss, optimizer step with clipping): the code
  ``pretrain_gpt.py`` runs, initialised in-process as one rank (gloo on CPU, NCCL on GPU).
* **hf**: ``transformers.GPT2LMHeadModel`` (``attn_implementation="sdpa"``) with the same weights (our initial
  weights converted by ``megatron.core.models.conversion.hf``), ``torch.optim.AdamW`` (fused where the device
  has the kernel, else foreach) with the same lr / betas / eps / weight decay (none on biases and norms, as
  Megatron) and the same gradient clipping; under ``torch.autocast`` in the 16-bit dtype with --bf16 / --fp16
  (fp32 weights: the usual HF mixed-precision recipe; ours keeps 16-bit weights with fp32 main parameters).

Each side runs in its own subprocess (clean peak RSS / peak CUDA memory), on the same synthetic batches, with
the same ``torch.set_num_threads``. Step times: ``--warmup-steps`` untimed steps, then ``--train-iters`` timed
steps, synchronised around each timing window of ``--steps-per-window`` steps; ``--rounds N`` alternates the
two sides N times and pools the windows (machine-load drift hits both alike). The table reports medians.
FLOPs: ``megatron.training.training_log.num_floating_point_operations`` (Megatron's 2024 formula, see
docs/performance.md). GPT-2 architecture only (learned positions, LayerNorm, GeLU, tied embeddings): the
baseline cannot express the other model options.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

GPT2_VOCAB = 50257
# Applied first: the preset, then the user's flags override them (argparse keeps the last value).
COMMON_FLAGS = [
    "--vocab-size", str(GPT2_VOCAB), "--make-vocab-size-divisible-by", "128",
    "--optimizer", "adam", "--lr", "1e-4", "--min-lr", "1e-4", "--lr-decay-style", "constant",
    "--lr-warmup-iters", "0", "--weight-decay", "0.01", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--adam-eps", "1e-8", "--clip-grad", "1.0", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
    "--seed", "1234", "--log-interval", "1000000",
]
PRESETS = {
    "cpu": ["--num-layers", "6", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512",
            "--micro-batch-size", "4", "--global-batch-size", "4"],
    # The vocabulary-bound case: the output layer and the loss dominate (2 layers, 50k vocabulary, sequence 1024).
    "cpu-vocab": ["--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "1024",
                  "--micro-batch-size", "2", "--global-batch-size", "2"],
    "gpt-125m": ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "2048",
                 "--micro-batch-size", "8", "--global-batch-size", "8", "--bf16"],
    "gpt-1.3b": ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
                 "--seq-length", "2048", "--micro-batch-size", "4", "--global-batch-size", "4", "--bf16"],
}
# Dense 16-bit tensor-core peaks (TFLOP/s); matched against the CUDA device name.
GPU_PEAKS = [("H200", 989.0), ("H100", 989.0), ("A100", 312.0)]
FORMULA = ("Megatron-LM 2024 (core_v0.5/v0.6, dddecd1): F = 12 B s L h^2 (1 + (ffn/h) glu + g/n + s/h + V/(2 L h)); "
           "no causal halving, recompute not counted")


# ------------------------------------------------------------------------------------------- shared helpers

def bench_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=True)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="a configuration of issue 8")
    p.add_argument("--train-iters", type=int, default=10, help="timed training steps per round")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps before the timed ones")
    p.add_argument("--rounds", type=int, default=1, help="alternate ours / hf this many times, pooling timings")
    p.add_argument("--steps-per-window", type=int, default=1, help="steps between two synchronised clock reads")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads on both sides (default: cores)")
    p.add_argument("--json-out", default=None, help="write the results as JSON here")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    p.add_argument("--side", choices=["ours", "hf"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--init-file", default=None, help=argparse.SUPPRESS)
    return p


def megatron_argv(opts, rest):
    argv = list(COMMON_FLAGS) + (PRESETS[opts.preset] if opts.preset else []) + list(rest)
    argv += ["--train-iters", str(opts.warmup_steps + opts.train_iters)]
    if "--max-position-embeddings" not in argv:
        seq = argv[len(argv) - 1 - argv[::-1].index("--seq-length") + 1] if "--seq-length" in argv else None
        if seq is None:
            raise SystemExit("train_throughput: pass --seq-length (or a --preset)")
        argv += ["--max-position-embeddings", seq]
    return argv


def parsed_megatron_args(argv):
    """Our parser + validation, as initialize_megatron does (errors name the flag)."""
    import contextlib
    import io

    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(argv=argv)
    with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
        validate_args(args, {})
    return args


def check_gpt2_architecture(args):
    unsupported = [flag for flag, on in [
        ("--swiglu", args.swiglu), ("--normalization RMSNorm", args.normalization != "LayerNorm"),
        ("--position-embedding-type rope", args.position_embedding_type != "learned_absolute"),
        ("--untie-embeddings-and-output-weights", args.untie_embeddings_and_output_weights),
        ("--group-query-attention", args.group_query_attention), ("--disable-bias-linear", not args.add_bias_linear),
    ] if on]
    if unsupported:
        raise SystemExit(f"train_throughput: the GPT-2 baseline cannot express {', '.join(unsupported)}; "
                         "drop these flags (or pass --no-hf to time our side only)")
    if args.world_size != 1 or args.tensor_model_parallel_size * args.pipeline_model_parallel_size != 1:
        raise SystemExit("train_throughput: one process only (TP = PP = DP = 1); for parallel layouts time "
                         "pretrain_gpt.py --log-throughput under torchrun")


def synthetic_batches(args, count):
    """``count`` micro-batches of uniformly random GPT-2 token ids (same on both sides)."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, min(GPT2_VOCAB, args.padded_vocab_size), (args.micro_batch_size, args.seq_length + 1),
                               generator=g)
        batches.append({
            "tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(args.micro_batch_size, args.seq_length),
            "position_ids": torch.arange(args.seq_length).unsqueeze(0).expand(args.micro_batch_size, -1).contiguous(),
        })
    return batches


def cycle(items):
    while True:
        yield from items


def timed_loop(step_fn, opts):
    """Run warm-up + timed steps; returns (seconds per step for each window, step-0 loss, last loss)."""
    from megatron.core import device

    losses, windows = [], []
    total = opts.warmup_steps + opts.train_iters
    t0 = None
    for i in range(total):
        k = i - opts.warmup_steps
        if k >= 0 and k % opts.steps_per_window == 0:
            device.synchronize()
            t0 = time.perf_counter()
        losses.append(step_fn())
        if k >= 0 and (k + 1) % opts.steps_per_window == 0:
            device.synchronize()
            windows.append((time.perf_counter() - t0) / opts.steps_per_window)
    return windows, float(losses[0]), float(losses[-1])


def peak_memory_bytes():
    from megatron.core import device

    if device.on_gpu():
        return int(device.memory_stats_mb()["max allocated"] * 1024 * 1024), "torch.cuda.max_memory_allocated"
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS (ru_maxrss)"


# ------------------------------------------------------------------------------------------------- sides

def run_ours(opts, argv):
    from megatron.core import device
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_model_config
    from megatron.training import get_args
    from megatron.training.global_vars import get_num_microbatches
    from megatron.training.initialize import initialize_megatron
    from megatron.training.theoretical_memory import report_theoretical_memory
    from megatron.training.training import configure_schedule_hooks, setup_model_and_optimizer, train_step
    from megatron.training.utils import unwrap_model
    from pretrain_gpt import forward_step, model_provider

    initialize_megatron(argv=argv)
    args = get_args()
    model, optimizer, scheduler = setup_model_and_optimizer(model_provider, ModelType.encoder_or_decoder)
    if opts.init_file and not os.path.exists(opts.init_file):
        # The initial weights for the baseline (16-bit with --bf16/--fp16: exactly what our fp32 main params hold).
        torch.save(unwrap_model(model[0]).state_dict(), opts.init_file)
    config = get_model_config(model[0])
    for chunk in model:
        chunk.train()
    checks = configure_schedule_hooks(config, model, optimizer)
    data = cycle(synthetic_batches(args, 2 * get_num_microbatches()))
    inner = type(optimizer.optimizer).__name__ if hasattr(optimizer, "optimizer") else type(optimizer).__name__
    fused = getattr(getattr(optimizer, "optimizer", None), "defaults", {}).get("fused")

    def step():
        loss_dict, _, _, _ = train_step(forward_step, data, model, optimizer, scheduler, config,
                                        checks=checks)
        return loss_dict["lm loss"]

    windows, loss0, loss_last = timed_loop(step, opts)
    peak, peak_kind = peak_memory_bytes()
    return {"windows_s": windows, "loss_step0": loss0, "loss_last": loss_last, "peak_memory_bytes": peak,
            "peak_memory_kind": peak_kind, "device": str(device.current_device()),
            "theoretical_memory_bytes": report_theoretical_memory(args).total(0),
            "optimizer": f"{inner}({'fused' if fused else 'foreach'}) via get_megatron_optimizer",
            "precision": "bf16 + fp32 main params" if args.bf16 else ("fp16 + fp32 main params" if args.fp16 else "fp32"),
            "key_format": "mcore" if args.use_mcore_models else "legacy"}


def _hf_optimizer(model, args, dev):
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]  # biases and norms: Megatron's no-wd rule
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
    try:
        opt = torch.optim.AdamW(groups, fused=True, **kwargs)
        # A missing fused kernel only raises at step(): probe with a throwaway tensor on the same device.
        probe = torch.zeros(1, device=dev, requires_grad=True)
        probe.grad = torch.zeros(1, device=dev)
        torch.optim.AdamW([probe], fused=True).step()
        return opt, "torch.optim.AdamW(fused=True)"
    except (RuntimeError, NotImplementedError):
        return torch.optim.AdamW(groups, foreach=True, **kwargs), "torch.optim.AdamW(foreach=True)"


def _hf_activation(args):
    """The HF activation computing our GeLU: Megatron's bias-gelu fusion (on by default) and --openai-gelu are the
    tanh approximation (HF's fastest form of it: ``gelu_pytorch_tanh``), otherwise exact (erf) GeLU."""
    tanh = args.openai_gelu or (args.bias_gelu_fusion and args.add_bias_linear)
    return "gelu_pytorch_tanh" if tanh else "gelu"


def run_hf(opts, argv):
    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron.core import device
    from megatron.core.models.conversion.hf import gpt2_megatron_to_hf

    args = parsed_megatron_args(argv)
    dev = device.current_device()
    hf_config = GPT2Config(
        vocab_size=args.padded_vocab_size, n_positions=args.max_position_embeddings, n_embd=args.hidden_size,
        n_layer=args.num_layers, n_head=args.num_attention_heads, n_inner=args.ffn_hidden_size,
        activation_function=_hf_activation(args), resid_pdrop=args.hidden_dropout,
        embd_pdrop=args.hidden_dropout, attn_pdrop=args.attention_dropout, layer_norm_epsilon=args.layernorm_epsilon,
        tie_word_embeddings=True, use_cache=False)
    model = GPT2LMHeadModel._from_config(hf_config, attn_implementation="sdpa")
    ours = torch.load(opts.init_file, mmap=True, weights_only=True)
    state = gpt2_megatron_to_hf({k: v.float() for k, v in ours.items() if v is not None and "_extra_state" not in k},
                                hf_config, key_format="mcore" if args.use_mcore_models else "legacy")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"HF weights did not load: missing {missing}, unexpected {unexpected}")
    del ours, state
    model.to(dev).train()
    optimizer, opt_name = _hf_optimizer(model, args, dev)
    params = [p for p in model.parameters()]
    amp_dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else None)
    scaler = torch.amp.GradScaler(dev.type) if args.fp16 else None
    num_micro = args.global_batch_size // args.micro_batch_size
    data = cycle([{k: v.to(dev) for k, v in b.items()} for b in synthetic_batches(args, 2 * num_micro)])

    def step():
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(num_micro):
            batch = next(data)
            with torch.autocast(dev.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                # HF's own loss (ForCausalLMLoss); shift_labels = our pre-shifted targets, so both sides score
                # the same s positions of each sequence.
                out = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"],
                            shift_labels=batch["labels"])
            loss = out.loss / num_micro
            (scaler.scale(loss) if scaler else loss).backward()
            total = total + loss.detach()
        if scaler:
            scaler.unscale_(optimizer)
        if args.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, args.clip_grad, foreach=True)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        return total

    windows, loss0, loss_last = timed_loop(step, opts)
    peak, peak_kind = peak_memory_bytes()
    return {"windows_s": windows, "loss_step0": loss0, "loss_last": loss_last, "peak_memory_bytes": peak,
            "peak_memory_kind": peak_kind, "device": str(dev), "optimizer": opt_name,
            "precision": f"fp32 weights + torch.autocast({amp_dtype})" if amp_dtype else "fp32",
            "transformers": __import__("transformers").__version__, "activation": hf_config.activation_function}


def child_main(opts, rest):
    torch.set_num_threads(opts.threads)
    argv = megatron_argv(opts, rest)
    result = run_ours(opts, argv) if opts.side == "ours" else run_hf(opts, argv)
    with open(opts.result_file, "w") as f:
        json.dump(result, f)


# ------------------------------------------------------------------------------------------------ parent

def measured_cpu_matmul_tflops(threads, n=2048, repeats=7):
    """Median fp32 matmul rate of this machine (the CPU "peak" for MFU), in TFLOP/s."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        rates.append(2 * n ** 3 / (time.perf_counter() - t0) / 1e12)
    return statistics.median(rates)


def device_peak(threads):
    from megatron.core import device

    if device.cuda_available():
        name = device.device_name()
        for key, peak in GPU_PEAKS:
            if key in name:
                return name, peak, f"{name}: dense bf16 peak {peak:g} TFLOP/s"
        return name, None, f"{name}: unknown peak (MFU not reported)"
    peak = measured_cpu_matmul_tflops(threads)
    return "cpu", peak, f"CPU, {threads} threads: measured fp32 matmul rate {peak * 1e3:.1f} GFLOP/s (median of 7, n=2048)"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_side(side, opts, rest, workdir, init_file, round_index):
    result_file = os.path.join(workdir, f"{side}-{round_index}.json")
    log_file = os.path.join(workdir, f"{side}-{round_index}.log")
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--result-file", result_file,
           "--init-file", init_file, "--threads", str(opts.threads), "--train-iters", str(opts.train_iters),
           "--warmup-steps", str(opts.warmup_steps), "--steps-per-window", str(opts.steps_per_window)]
    cmd += (["--preset", opts.preset] if opts.preset else []) + list(rest)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS=str(opts.threads),
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log_file, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    if proc.returncode != 0:
        with open(log_file) as log:
            tail = log.read()[-6000:]
        raise SystemExit(f"train_throughput: the {side} side failed (exit {proc.returncode}):\n{tail}")
    with open(result_file) as f:
        return json.load(f)


def summarize(windows, tokens_per_step, flops_per_step, peak):
    med = statistics.median(windows)
    q = statistics.quantiles(windows, n=4) if len(windows) >= 2 else [med, med, med]
    tflops = flops_per_step / med / 1e12
    return {"step_s_median": med, "step_s_min": min(windows), "step_s_max": max(windows),
            "step_s_iqr": [q[0], q[2]], "timed_steps": len(windows), "tokens_per_s": tokens_per_step / med,
            "tflops_per_device": tflops, "mfu": tflops / peak if peak else None}


def parent_main(opts, rest):
    from megatron.training.training_log import num_floating_point_operations

    opts.threads = opts.threads or os.cpu_count()
    torch.set_num_threads(opts.threads)
    args = parsed_megatron_args(megatron_argv(opts, rest))
    if not opts.no_hf:
        check_gpt2_architecture(args)
    tokens_per_step = args.global_batch_size * args.seq_length
    flops_per_step = num_floating_point_operations(args, args.global_batch_size)
    dev_name, peak, peak_note = device_peak(opts.threads)

    runs = {"ours": [], "hf": []}
    with tempfile.TemporaryDirectory(prefix="train_throughput_") as workdir:
        init_file = os.path.join(workdir, "init_weights.pt")
        for r in range(opts.rounds):
            runs["ours"].append(run_side("ours", opts, rest, workdir, init_file, r))
            if not opts.no_hf:
                runs["hf"].append(run_side("hf", opts, rest, workdir, init_file, r))

    results = {"config": {
        "num_layers": args.num_layers, "hidden_size": args.hidden_size, "num_attention_heads": args.num_attention_heads,
        "ffn_hidden_size": args.ffn_hidden_size, "seq_length": args.seq_length,
        "micro_batch_size": args.micro_batch_size, "global_batch_size": args.global_batch_size,
        "padded_vocab_size": args.padded_vocab_size, "precision": "bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32"),
        "preset": opts.preset, "threads": opts.threads, "warmup_steps": opts.warmup_steps,
        "train_iters": opts.train_iters, "rounds": opts.rounds, "steps_per_window": opts.steps_per_window},
        "parallel_layout": f"1 process: TP {args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size}"
                           f" x DP {args.data_parallel_size}, {args.global_batch_size // args.micro_batch_size} micro-batch(es)",
        "device": dev_name, "peak_tflops": peak, "peak_note": peak_note, "flops_formula": FORMULA,
        "flops_per_step": flops_per_step, "tokens_per_step": tokens_per_step}
    for side, rs in runs.items():
        if not rs:
            continue
        windows = [w for r in rs for w in r["windows_s"]]
        results[side] = dict(rs[0], **summarize(windows, tokens_per_step, flops_per_step, peak),
                             peak_memory_bytes=max(r["peak_memory_bytes"] for r in rs))
        results[side].pop("windows_s")
        results[side]["windows_s"] = windows
    if runs["hf"]:
        o, h = results["ours"], results["hf"]
        results["ratio_tokens_per_s"] = o["tokens_per_s"] / h["tokens_per_s"]
        results["ratio_peak_memory"] = o["peak_memory_bytes"] / h["peak_memory_bytes"]
        results["loss_step0_rel_diff"] = abs(o["loss_step0"] - h["loss_step0"]) / abs(h["loss_step0"])
    print(format_table(results))
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"results written to {opts.json_out}")
    return results


def format_table(res):
    c = res["config"]
    o, h = res.get("ours"), res.get("hf")
    lines = [
        f"GPT {c['num_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads, ffn "
        f"{c['ffn_hidden_size']}, seq {c['seq_length']}, micro-batch {c['micro_batch_size']}, global batch "
        f"{c['global_batch_size']}, padded vocab {c['padded_vocab_size']}, {c['precision']}",
        f"layout: {res['parallel_layout']}; device: {res['peak_note']}",
        f"timing: {c['warmup_steps']} warm-up + {c['train_iters']} timed steps x {c['rounds']} round(s), "
        f"{c['threads']} torch threads; FLOPs/step {res['flops_per_step']:.4g} ({res['flops_formula']})",
    ]
    cols = [("ours", o)] + ([("HF GPT2LMHeadModel", h)] if h else [])
    rows = [
        ("tokens/s (median)", lambda r: f"{r['tokens_per_s']:.1f}", "ratio_tokens_per_s"),
        ("step ms median [IQR] (min-max)", lambda r: f"{r['step_s_median'] * 1e3:.1f} [{r['step_s_iqr'][0] * 1e3:.0f}-"
         f"{r['step_s_iqr'][1] * 1e3:.0f}] ({r['step_s_min'] * 1e3:.0f}-{r['step_s_max'] * 1e3:.0f})", None),
        ("TFLOP/s per device", lambda r: f"{r['tflops_per_device']:.4f}", None),
        ("MFU", lambda r: "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f} %", None),
        ("peak memory (MB)", lambda r: f"{r['peak_memory_bytes'] / 2**20:.0f}", "ratio_peak_memory"),
        ("theoretical memory (MB)", lambda r: f"{r['theoretical_memory_bytes'] / 2**20:.0f}"
         if "theoretical_memory_bytes" in r else "-", None),
        ("step-0 loss", lambda r: f"{r['loss_step0']:.6f}", None),
        ("last loss", lambda r: f"{r['loss_last']:.6f}", None),
        ("precision", lambda r: r["precision"], None),
        ("optimizer", lambda r: r["optimizer"], None),
    ]
    width = [34] + [max(24, max(len(fmt(r)) for _, fmt, _ in rows) + 2) for _, r in cols]
    lines.append("".join(f"{t:<{w}s}" for t, w in zip([""] + [n for n, _ in cols] + (["ours/HF"] if h else []), width + [10])))
    for label, fmt, ratio in rows:
        cells = [fmt(r) for _, r in cols]
        extra = [f"{res[ratio]:.3f}"] if h and ratio else []
        lines.append(f"{label:<34s}" + "".join(f"{cell:<{w}s}" for cell, w in zip(cells, width[1:])) + "".join(extra))
    lines.append(f"peak memory is {o['peak_memory_kind']} of each side's own process")
    if h:
        tol = 1e-4 if c["precision"] == "fp32" else 2e-2
        verdict = "OK" if res["loss_step0_rel_diff"] <= tol else "MISMATCH"
        lines.append(f"sanity: step-0 loss ours {o['loss_step0']:.6f} vs HF {h['loss_step0']:.6f}, relative difference "
                     f"{res['loss_step0_rel_diff']:.2e} (tolerance {tol:g}): {verdict}")
    return "\n".join(lines)


def main(argv=None):
    opts, rest = bench_parser().parse_known_args(argv)
    if opts.side:
        child_main(opts, rest)
    else:
        parent_main(opts, rest)


if __name__ == "__main__":
    main()

"""CPU benchmark: one optimizer step of megatron.core.optimizer vs a plain torch.optim.AdamW step.

    PYTHONPATH=$PWD python benchmarks/bench_optimizer.py [--params-millions 20] [--iters 20] [--threads 2]

The model is a stack of square nn.Linear layers with LayerNorms (~20M parameters by default). Gradients
are random and fixed; only the optimizer step is timed (median over ``--iters`` steps after warmup, the
implementations timed in turn so that load from other processes affects all of them alike):

* ``torch AdamW (default)``: the baseline, a plain ``torch.optim.AdamW(params).step()`` on fp32 params
  (on CPU torch picks its per-tensor loop implementation by default);
* ``torch AdamW (foreach)`` / ``(fused)``: torch's other two implementations; ours uses the fused kernel
  (apex FusedAdam on CUDA when installed), so the last column is the framework's own overhead;
* ``ours fp32``: FP32Optimizer over the DDP gradient buffer, without and with clipping (--clip-grad 1.0
  adds a global-norm reduction and a rescale, as Megatron's default does);
* ``ours bf16``: bf16 model params with fp32 main params and fp32 grad buffer (Megatron's bf16 setup):
  step = grad hand-over, clip, AdamW on the fp32 main params, copy back to bf16.
"""
from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402


def build_model(params_millions: float, hidden: int = 1024) -> torch.nn.Module:
    per_layer = hidden * hidden + 3 * hidden  # weight + bias + LayerNorm weight and bias
    layers = max(1, round(params_millions * 1e6 / per_layer))
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.LayerNorm(hidden)]
    return torch.nn.Sequential(*mods)


def time_interleaved(step_fns: dict, iters: int, warmup: int = 3) -> dict:
    """Median ms per step of each function, timed round-robin (rotating the order every round) so that
    load from other processes on a shared machine hits every implementation alike."""
    names = list(step_fns)
    samples = {name: [] for name in names}
    for round_ in range(warmup + iters):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            t0 = time.perf_counter()
            step_fns[name]()
            elapsed = (time.perf_counter() - t0) * 1e3
            if round_ >= warmup:
                samples[name].append(elapsed)
    return {name: statistics.median(v) for name, v in samples.items()}


def fill_grads(params, seed=0):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-millions", type=float, default=20.0)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    os.environ.setdefault("MEGATRON_FORCE_CPU", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    parallel_state.initialize_model_parallel()

    torch.manual_seed(1234)
    base = build_model(args.params_millions)
    n_params = sum(p.numel() for p in base.parameters())
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    lr, wd = 1e-4, 0.01
    steps = {}

    # Baselines: plain torch AdamW over the same decay / no-decay groups.
    for label, kwargs in (("torch AdamW (default), fp32", {}),
                          ("torch AdamW (foreach), fp32", {"foreach": True}),
                          ("torch AdamW (fused), fp32", {"fused": True})):
        model = copy.deepcopy(base)
        decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.ndim == 1)]
        no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.ndim == 1]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=lr, **kwargs)
        fill_grads(model.parameters())
        steps[label] = opt.step

    def ours(label, dtype, clip):
        module = copy.deepcopy(base).to(dtype)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
        model = DistributedDataParallel(config, ddp_config, module)
        cfg = OptimizerConfig(lr=lr, weight_decay=wd, clip_grad=clip, bf16=dtype == torch.bfloat16)
        opt = get_megatron_optimizer(cfg, [model])
        g = torch.Generator().manual_seed(0)
        for p in module.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=g) * 1e-3)

        def step():
            ok, _, _ = opt.step()
            assert ok

        steps[label] = step

    ours("ours FP32Optimizer, fp32, no clip", torch.float32, 0.0)
    ours("ours FP32Optimizer, fp32, clip 1.0", torch.float32, 1.0)
    ours("ours Float16Optimizer, bf16 + fp32 main, clip 1.0", torch.bfloat16, 1.0)

    medians = time_interleaved(steps, args.iters)
    rows = list(medians.items())
    baseline = medians["torch AdamW (default), fp32"]
    same_kernel = medians["torch AdamW (fused), fp32"]  # the kernel our optimizer uses on this machine
    print(f"\nOptimizer step on CPU: {n_params / 1e6:.1f}M parameters, {args.threads} threads, "
          f"median of {args.iters} steps, torch {torch.__version__}")
    width = max(len(r[0]) for r in rows)
    header = f"{'implementation':<{width}} | {'median ms':>9} | {'vs plain torch AdamW':>20} | "
    print(header + f"{'vs torch fused AdamW':>20}")
    print(f"{'-' * width}-+-{'-' * 9}-+-{'-' * 20}-+-{'-' * 20}")
    for label, ms in rows:
        print(f"{label:<{width}} | {ms:9.1f} | {ms / baseline:19.2f}x | {ms / same_kernel:19.2f}x")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

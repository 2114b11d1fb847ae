"""Benchmark: MoE layer tokens/s for both token dispatchers x both expert implementations, side by side.

    PYTHONPATH=$PWD python benchmarks/bench_moe.py [--world 2] [--tokens 2048] [--hidden 256] [--ffn 512] \
        [--experts 8] [--topk 2] [--iters 10] [--threads 1] [--dtype fp32|bf16] [--device cpu|cuda]

Runs ``--world`` gloo ranks (NCCL on CUDA) with expert parallelism EP = world; each rank holds ``--tokens``
tokens of a ``[s, b=1, h]`` batch and runs the MoE layer forward + backward (router with aux loss, dispatch, SwiGLU
experts, combine). The four variants (allgather / alltoall x SequentialMLP / GroupedMLP) are timed round-robin
(median of ``--iters`` after warmup), so load from other processes hits them alike; tokens/s counts every rank's
tokens. Grouped GEMM uses torch._grouped_mm where the device/dtype supports it (logged), else a padded bmm.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = [("allgather", False), ("allgather", True), ("alltoall", False), ("alltoall", True)]


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def worker(rank, args, port, out):
    torch.set_num_threads(args.threads)
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=args.world, timeout=timedelta(minutes=5))
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=args.world)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    dev = torch.device(args.device, rank if args.device == "cuda" else 0) if args.device == "cuda" else \
        torch.device("cpu")
    layers, step = {}, {}
    for dispatcher, grouped in VARIANTS:
        torch.manual_seed(0)
        config = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=4,
                                   ffn_hidden_size=args.ffn, gated_linear_unit=True, activation_func=F.silu,
                                   add_bias_linear=False, num_moe_experts=args.experts, moe_router_topk=args.topk,
                                   moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type=dispatcher,
                                   moe_grouped_gemm=grouped, expert_model_parallel_size=args.world,
                                   params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=True)
        layer = MoELayer(config, MoESubmodules(experts=GroupedMLP if grouped else SequentialMLP)).to(dev).train()
        name = f"{dispatcher:9s} {'GroupedMLP' if grouped else 'SequentialMLP':13s}"
        layers[name] = layer
        x = torch.randn(args.tokens, 1, args.hidden, dtype=dtype, device=dev, generator=None)

        def run(layer=layer, x=x):
            inp = x.detach().requires_grad_()
            out, _ = layer(inp)
            out.float().square().mean().backward()
            if args.device == "cuda":
                torch.cuda.synchronize()
        step[name] = run
    names = list(step)
    samples = {n: [] for n in names}
    for round_ in range(args.warmup + args.iters):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for n in order:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            step[n]()
            elapsed = time.perf_counter() - t0
            t = torch.tensor([elapsed])
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)  # the slowest rank sets the pace
            if round_ >= args.warmup:
                samples[n].append(t.item())
    if rank == 0:
        out.put({n: statistics.median(v) for n, v in samples.items()})
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    result = out.get(timeout=1800)
    for p in procs:
        p.join()
    total_tokens = args.tokens * args.world
    print(f"MoE layer forward+backward, {args.world} ranks (EP={args.world}), {args.tokens} tokens/rank, "
          f"h={args.hidden}, ffn={args.ffn}, E={args.experts}, top-{args.topk}, {args.dtype} on {args.device}, "
          f"{args.threads} thread(s)/rank")
    print(f"{'dispatcher':9s} {'experts':13s} {'ms/step':>9s} {'tokens/s':>11s}")
    for name, seconds in result.items():
        print(f"{name} {seconds * 1e3:9.1f} {total_tokens / seconds:11.0f}")


if __name__ == "__main__":
    main()

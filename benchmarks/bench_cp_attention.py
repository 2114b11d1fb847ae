"""CPU benchmark: context-parallel attention (megatron.core.transformer.context_parallel) vs CP=1, side by side.

    python benchmarks/bench_cp_attention.py [--seq 2048] [--heads 8] [--groups 8] [--head-dim 64] [--batch 1]
                                            [--cp 2 4] [--iters 5] [--threads 1] [--device cpu]

One causal self-attention forward + backward over ``--seq`` tokens. CP=1 rows run in this process on the whole
sequence: ``sdpa`` is ``torch.nn.functional.scaled_dot_product_attention`` (what the model uses without CP) and
``blockwise`` is the explicit fp32 math of the CP module on one block. CP=N rows start N gloo processes, each
holding ``seq / N`` tokens (chunks r and 2N-1-r); the time is the slowest rank's median, and "x CP=1 sdpa" is the
ratio to the sdpa row (below 1 = faster than one process doing the whole sequence). Each process uses
``--threads`` threads, so CP=N uses N x threads cores: on a machine with fewer cores the ranks share them and the
numbers show the communication and bookkeeping cost rather than a speed-up. ``--device cuda`` (with as many GPUs
as the largest CP) runs the same on GPUs with NCCL.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inputs(args, seq, device):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(seq, args.batch, args.heads, args.head_dim, generator=g)
    k = torch.randn(seq, args.batch, args.groups, args.head_dim, generator=g)
    v = torch.randn(seq, args.batch, args.groups, args.head_dim, generator=g)
    return [t.to(device).requires_grad_() for t in (q, k, v)]


def _time(fn, iters, device, barrier=None):
    samples = []
    for i in range(iters + 2):
        if barrier is not None:
            barrier()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _sdpa_step(q, k, v):
    rep = q.size(2) // k.size(2)
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    out.sum().backward()


def _blockwise_step(q, k, v):
    from megatron.core.transformer.context_parallel import block_attention

    rep = q.size(2) // k.size(2)
    qh = q.permute(1, 2, 0, 3).float()
    kh, vh = (t.permute(1, 2, 0, 3).float().repeat_interleave(rep, dim=1) for t in (k, v))
    out, _ = block_attention(qh, kh, vh, 1.0 / q.size(-1) ** 0.5, 0)
    out.sum().backward()


def _rank(rank, world, port, args, comm, results):
    torch.set_num_threads(args.threads)
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                                         init_method=f"tcp://127.0.0.1:{port}")
    from megatron.core.transformer.context_parallel import context_parallel_attention
    from megatron.core.utils import context_parallel_chunk_indices

    group = torch.distributed.group.WORLD
    idx = context_parallel_chunk_indices(args.seq, world, rank)
    q, k, v = (t.detach()[idx.to(t.device)].requires_grad_() for t in _inputs(args, args.seq, device))

    def step():
        out = context_parallel_attention(q, k, v, group=group, global_ranks=list(range(world)), comm_type=comm,
                                         causal=True)
        out.float().sum().backward()

    ms = _time(step, args.iters, device, barrier=torch.distributed.barrier)
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    if rank == 0:
        results.put(t.item())
    torch.distributed.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cp(args, cp, comm):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, cp, port, args, comm, results)) for r in range(cp)]
    for p in procs:
        p.start()
    value = results.get(timeout=600)
    for p in procs:
        p.join()
    return value


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8, help="key/value heads (grouped-query attention)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--comm", nargs="+", default=["p2p", "all_gather", "a2a"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rows = []
    q, k, v = _inputs(args, args.seq, args.device)
    base = _time(lambda: _sdpa_step(q, k, v), args.iters, args.device)
    rows.append(("1", "sdpa (no CP)", base))
    rows.append(("1", "blockwise fp32", _time(lambda: _blockwise_step(q, k, v), args.iters, args.device)))
    for cp in args.cp:
        for comm in args.comm:
            rows.append((str(cp), comm, run_cp(args, cp, comm)))

    print(f"causal attention fwd+bwd: seq {args.seq}, batch {args.batch}, heads {args.heads} (kv {args.groups}), "
          f"head dim {args.head_dim}, {args.threads} thread(s) per process, {args.device}, "
          f"{os.cpu_count()} cores visible")
    print(f"{'CP':>3}  {'implementation':<16} {'ms / step':>10} {'x CP=1 sdpa':>12}")
    for cp, name, ms in rows:
        print(f"{cp:>3}  {name:<16} {ms:>10.2f} {ms / base:>12.2f}")


if __name__ == "__main__":
    main()

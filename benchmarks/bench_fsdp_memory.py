"""Per-rank memory of the data-parallel sharding strategies, measured against the formulas, at DP = 1, 2, 4, 8.

    PYTHONPATH=$PWD python benchmarks/bench_fsdp_memory.py [--dp 1 2 4 8] [--layers 4] [--hidden 256] \
        [--heads 8] [--ffn 1024] [--vocab 4096] [--seq 64] [--dtype bf16|fp32]

For each strategy (no_shard = DDP, optim = ZeRO-1 / the distributed optimizer, optim_grads = ZeRO-2,
optim_grads_params = ZeRO-3, all through megatron.core.distributed.fsdp.FullyShardedDataParallel) and each DP
size, DP gloo ranks build the same GPT model (megatron-core, local spec, SwiGLU, untied embeddings), wrap it,
build the optimizer (Adam) and train one step of two micro-batches. After the step every rank sums the storages
that its parameters, gradients and optimizer state hold (megatron.core.distributed.memory, padding included) and
the largest rank is printed next to megatron/training/theoretical_memory.py's bytes per parameter x the model's
parameter count. Activations and the transient buffers of one unit's collectives are not part of either number.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import types
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
KINDS = ("weights", "grads", "optimizer")


def worker(rank, world, rendezvous, opts, strategy, out):
    torch.set_num_threads(1)
    devnull = os.open(os.devnull, os.O_WRONLY)  # the library's log lines would interleave with the table
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                         timeout=timedelta(minutes=5))
    import torch.nn.functional as F

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.distributed.fsdp import FullyShardedDataParallel
    from megatron.core.distributed.memory import resident_state_bytes
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    bf16 = opts.dtype == "bf16"
    config = TransformerConfig(num_layers=opts.layers, hidden_size=opts.hidden, num_attention_heads=opts.heads,
                               ffn_hidden_size=opts.ffn, gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bf16=bf16,
                               params_dtype=torch.bfloat16 if bf16 else torch.float32, use_cpu_initialization=True)
    model = GPTModel(config, get_gpt_layer_local_spec(), opts.vocab, opts.seq,
                     share_embeddings_and_output_weights=False)
    numel = sum(p.numel() for p in model.parameters())
    if bf16 and strategy in ("no_shard", "optim"):
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_megatron_fsdp=True,
                                               data_parallel_sharding_strategy=strategy)
    chunk = FullyShardedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=bf16, clip_grad=1.0,
                                                       use_distributed_optimizer=strategy == "optim"), [chunk])
    g = torch.Generator().manual_seed(rank)
    chunk.zero_grad_buffer()
    optimizer.zero_grad()
    for micro in range(2):
        tokens = torch.randint(0, opts.vocab, (1, opts.seq + 1), generator=g)
        pos = torch.arange(opts.seq).unsqueeze(0)
        mask = torch.triu(torch.ones(1, 1, opts.seq, opts.seq, dtype=torch.bool), 1)
        context = chunk.no_sync() if micro == 0 else _null()
        with context:
            chunk(tokens[:, :-1], pos, mask, labels=tokens[:, 1:]).float().mean().backward()
    finalize_model_grads([chunk])
    optimizer.step()
    measured = resident_state_bytes([chunk], optimizer)
    out.put((rank, numel, measured))
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def measure(opts, strategy, dp):
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    rendezvous = os.path.join(tempfile.mkdtemp(prefix="bench_fsdp_memory_"), "store")  # a FileStore: no free port
    procs = [ctx.Process(target=worker, args=(r, dp, rendezvous, opts, strategy, out)) for r in range(dp)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"{strategy} at DP={dp}: a rank exited with {p.exitcode}")
    numel = results[0][1]
    peak = {k: max(r[2][k] for r in results) for k in KINDS}
    return numel, peak


def formula(opts, strategy, dp, numel):
    from megatron.training.theoretical_memory import bytes_per_parameter

    args = types.SimpleNamespace(fp16=False, bf16=opts.dtype == "bf16", optimizer="adam", sgd_momentum=0.0,
                                 accumulate_allreduce_grads_in_fp32=True, data_parallel_size=dp,
                                 context_parallel_size=1)
    per_param = bytes_per_parameter(args, False, strategy)
    return {k: per_param[k] * numel for k in KINDS}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    opts = p.parse_args()
    print(f"GPT {opts.layers} layers, hidden {opts.hidden}, SwiGLU ffn {opts.ffn}, vocab {opts.vocab}, {opts.dtype} "
          "(fp32 main weights and gradients), Adam; bytes of the largest rank after one step (MiB), measured / "
          "formula")
    print("strategy            DP  params     weights            grads              optimizer          total"
          "              bytes/param")
    for strategy in STRATEGIES:
        for dp in opts.dp:
            numel, got = measure(opts, strategy, dp)
            want = formula(opts, strategy, dp, numel)
            cells = "  ".join(f"{got[k] / 2**20:7.2f} / {want[k] / 2**20:7.2f}" for k in KINDS)
            total, total_want = sum(got.values()), sum(want.values())
            print(f"{strategy:18s}  {dp:2d}  {numel / 1e6:5.2f}M  {cells}  {total / 2**20:7.2f} / "
                  f"{total_want / 2**20:7.2f}  {total / numel:5.2f} / {total_want / numel:5.2f}", flush=True)


if __name__ == "__main__":
    main()

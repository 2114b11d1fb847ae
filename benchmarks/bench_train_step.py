"""Framework overhead of one training step on CPU: our stack against a plain PyTorch loop, same model.

    python benchmarks/bench_train_step.py [--layers 4 --hidden 256 --heads 8 --seq 256 --mbs 4 --steps 20]

Both columns train the same legacy GPTModel (TP=PP=DP=1, fp32) on the same random batches:

* ours:  DistributedDataParallel (contiguous grad buffer) + get_megatron_optimizer (Adam, clip 1.0) +
         forward_backward_no_pipelining + finalize_model_grads, i.e. what ``train_step`` runs;
* plain: ``loss = model(...); loss.backward(); clip_grad_norm_; torch.optim.AdamW(fused).step()``.

Prints a side-by-side table of median milliseconds per step and the overhead in percent. Run on an
otherwise idle machine; the first steps are warm-up and are not timed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def build(args):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer import TransformerConfig
    from megatron.legacy.model import GPTModel

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)
    config.padded_vocab_size = args.vocab
    config.max_position_embeddings = args.seq
    torch.manual_seed(0)
    return config, GPTModel(config)


def batches(args, n):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, args.vocab, (args.mbs, args.seq + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def position_ids(args):
    return torch.arange(args.seq).unsqueeze(0).expand(args.mbs, -1)


def run_plain(args, data):
    _, model = build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    pos = position_ids(args)
    times = []
    for i, (tokens, labels) in enumerate(data):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    return times[args.warmup:], loss.item()


def run_ours(args, data):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config, model = build(args)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.01, clip_grad=1.0),
                                 [model])
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    pos = position_ids(args)
    fb = get_forward_backward_func()
    it = iter(data)

    def forward_step(data_iterator, m):
        tokens, labels = next(data_iterator)
        out = m(tokens, pos, None, labels=labels)
        return out, lambda output: (output.float().mean(), {"lm loss": output.float().mean().detach()})

    times, loss = [], None
    for _ in range(len(data)):
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        opt.zero_grad()
        losses = fb(forward_step_func=forward_step, data_iterator=it, model=[model], num_microbatches=1,
                    seq_length=args.seq, micro_batch_size=args.mbs, forward_only=False)
        opt.step()
        times.append(time.perf_counter() - t0)
        loss = float(losses[0]["lm loss"])
    return times[args.warmup:], loss


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MEGATRON_FORCE_CPU", "1")
    data = batches(args, args.steps + args.warmup)

    # Alternate the two runs twice so that machine-load drift hits both columns alike.
    plain, ours = [], []
    for _ in range(2):
        t, plain_loss = run_plain(args, data)
        plain += t
        t, ours_loss = run_ours(args, data)
        ours += t
    med_plain, med_ours = statistics.median(plain), statistics.median(ours)
    tokens = args.mbs * args.seq
    print(f"GPT {args.layers}L h{args.hidden} s{args.seq} mbs{args.mbs} vocab{args.vocab}, fp32, CPU "
          f"{args.threads} threads, {len(plain)} timed steps each")
    print(f"{'':28s}{'plain PyTorch':>16s}{'ours (train_step)':>20s}")
    print(f"{'median ms / step':28s}{med_plain * 1e3:16.1f}{med_ours * 1e3:20.1f}")
    print(f"{'tokens / s':28s}{tokens / med_plain:16.0f}{tokens / med_ours:20.0f}")
    print(f"{'final loss':28s}{plain_loss:16.4f}{ours_loss:20.4f}")
    print(f"framework overhead: {100.0 * (med_ours / med_plain - 1.0):+.1f}% (ours / plain = {med_ours / med_plain:.3f})")


if __name__ == "__main__":
    main()

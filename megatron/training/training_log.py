"""The iteration log line, TensorBoard scalars and the FLOPs count behind the throughput figure."""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from megatron.core import device
from megatron.training.global_vars import get_args, get_num_microbatches, get_tensorboard_writer, get_timers
from megatron.training.utils import print_rank_last, report_memory

# Timers reported every log interval, in Megatron's order.
TIMERS_TO_LOG = [
    "forward-backward", "forward-compute", "backward-compute", "batch-generator", "forward-recv", "forward-send",
    "backward-recv", "backward-send", "forward-send-forward-recv", "forward-send-backward-recv",
    "backward-send-forward-recv", "backward-send-backward-recv", "forward-backward-send-forward-backward-recv",
    "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync", "params-all-gather",
    "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad",
    "optimizer-count-zeros", "optimizer-inner-step", "optimizer-copy-main-to-model-params", "optimizer",
]


def num_floating_point_operations(args, batch_size: int) -> float:
    """Model FLOPs of one training iteration (forward + backward) for ``batch_size`` sequences.

    Megatron's formula: ``12 B s L h^2 (1 + (ffn/h) * glu + g/n + s/h + V/(2 L h))`` with ``glu = 3/2`` for
    swiglu and ``g/n`` the query-group ratio (1 without GQA). With MoE the ``ffn/h`` term counts the active
    experts as Megatron does: ``topk * moe_ffn + shared`` per MoE layer (``ffn`` per dense layer), averaged over
    the layers.
    """
    gated = 1.5 if getattr(args, "swiglu", False) else 1.0
    query_group_ratio = 1.0
    if getattr(args, "group_query_attention", False):
        query_group_ratio = args.num_query_groups / args.num_attention_heads
    h, s, num_layers = args.hidden_size, args.seq_length, args.num_layers
    ffn = args.ffn_hidden_size
    vocab = getattr(args, "padded_vocab_size", None) or 0
    # Mixture of experts: each token runs k routed experts of width moe_ffn (+ the shared experts) in MoE layers,
    # so the MLP term is the layer-average (ffn per dense layer, k * moe_ffn + shared per MoE layer) / h.
    mlp = ffn / h
    if getattr(args, "num_experts", None):
        freq = getattr(args, "moe_layer_freq", 1)
        moe_layers = sum(1 for i in range(num_layers) if (i % freq == 0 if isinstance(freq, int) else freq[i]))
        moe_ffn = getattr(args, "moe_ffn_hidden_size", None) or ffn
        shared = getattr(args, "moe_shared_expert_intermediate_size", None) or 0
        routed = args.moe_router_topk * moe_ffn + shared
        mlp = ((num_layers - moe_layers) * ffn + moe_layers * routed) / (num_layers * h)
    return (12 * batch_size * s * num_layers * h * h
            * (1 + mlp * gated + query_group_ratio + s / h + vocab / (2 * num_layers * h)))


def format_tflops(value: float) -> str:
    """TFLOP/s for the log line: Megatron's ``{:.1f}`` from 10 up, two significant digits below 10.

    A CPU run does 0.01-1 TFLOP/s, which ``{:.1f}`` prints as ``0.0``; fixed notation keeps the field a plain
    decimal number (``0.031``, ``0.52``, ``3.4``, ``123.4``), at most 6 decimals.
    """
    if not math.isfinite(value) or value >= 10.0 or value <= 0.0:
        return "{:.1f}".format(value)
    decimals = min(6, max(1, 1 - math.floor(math.log10(value))))
    return "{:.{}f}".format(value, decimals)


def format_eta(seconds: float) -> str:
    """Seconds as ``H:MM:SS`` (hours unbounded), for the time-to-finish field."""
    seconds = max(0, int(round(seconds)))
    return "{:d}:{:02d}:{:02d}".format(seconds // 3600, seconds // 60 % 60, seconds % 60)


class LogState:
    """Counters accumulated between two log lines (Megatron keeps these in ``total_loss_dict``)."""

    def __init__(self):
        self.losses: Dict[str, float] = {}
        self.advanced_iters = 0
        self.skipped_iters = 0
        self.nan_iters = 0
        self.report_memory = True

    def reset(self):
        self.losses = {}
        self.advanced_iters = self.skipped_iters = self.nan_iters = 0


def _accumulate(state: LogState, loss_dict: Dict[str, torch.Tensor], skipped_iter: int) -> None:
    # Losses stay on the device between log steps (float() would wait for the GPU every iteration). They are
    # summed in float64, which gives exactly the sums of Python floats that a per-iteration float() would.
    if not skipped_iter:
        state.advanced_iters += 1
        for key, value in loss_dict.items():
            value = value.detach().double().reshape(()) if isinstance(value, torch.Tensor) else float(value)
            state.losses[key] = state.losses.get(key, 0.0) + value
    else:
        state.skipped_iters += 1
        if any(not math.isfinite(float(v)) for v in loss_dict.values()):
            state.nan_iters += 1


def _tensorboard_scalars(writer, args, iteration, learning_rate, batch_size, loss_dict, loss_scale, grad_norm,
                         num_zeros_in_grad, params_norm):
    samples = args.consumed_train_samples

    def add(name, value):
        writer.add_scalar(name, value, iteration)
        writer.add_scalar(name + " vs samples", value, samples)

    if args.log_learning_rate_to_tensorboard:
        add("learning-rate", learning_rate)
    if args.log_batch_size_to_tensorboard:
        add("batch-size", batch_size)
    for key, value in loss_dict.items():
        add(key, float(value))
    if args.log_loss_scale_to_tensorboard:
        add("loss-scale", loss_scale)
    if args.log_world_size_to_tensorboard:
        add("world-size", args.world_size)
    if grad_norm is not None:
        add("grad-norm", grad_norm)
    if num_zeros_in_grad is not None:
        add("num-zeros", num_zeros_in_grad)
    if params_norm is not None:
        add("params-norm", params_norm)
    if args.log_memory_to_tensorboard and device.on_gpu():
        writer.add_scalar("mem-allocated-bytes", device.memory_allocated(), iteration)


def training_log(state: LogState, loss_dict, learning_rate, iteration, loss_scale, skipped_iter, grad_norm,
                 params_norm, num_zeros_in_grad, wandb_run=None) -> Optional[str]:
    """Accumulate this iteration and, every ``--log-interval``, print Megatron's iteration line."""
    args = get_args()
    timers = get_timers()
    writer = get_tensorboard_writer()
    _accumulate(state, loss_dict, skipped_iter)
    batch_size = args.micro_batch_size * args.data_parallel_size * get_num_microbatches()

    if writer is not None and iteration % args.tensorboard_log_interval == 0:
        _tensorboard_scalars(writer, args, iteration, learning_rate, batch_size, loss_dict, float(loss_scale),
                             grad_norm, num_zeros_in_grad, params_norm)

    if iteration % args.log_interval != 0:
        return None

    # Log step: now the device values become Python numbers.
    loss_scale = float(loss_scale)
    state.losses = {key: float(value) for key, value in state.losses.items()}

    elapsed_time = timers("interval-time").elapsed(barrier=True)
    iters = max(state.advanced_iters + state.skipped_iters, 1)
    elapsed_per_iter = elapsed_time / iters
    line = " iteration {:8d}/{:8d} |".format(iteration, args.train_iters)
    line += " consumed samples: {:12d} |".format(args.consumed_train_samples)
    line += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_per_iter * 1000.0)
    # Not in Megatron's line: the time the remaining iterations take at this interval's pace.
    line += " time to finish (h:mm:ss): {} |".format(
        format_eta(elapsed_per_iter * max(args.train_iters - iteration, 0)))
    if args.log_throughput:
        flops = num_floating_point_operations(args, batch_size)
        tflops_per_gpu = flops / (elapsed_per_iter * 1e12 * args.world_size)
        tokens_per_second = batch_size * args.seq_length / elapsed_per_iter
        line += " throughput per GPU (TFLOP/s/GPU): {} |".format(format_tflops(tflops_per_gpu))
        line += " tokens per second: {:.1f} |".format(tokens_per_second)
        if writer is not None:
            writer.add_scalar("throughput", tflops_per_gpu, iteration)
    line += " learning rate: {:.3E} |".format(learning_rate)
    line += " global batch size: {:5d} |".format(batch_size)
    for key in sorted(state.losses):
        avg = state.losses[key] / max(state.advanced_iters, 1)
        if avg > 0.0:
            line += " {}: {:.6E} |".format(key, avg)
    line += " loss scale: {:.1f} |".format(loss_scale)
    if grad_norm is not None:
        line += " grad norm: {:.3f} |".format(grad_norm)
    if num_zeros_in_grad is not None:
        line += " num zeros: {:.1f} |".format(num_zeros_in_grad)
    if params_norm is not None:
        line += " params norm: {:.3f} |".format(params_norm)
    line += " number of skipped iterations: {:3d} |".format(state.skipped_iters)
    line += " number of nan iterations: {:3d} |".format(state.nan_iters)
    print_rank_last(line)
    if writer is not None and args.log_timers_to_tensorboard:
        writer.add_scalar("iteration-time", elapsed_per_iter, iteration)
    if wandb_run is not None:
        wandb_run.log({"lm_loss": state.losses.get("lm loss", 0.0) / max(state.advanced_iters, 1),
                       "learning_rate": learning_rate, "iteration_time": elapsed_per_iter}, step=iteration)
    if state.report_memory and learning_rate > 0:
        report_memory("(after {} iterations)".format(iteration))
        state.report_memory = False
    timers.log(TIMERS_TO_LOG, normalizer=args.log_interval)
    state.reset()
    return line

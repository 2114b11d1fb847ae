"""Rank-aware printing helpers of the training framework (more utilities join later)."""
from __future__ import annotations

import torch

from megatron.core.utils import unwrap_model  # noqa: F401  (its home is megatron.core.utils)
from megatron.core.utils import print_rank_0  # noqa: F401  (one implementation, at Megatron's import path)


def distributed_is_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_rank_0() -> bool:
    """True on global rank 0, and in a process without torch.distributed."""
    return not distributed_is_initialized() or torch.distributed.get_rank() == 0


def is_last_rank() -> bool:
    """True on the last global rank (where Megatron prints training logs), and without torch.distributed."""
    return not distributed_is_initialized() or torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def print_rank_last(message):
    """Print on the last rank only (or always, without torch.distributed or under --fake-process-group)."""
    from megatron.core.fake_process_group import is_fake_process_group

    if is_last_rank() or is_fake_process_group():
        print(message, flush=True)


# ------------------------------------------------------------------------------- model helpers

def calc_params_l2_norm(model) -> float:
    """L2 norm of all parameters, each counted once across TP (duplicates skipped) and summed over PP."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    if not isinstance(model, list):
        model = [model]
    sq = torch.zeros(1, dtype=torch.float64, device=_device())
    # Fully sharded chunks (FSDP2) hold disjoint blocks of every parameter over DP: sum over the world.
    sharded = any(getattr(chunk, "uses_fully_shard", False) for chunk in model)
    for chunk in model:
        for param in chunk.parameters():
            if getattr(param, "shared", False) and not parallel_state.is_pipeline_first_stage(ignore_virtual=True):
                continue  # the tied output copy of the embedding is counted on the first stage
            if param_is_not_tensor_parallel_duplicate(param) or (sharded and not getattr(param, "allreduce", True)):
                local = param.to_local() if hasattr(param, "to_local") else param
                sq += local.detach().double().pow(2).sum()
    torch.distributed.all_reduce(sq, group=None if sharded else parallel_state.get_model_parallel_group())
    return sq.sqrt().item()


def average_losses_across_data_parallel_group(losses):
    """Mean of each loss over the data-parallel group (the values reported in the log line)."""
    from megatron.core import parallel_state

    averaged = torch.cat([loss.clone().detach().view(1).float() for loss in losses])
    torch.distributed.all_reduce(averaged, group=parallel_state.get_data_parallel_group())
    return averaged / torch.distributed.get_world_size(group=parallel_state.get_data_parallel_group())


def report_memory(name):
    """Print accelerator memory use as Megatron does (nothing on CPU)."""
    from megatron.core import device

    stats = device.memory_stats_mb()
    if not stats:
        return
    string = name + " memory (MB)" + "".join(" | {}: {}".format(k, v) for k, v in stats.items())
    rank = torch.distributed.get_rank() if distributed_is_initialized() else 0
    if rank % 8 == 0:
        print("[Rank {}] {}".format(rank, string), flush=True)


def _device():
    from megatron.core import device

    return device.current_device()


def print_datetime(string):
    """Print ``[string] datetime: ...`` on rank 0 after a barrier, as Megatron marks phases."""
    import datetime

    if distributed_is_initialized():
        torch.distributed.barrier()
    time_str = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    print_rank_0("[" + string + "] datetime: {} ".format(time_str))


def get_ltor_masks_and_position_ids(data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Left-to-right masks of a batch ``data [b, s]`` (Megatron's ``megatron.training.utils`` function).

    Returns (attention_mask ``[b or 1, 1, s, s]`` bool with True = masked: causal, and with
    ``reset_attention_mask`` no attention across an EOD; loss_mask ``[b, s]`` float, 0 on EOD tokens with
    ``eod_mask_loss``; position_ids ``[b, s]``, restarting after every EOD with ``reset_position_ids``).
    """
    micro_batch_size, seq_length = data.size()
    att_mask_batch = micro_batch_size if reset_attention_mask else 1
    attention_mask = torch.tril(torch.ones((att_mask_batch, seq_length, seq_length), device=data.device))
    attention_mask = attention_mask.view(att_mask_batch, 1, seq_length, seq_length)
    loss_mask = torch.ones(data.size(), dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device).unsqueeze(0).expand_as(data)
    if reset_position_ids:
        position_ids = position_ids.clone()
    if reset_position_ids or reset_attention_mask:
        for b in range(micro_batch_size):
            eod_index = position_ids[b, data[b] == eod_token].tolist()
            prev_index = 0
            for i in eod_index:
                if reset_attention_mask:
                    attention_mask[b, 0, (i + 1):, :(i + 1)] = 0
                if reset_position_ids:
                    position_ids[b, (i + 1):] -= i + 1 - prev_index
                    prev_index = i + 1
    return attention_mask < 0.5, loss_mask, position_ids

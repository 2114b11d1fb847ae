"""``HybridCPDataLoaderWrapper``: the data side of hybrid context parallelism (megatron-core's ``data_schedule``).

Each ``next()``:

1. this DP rank takes a batch of packed samples (dicts with ``cu_seqlens``) from the wrapped iterator and lists
   the lengths of their non-empty sub-samples;
2. the lengths are all-gathered over the DP group; sub-sample ``k`` of DP rank ``d`` gets the global id
   ``offset_d + k`` (``offset_d``: the sub-samples of DP ranks before ``d``);
3. :class:`~megatron.core.pipeline_parallel.hybrid_cp_schedule.BalancedCPScheduler` assigns the ids to the
   DP x CP ranks, group by group (the same result on every rank);
4. the sub-samples travel to their ranks with one ``all_to_all_single`` per key over DP x CP: a rank sends its
   own sub-samples only to the DP x CP ranks that are also DP-group members (CP peers hold the same data), each
   destination's in increasing id order, concatenated along dim 0; it receives, per source rank, its assigned ids
   that source holds;
5. it returns ``({global id: sub-sample dict}, sample ids per rank of each group)``.

DP x CP ranks of the DP group are the DP group's global ranks divided by the TP size (the layout of
``parallel_state`` with TP innermost).
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch

from megatron.core import device, parallel_state
from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

_PER_SAMPLE_KEYS = ("cu_seqlens", "batch_idx", "max_seqlen")


class HybridCPDataLoaderWrapper:
    """Wrap ``data_iterator`` (module docstring). ``config.max_seqlen_per_dp_cp_rank`` sizes the scheduler;
    ``pg_collection`` (its ``dp_cp``, ``dp``, ``tp``) defaults to parallel_state's groups."""

    def __init__(self, data_iterator, config, pg_collection: Optional[object] = None):
        self.data_iterator = data_iterator
        self.config = config
        if pg_collection is None:
            self.dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            self.dp_group = parallel_state.get_data_parallel_group()
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
        else:
            self.dp_cp_group, self.dp_group, self.tp_group = pg_collection.dp_cp, pg_collection.dp, pg_collection.tp
        if self.dp_cp_group is None or self.dp_group is None or self.tp_group is None:
            raise AssertionError("dp_cp_group, dp_group, tp_group must not be None when using hybrid context "
                                 "parallel")
        self.cp_balancing_scheduler = BalancedCPScheduler(max_seq_len_per_rank=config.max_seqlen_per_dp_cp_rank,
                                                          dp_cp_group=self.dp_cp_group)
        self.total_hdp_gpus = self.dp_cp_group.size()

    def __iter__(self):
        return self

    def get_global_seqlens(self, subsample_seqlens: torch.Tensor) -> List[int]:
        """``(lengths of every DP rank's sub-samples, DP rank by DP rank, as a list; offsets)``: ``offsets[d]`` is
        the number of sub-samples of DP ranks before ``d`` (an int32 tensor)."""
        dev = device.current_device()
        dp_size = self.dp_group.size()
        count = torch.tensor([subsample_seqlens.shape[0]], dtype=torch.int32, device=dev)
        counts = [torch.zeros_like(count) for _ in range(dp_size)]
        torch.distributed.all_gather(counts, count, group=self.dp_group)
        counts = torch.cat(counts).cpu()
        longest = int(counts.max().item())
        padded = torch.zeros(longest, dtype=subsample_seqlens.dtype, device=dev)
        padded[:subsample_seqlens.shape[0]] = subsample_seqlens.to(dev)
        gathered = [torch.empty_like(padded) for _ in range(dp_size)]
        torch.distributed.all_gather(gathered, padded, group=self.dp_group)
        seqlens = torch.cat([g[:int(n)] for g, n in zip(gathered, counts.tolist())]).cpu().tolist()
        offsets = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(counts, 0, dtype=torch.int32)[:-1]])
        return seqlens, offsets

    def get_global_id_seqlens(self, num_local_subsamples, offsets, seqlens_gathered):
        """``([(global id, length)] of all sub-samples, the global ids held by this DP rank)``."""
        start = int(offsets[self.dp_group.rank()])
        global_ids = torch.arange(len(seqlens_gathered), dtype=torch.int32)
        return list(enumerate(seqlens_gathered)), global_ids[start:start + num_local_subsamples]

    def _gid_to_src_rank(self, gid: int, offsets: List[int]) -> int:
        """The DP x CP rank of the DP-group member that holds sub-sample ``gid``."""
        dp_rank = int(torch.bucketize(torch.tensor(gid), offsets[1:] - 1))
        return torch.distributed.get_process_group_ranks(self.dp_group)[dp_rank] // self.tp_group.size()

    def reroute_samples_to_hdp_ranks(self, batch, global_ids_this_rank, global_id_seqlens, sample_id_groups, offsets):
        """Send every sub-sample to the DP x CP ranks it was scheduled on (step 4 of the module docstring); return
        ``{global id: sub-sample dict}`` of this rank's."""
        dev = device.current_device()
        mine = {int(gid): i for i, gid in enumerate(global_ids_this_rank)}
        hdp_rank = self.dp_cp_group.rank()
        dp_peers = [r // self.tp_group.size() for r in torch.distributed.get_process_group_ranks(self.dp_group)]
        assigned = [sorted(gid for group in sample_id_groups for gid in group[d]) for d in range(self.total_hdp_gpus)]
        length = {gid: n for gid, n in global_id_seqlens}

        send_ids = [gid for d in dp_peers for gid in assigned[d] if gid in mine]
        send_splits = [sum(length[gid] for gid in assigned[d] if gid in mine) if d in dp_peers else 0
                       for d in range(self.total_hdp_gpus)]
        by_source = [[] for _ in range(self.total_hdp_gpus)]
        for gid in assigned[hdp_rank]:
            by_source[self._gid_to_src_rank(gid, offsets)].append(gid)
        recv_ids = [gid for ids in by_source for gid in ids]
        recv_splits = [sum(length[gid] for gid in ids) for ids in by_source]

        received = [{} for _ in recv_ids]
        for key in batch[0].keys():
            parts = [batch[mine[gid]][key].to(dev) for gid in send_ids]
            send = torch.cat(parts) if parts else torch.empty(0, dtype=batch[0][key].dtype, device=dev)
            recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=dev)
            torch.distributed.all_to_all_single(recv, send, output_split_sizes=recv_splits,
                                                input_split_sizes=send_splits, group=self.dp_cp_group)
            cursor = 0
            for i, gid in enumerate(recv_ids):
                received[i][key] = recv[cursor:cursor + length[gid]]
                cursor += length[gid]
        return dict(zip(recv_ids, received))

    def unpack_batch(self, batch):
        """The non-empty sub-samples of the packed samples, in order: every key but ``cu_seqlens``, ``batch_idx``,
        ``max_seqlen`` sliced to ``[cu_seqlens[i], cu_seqlens[i + 1])`` along dim 0."""
        out = []
        for sample in batch:
            bounds = sample["cu_seqlens"]
            for i in range(bounds.shape[0] - 1):
                start, end = bounds[i], bounds[i + 1]
                if end - start == 0:
                    continue
                out.append({key: value[start:end] for key, value in sample.items() if key not in _PER_SAMPLE_KEYS})
        return out

    def __next__(self) -> Any:
        """``(samples by global id, sample ids per rank of each group)``; ``(None, None)`` without an iterator
        (TP ranks other than the first)."""
        if self.data_iterator is None:
            return None, None
        batch = next(self.data_iterator)
        lengths = [int(s["cu_seqlens"][i + 1] - s["cu_seqlens"][i])
                   for s in batch for i in range(s["cu_seqlens"].shape[0] - 1)]
        lengths = torch.tensor(lengths, dtype=torch.int32)
        lengths = lengths[lengths != 0]
        seqlens, offsets = self.get_global_seqlens(lengths)
        global_id_seqlens, global_ids_this_rank = self.get_global_id_seqlens(lengths.shape[0], offsets, seqlens)
        _, sample_id_groups = self.cp_balancing_scheduler.get_groups_and_subsamples(global_id_seqlens, self.config)
        samples = self.reroute_samples_to_hdp_ranks(self.unpack_batch(batch), global_ids_this_rank,
                                                    global_id_seqlens, sample_id_groups, offsets)
        return samples, sample_id_groups

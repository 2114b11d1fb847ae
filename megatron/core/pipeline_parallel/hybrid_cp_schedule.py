"""Hybrid context parallelism: variable-length sub-samples scheduled over the DP x CP ranks (megatron-core's
``hybrid_cp_schedule``).

A sub-sample of length ``L`` runs on ``g(L) = max(1, 2**ceil(log2(L / max_seq_len_per_rank)))`` ranks (a power of
two, so that it maps onto the hybrid DP x CP groups of ``parallel_state``); its cost on each of them is estimated as
``W(L) = L**2 / g(L)`` (attention's quadratic term, shared by the group).

``BalancedCPScheduler.get_groups_and_subsamples`` sorts the sub-samples by length (longest first) and cuts them
into *groups*: within a group each rank runs its sub-samples without waiting for others; between groups all DP x CP
ranks meet at a barrier (their CP partners change). One group (``next_hdp_group``):

1. buckets: the sorted list is cut into as many consecutive buckets as there are distinct ``g`` values, each closed
   when it would exceed 1.1 x (total work / buckets), or when the remaining sub-samples are just enough for the
   remaining buckets;
2. placement: take the first sub-sample (scanning the buckets in order) that fits either an existing rank set of
   size ``g`` or ``g`` free ranks; put it on the least-loaded existing set of that size, unless ``g`` free ranks (the
   least loaded ones) have a strictly lower load, then they become a new set;
3. once a smaller ``g`` than the first sub-sample's appears, stop as soon as the loads are balanced
   (``max - min <= 5 % of max``) while sub-samples remain; those are left over for the next group;
4. trim: while unbalanced and no rank idle, drop the last sub-sample of the most loaded rank's set if that lowers
   ``max - min``;
5. fill: while a rank has nothing, the first set of the smallest size ``s`` grows to ``min(2 s, ranks)``
   consecutive ranks (later sets move up by ``s``; their per-rank load is recomputed as ``W`` of the set's first
   sub-sample on ``2 s`` ranks).

``hybrid_context_parallel_forward_backward`` runs one global batch of such groups on this rank: forward (and
backward) per sub-sample, a barrier over DP x CP after each group, gradient reduction held back until the last
sub-sample.
"""
from __future__ import annotations

from collections import deque
from math import ceil, log2
from typing import Callable, List, Optional, Tuple

import torch

from megatron.core import device, parallel_state
from megatron.core.rerun_state_machine import RerunDataIterator

_BALANCE_SLACK = 0.05
_BUCKET_OVERSHOOT = 1.1


class BalancedCPScheduler:
    """Groups of sub-samples with balanced per-rank work over the ``dp_cp_group`` ranks (module docstring)."""

    def __init__(self, max_seq_len_per_rank: int, dp_cp_group: torch.distributed.ProcessGroup):
        self.max_seq_len_per_rank = max_seq_len_per_rank
        self.num_subsamples = 0
        self.num_subsamples_processed = 0
        self.free_resources = []
        self.total_hdp_gpus = dp_cp_group.size()

    def get_total_workload(self, seq_length: int, cp_size: Optional[int] = None):
        """``L**2 / cp_size``, ``cp_size`` defaulting to :meth:`gpus_needed` (a relative cost, not FLOPs)."""
        return (seq_length * seq_length) / (self.gpus_needed(seq_length) if cp_size is None else cp_size)

    def gpus_needed(self, seq_len: int) -> int:
        """``max(1, 2**ceil(log2(seq_len / max_seq_len_per_rank)))``: the power-of-two rank count for ``seq_len``."""
        return max(1, 2 ** ceil(log2(seq_len / self.max_seq_len_per_rank)))

    def make_buckets_equal(self, sample_seqlens: List[Tuple[int, int]],
                           compute_estimator: Callable[[int], float]) -> List[deque]:
        """Cut ``(sample_id, length)`` pairs (in their order) into one bucket per distinct rank count (step 1 of the
        module docstring)."""
        num_buckets = len({self.gpus_needed(length) for _, length in sample_seqlens})
        target = sum(compute_estimator(length, self.gpus_needed(length)) for _, length in sample_seqlens) / num_buckets
        buckets, current, current_work, open_buckets = [], [], 0.0, num_buckets
        for position, (sample_id, length) in enumerate(sample_seqlens):
            work = compute_estimator(length)
            left = len(sample_seqlens) - position
            if current and (current_work + work > target * _BUCKET_OVERSHOOT or left <= open_buckets - len(buckets)):
                buckets.append(deque(current))
                current, current_work = [], 0.0
                open_buckets -= 1
            current.append((sample_id, length))
            current_work += work
        if current:
            buckets.append(deque(current))
        return buckets

    def next_hdp_group(self, sample_seqlens: List[Tuple[int, int]], compute_estimator: Callable[[int], float],
                       total_gpus: int, delta: float = 0.05, strategy: str = "dp", eps_bucket: float = 0.10,
                       ) -> Tuple[List[List[int]], List[Tuple[int, int]], List[float], List[List[int]]]:
        """One group (module docstring): ``(lengths per rank, left-over (id, length) pairs, load per rank,
        sample ids per rank)``. ``strategy="pp"`` scans the buckets round-robin instead of from the first."""
        lengths = [[] for _ in range(total_gpus)]
        loads = [0.0] * total_gpus
        ids = [[] for _ in range(total_gpus)]
        if not sample_seqlens:
            return lengths, [], loads, ids
        buckets = self.make_buckets_equal(sample_seqlens, compute_estimator)
        owner = [None] * total_gpus  # rank -> set id
        members, size = {}, {}  # set id -> ranks, rank count (in creation order)
        cursor, first_needed, check_balance = 0, None, False

        while buckets:
            order = (range(len(buckets)) if strategy == "dp"
                     else [(cursor + i) % len(buckets) for i in range(len(buckets))])
            chosen_bucket = None
            for b in order:
                if not buckets[b]:
                    continue
                needed = self.gpus_needed(buckets[b][0][1])
                free = sum(1 for o in owner if o is None)
                if any(s == needed for s in size.values()) or free >= needed:
                    chosen_bucket = b
                    break
            if chosen_bucket is None:
                break
            if strategy == "pp":
                cursor = (chosen_bucket + 1) % len(buckets)
            sample_id, length = buckets[chosen_bucket][0]
            needed = self.gpus_needed(length)
            first_needed = needed if first_needed is None else first_needed

            best, best_load = None, float("inf")
            for gid, s in size.items():
                load = max(loads[r] for r in members[gid])
                if s == needed and load < best_load:
                    best, best_load = gid, load
            free = sorted((r for r in range(total_gpus) if owner[r] is None), key=lambda r: loads[r])
            if len(free) >= needed and loads[free[needed - 1]] < best_load:
                best = len(size)
                members[best], size[best] = free[:needed], needed
                for r in free[:needed]:
                    owner[r] = best
            cost = compute_estimator(length)
            for r in members[best]:
                lengths[r].append(length)
                loads[r] += cost
                ids[r].append(sample_id)
            buckets[chosen_bucket].popleft()
            while buckets and not buckets[0]:
                buckets.pop(0)
                cursor %= max(1, len(buckets))
            check_balance = check_balance or needed < first_needed
            if check_balance and buckets and max(loads) - min(loads) <= delta * max(loads):
                break

        leftovers = [pair for bucket in buckets for pair in bucket]
        self._trim(lengths, loads, ids, owner, members, leftovers, compute_estimator, delta)
        before = sum(len(x) for x in lengths)
        while any(not x for x in lengths):
            lengths, loads, ids = self._fill_idle(lengths, loads, ids, members, size, total_gpus)
        if sum(len(x) for x in lengths) < before:
            raise AssertionError(f"Samples were removed: {before} -> {sum(len(x) for x in lengths)}")
        return lengths, leftovers, loads, ids

    @staticmethod
    def _trim(lengths, loads, ids, owner, members, leftovers, compute_estimator, delta):
        """Step 4 of the module docstring (in place)."""
        while True:
            top, bottom = max(loads), min(loads)
            if top - bottom <= delta * top or bottom == 0:
                return
            heaviest = loads.index(top)
            if len(lengths[heaviest]) <= 1:
                return
            group = members[owner[heaviest]]
            length = lengths[heaviest][-1]
            cost = compute_estimator(length)
            after = [load - cost if r in group else load for r, load in enumerate(loads)]
            if max(after) - min(after) >= top - bottom:
                return
            removed = ids[heaviest][-1]
            for r in group:
                lengths[r].pop()
                ids[r].pop()
                loads[r] -= cost
            leftovers.append((removed, length))

    def _fill_idle(self, lengths, loads, ids, members, size, total_gpus):
        """Step 5 of the module docstring: one widening; returns the new per-rank lists (``members`` / ``size``
        updated in place)."""
        if not size:
            raise AssertionError("There should be at least one group existing, cannot reditribute, try to increase "
                                 "'max-seqlen-per-cp-rank'.")
        smallest = min(size.values())
        wider = min(smallest * 2, total_gpus)
        extra = wider - smallest
        gid = next(g for g, s in size.items() if s == smallest)
        first, last = members[gid][0], members[gid][-1]
        idle = next(r for r in range(total_gpus) if not lengths[r])
        if all(lengths[idle:idle + extra]):
            raise AssertionError("Empty GPUs were detected but not enough to expand.")
        new_lengths, new_loads, new_ids = [[]] * total_gpus, [0.0] * total_gpus, [[]] * total_gpus
        for r in range(first):
            new_lengths[r], new_loads[r], new_ids[r] = lengths[r], loads[r], ids[r]
        for r in range(first, last + extra + 1):
            new_lengths[r], new_ids[r] = lengths[last], ids[last]
            new_loads[r] = self.get_total_workload(lengths[last][0], wider)
        for offset, r in enumerate(range(last + 1, idle)):
            target = last + extra + 1 + offset
            new_lengths[target], new_loads[target], new_ids[target] = lengths[r], loads[r], ids[r]
        size[gid] = wider
        members[gid] = list(range(first, last + extra + 1))
        for other in size:
            if other > gid:
                members[other] = [r + extra for r in members[other]]
        return new_lengths, new_loads, new_ids

    def get_groups_and_subsamples(self, sample_id_seqlens, config):
        """All groups of one global batch: ``(lengths per rank of each group, sample ids per rank of each
        group)`` from ``(sample_id, length)`` pairs, longest first (ties keep their order)."""
        pending = sorted(sample_id_seqlens, key=lambda pair: pair[1], reverse=True)
        groups, sample_id_groups = [], []
        while pending:
            lengths, pending, _, ids = self.next_hdp_group(pending, self.get_total_workload, self.total_hdp_gpus)
            groups.append(lengths)
            sample_id_groups.append(ids)
        return groups, sample_id_groups


def hybrid_context_parallel_forward_backward(forward_step_func, data_iterator, model, num_microbatches, input_tensor,
                                             output_tensor_grad, forward_data_store, config, collect_non_loss_data,
                                             first_val_step, forward_only, no_sync_func, total_num_tokens,
                                             check_first_val_step, model_type):
    """Run this rank's sub-samples of one global batch (module docstring); return ``(forward_data_store,
    total_num_tokens)``.

    On tensor-parallel rank 0, ``next(data_iterator)`` is ``(samples by id, sample ids per rank of each group)``
    (:class:`megatron.core.datasets.data_schedule.HybridCPDataLoaderWrapper`); the per-group sub-sample counts of
    this DP x CP rank are broadcast over the TP group. Each sub-sample reaches ``forward_step_func`` as a one-item
    ``RerunDataIterator`` of its dict with ``local_cp_size`` (how many ranks of the group run it) added; other TP
    ranks get None. Gradient reduction (``no_sync_func``) is held back until the last sub-sample. There is one
    stage (no pipeline); the loss uses parallel_state's context-parallel size.
    """
    from megatron.core.pipeline_parallel.schedules import backward_step, forward_step

    dev = device.current_device()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_src = parallel_state.get_tensor_model_parallel_src_rank()
    hdp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    first_tp_rank = parallel_state.get_tensor_model_parallel_rank() == 0
    samples, sample_id_groups = next(data_iterator) if first_tp_rank else (None, None)

    # How many sub-samples this rank runs in each group, from TP rank 0 to its TP peers.
    counts = (torch.tensor([len(group[hdp_rank]) for group in sample_id_groups], dtype=torch.int32, device=dev)
              if first_tp_rank else None)
    torch.distributed.barrier()
    num_groups = torch.tensor([0 if counts is None else counts.numel()], dtype=torch.int64, device=dev)
    torch.distributed.broadcast(num_groups, tp_src, group=tp_group)
    if int(num_groups.item()) <= 0:
        raise AssertionError("there should be at least 1 sub samples in the group")
    if counts is None:
        counts = torch.empty(int(num_groups.item()), dtype=torch.int32, device=dev)
    torch.distributed.broadcast(counts, tp_src, group=tp_group)
    counts = counts.cpu().tolist()

    def sub_sample(group_index, index):
        if not first_tp_rank:
            return None
        sample_id = sample_id_groups[group_index][hdp_rank][index]
        sample = samples[sample_id]
        partners = sum(1 for ids in sample_id_groups[group_index] if sample_id in ids)
        sample["local_cp_size"] = torch.tensor(partners, dtype=torch.int32)
        return RerunDataIterator(iter([sample]))

    cp_size = parallel_state.get_context_parallel_world_size()
    step = 0

    def run(group_index, index):
        nonlocal step, total_num_tokens
        output_tensor, num_tokens = forward_step(
            forward_step_func, sub_sample(group_index, index), model, num_microbatches, input_tensor,
            forward_data_store, config, cp_size, collect_non_loss_data,
            is_first_microbatch=check_first_val_step(first_val_step, forward_only, step == 0),
            current_microbatch=step, is_last_stage=True, after_split=False)
        step += 1
        total_num_tokens += num_tokens.item()
        if not forward_only:
            backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config)

    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    with no_sync_func():
        for group_index in range(len(counts) - 1):
            for index in range(counts[group_index]):
                run(group_index, index)
            # Every rank finishes the group before CP partners change.
            torch.distributed.barrier(dp_cp_group)
        for index in range(counts[-1] - 1):
            run(len(counts) - 1, index)
    # The last sub-sample runs outside no_sync, so that the gradient reduction happens once.
    run(len(counts) - 1, -1)
    return forward_data_store, total_num_tokens

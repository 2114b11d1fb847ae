"""Token dispatchers: move each token's hidden state to the ranks holding its experts, and back.

Both dispatchers return ``(permuted_tokens, tokens_per_expert, permuted_probs)``: rows grouped by local expert
(expert 0's rows first), their counts, and each row's routing weight (applied inside the expert). Combining is a
plain scatter-add of the expert outputs into their tokens.

* ``allgather`` (:class:`MoEAllGatherTokenDispatcher`): all-gather tokens, probabilities and the routing map
  over the expert tensor x expert model parallel group (``tp-ep``, size ETP x EP), keep the columns of the local
  experts, ``permute``; combine = ``unpermute`` into the gathered layout, then reduce-scatter over ``tp-ep``
  (which also sums the partial outputs of expert-tensor-parallel shards).
* ``alltoall`` (:class:`MoEAlltoAllTokenDispatcher`): ``permute`` the local tokens by expert (all E); the token
  counts are all-gathered over ``tp-ep`` into ``counts[ep, etp, e]``; ``input_splits[j]`` = rows for the
  experts of EP rank j, ``output_splits[i] = sum_{e local} counts[i, my_etp, e]``; ``all_to_all`` over the EP
  group; with ETP > 1 an all-gather over the expert-TP group (uneven sizes); then the chunks, ordered
  (etp source, ep source, local expert), are sorted to (local expert, etp source, ep source). Combine runs the
  inverse: unsort, reduce-scatter over expert TP, all-to-all back, ``unpermute``.

``token_permutation`` = ``dispatch_preprocess`` (local work) -> ``token_dispatch`` (the communication) ->
``dispatch_postprocess`` (local work), ``token_unpermutation`` = ``combine_preprocess`` -> ``token_combine`` ->
``combine_postprocess``: megatron-core's six stages, which its combined 1F1B schedule runs as separate nodes.
"""
from __future__ import annotations

from typing import List

import torch

from megatron.core.process_groups_config import pg_group
from megatron.core.transformer.moe.moe_utils import (
    all_to_all,
    gather_along_first_dim,
    permute,
    reduce_scatter_along_first_dim,
    sort_chunks_by_idxs,
    unpermute,
)


def _size(group) -> int:
    if group is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=group)


def _rank(group) -> int:
    if group is None or not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_rank(group=group)


class MoETokenDispatcher:
    """Common state: the expert groups (``pg_collection``'s ``tp_ep``, ``ep``, ``expt_tp``, else parallel_state's)
    and this rank's experts. ``(num_local_experts, local_expert_indices, config, pg_collection=None)``."""

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config, pg_collection=None):
        self.config = config
        self.pg_collection = pg_collection
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        self.tp_ep_group = pg_group(pg_collection, "tp_ep")
        self.ep_group = pg_group(pg_collection, "ep")
        self.etp_group = pg_group(pg_collection, "expt_tp")
        self.tp_ep_size = _size(self.tp_ep_group)
        self.ep_size = _size(self.ep_group)
        self.etp_size = _size(self.etp_group)
        self.etp_rank = _rank(self.etp_group)

    def token_permutation(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """dispatch_preprocess -> token_dispatch -> dispatch_postprocess: ``(tokens, tokens_per_expert,
        permuted_probs)``."""
        hidden_states, probs = self.dispatch_preprocess(hidden_states, routing_map, probs)
        hidden_states, probs = self.token_dispatch(hidden_states, probs)
        return self.dispatch_postprocess(hidden_states, probs)

    def token_unpermutation(self, expert_output: torch.Tensor, bias: torch.Tensor = None):
        """combine_preprocess -> token_combine -> combine_postprocess: the tokens' outputs in the input's shape."""
        if bias is not None:
            raise ValueError("expert biases are added inside the experts")
        return self.combine_postprocess(self.token_combine(self.combine_preprocess(expert_output)))


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Flatten the tokens to ``[tokens, h]`` (the routing map is kept for the gather)."""
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        return hidden_states.reshape(-1, self.hidden_shape[-1]), probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """All-gather tokens, probabilities and routing map over ``tp-ep``."""
        routing_map, self.routing_map = self.routing_map, None
        if self.tp_ep_size > 1:
            hidden_states = gather_along_first_dim(hidden_states, self.tp_ep_group)
            probs = gather_along_first_dim(probs, self.tp_ep_group)
            with torch.no_grad():
                routing_map = gather_along_first_dim(routing_map.to(torch.uint8), self.tp_ep_group).bool()
        self.gathered_routing_map = routing_map
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Keep the local experts' columns and ``permute``: ``(tokens, tokens_per_expert, permuted_probs)``."""
        routing_map, self.gathered_routing_map = self.gathered_routing_map, None
        self.hidden_shape_before_permute = hidden_states.shape
        local_map = routing_map[:, self.local_expert_indices]
        local_probs = probs[:, self.local_expert_indices]
        tokens_per_expert = local_map.sum(dim=0).tolist()
        permuted, permuted_probs, self.sorted_indices = permute(hidden_states, local_map, local_probs)
        return permuted, tokens_per_expert, permuted_probs

    def combine_preprocess(self, expert_output: torch.Tensor):
        """``unpermute`` into the gathered token layout."""
        return unpermute(expert_output, self.sorted_indices, self.hidden_shape_before_permute)

    def token_combine(self, hidden_states: torch.Tensor):
        """Reduce-scatter over ``tp-ep`` (back to this rank's tokens, expert-TP partial sums added)."""
        if self.tp_ep_size > 1:
            hidden_states = reduce_scatter_along_first_dim(hidden_states, self.tp_ep_group)
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor):
        """Back to the input's shape."""
        return hidden_states.reshape(self.hidden_shape)


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    def _splits(self, routing_map: torch.Tensor):
        local_counts = routing_map.sum(dim=0).to(torch.int64)  # [E]
        nl = self.num_local_experts
        if self.tp_ep_size > 1:
            gathered = [torch.empty_like(local_counts) for _ in range(self.tp_ep_size)]
            torch.distributed.all_gather(gathered, local_counts, group=self.tp_ep_group)
            # tp-ep ranks are ordered with expert TP fastest: index = etp + ETP * ep.
            counts = torch.stack(gathered).view(self.ep_size, self.etp_size, self.num_experts)
        else:
            counts = local_counts.view(1, 1, self.num_experts)
        counts = counts.tolist()
        first = self.local_expert_indices[0]
        self.input_splits = [int(local_counts[j * nl:(j + 1) * nl].sum()) for j in range(self.ep_size)]
        self.output_splits = [sum(counts[i][self.etp_rank][first:first + nl]) for i in range(self.ep_size)]
        self.output_splits_tp = [sum(sum(counts[i][a][first:first + nl]) for i in range(self.ep_size))
                                 for a in range(self.etp_size)]
        # Chunk (a, i, e) in received order; its row count, and the (e, a, i) order the experts want.
        chunk_sizes, order = [], []
        for a in range(self.etp_size):
            for i in range(self.ep_size):
                for e in range(nl):
                    chunk_sizes.append(counts[i][a][first + e])
        index = lambda a, i, e: (a * self.ep_size + i) * nl + e  # noqa: E731
        order = [index(a, i, e) for e in range(nl) for a in range(self.etp_size) for i in range(self.ep_size)]
        self.chunk_sizes, self.chunk_order = chunk_sizes, order
        tokens_per_expert = [sum(counts[i][a][first + e] for a in range(self.etp_size) for i in range(self.ep_size))
                             for e in range(nl)]
        return tokens_per_expert

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Flatten, count the tokens per expert and rank (``_splits``, a collective over ``tp-ep``), ``permute``
        the local tokens by expert: ``(permuted_tokens, permuted_probs)``."""
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, self.hidden_shape[-1])
        self.hidden_shape_before_permute = hidden.shape
        self.tokens_per_expert = self._splits(routing_map)
        permuted, permuted_probs, self.sorted_indices = permute(hidden, routing_map, probs)
        return permuted, permuted_probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The all-to-all over EP (then the all-gather over expert TP)."""
        if self.ep_size > 1:
            hidden_states = all_to_all(self.ep_group, hidden_states, self.output_splits, self.input_splits)
            probs = all_to_all(self.ep_group, probs, self.output_splits, self.input_splits)
        if self.etp_size > 1:
            hidden_states = gather_along_first_dim(hidden_states, self.etp_group, self.output_splits_tp)
            probs = gather_along_first_dim(probs, self.etp_group, self.output_splits_tp)
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Sort the received chunks by local expert: ``(tokens, tokens_per_expert, permuted_probs)``."""
        if self.num_local_experts > 1 or self.etp_size > 1:
            hidden_states, probs = sort_chunks_by_idxs(hidden_states, self.chunk_sizes, self.chunk_order, probs)
        return hidden_states, self.tokens_per_expert, probs

    def combine_preprocess(self, expert_output: torch.Tensor):
        """Unsort the chunks to the received order."""
        if self.num_local_experts > 1 or self.etp_size > 1:
            sizes_sorted = [self.chunk_sizes[j] for j in self.chunk_order]
            inverse = sorted(range(len(self.chunk_order)), key=lambda j: self.chunk_order[j])
            expert_output, _ = sort_chunks_by_idxs(expert_output, sizes_sorted, inverse)
        return expert_output

    def token_combine(self, hidden_states: torch.Tensor):
        """The reduce-scatter over expert TP, then the all-to-all back over EP."""
        if self.etp_size > 1:
            hidden_states = reduce_scatter_along_first_dim(hidden_states, self.etp_group, self.output_splits_tp)
        if self.ep_size > 1:
            hidden_states = all_to_all(self.ep_group, hidden_states, self.input_splits, self.output_splits)
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor):
        """``unpermute`` (weighted scatter-add into the tokens), back to the input's shape."""
        out = unpermute(hidden_states, self.sorted_indices, self.hidden_shape_before_permute)
        return out.reshape(self.hidden_shape)

"""Routing math, permutation and the autograd-aware collectives of the mixture-of-experts layer.

Notation: T local tokens, E experts, k = top-k, ``routing_map [T, E]`` (bool, True where token t goes to
expert e), ``probs [T, E]`` (routing weight of (t, e), zero off the map).

* Top-k routing (``topk_routing_with_score_function``), Megatron's orderings:
  softmax (default): top-k on the logits, then ``softmax`` over the k selected logits (= HF Mixtral's
  softmax over all E, top-k, renormalise); pre-softmax: ``softmax`` over all E, top-k of those scores (not
  renormalised); sigmoid: ``sigmoid(logits)``, top-k (on ``scores + expert_bias`` when given), then
  ``scores / (sum of selected + 1e-20)`` when k > 1. Then ``x scaling_factor``. Group-limited routing keeps
  the ``group_topk`` groups whose top ``k / group_topk`` scores sum highest.
* Switch load-balancing loss: ``aux = E * coeff / (k * T_tot^2) * sum_e P_e * c_e`` with ``P_e`` the sum over
  local tokens of the aux-loss scores of expert e and ``c_e`` the tokens routed to e summed over the
  tensor (x context) parallel group; ``T_tot`` = local T x that group's size.
* z-loss: ``coeff * mean_t(logsumexp(logits_t)^2)``.
* Capacity: ``capacity = ceil(T * k / E * factor)``; per expert keep the ``capacity`` routed tokens with the
  highest probability (``probs`` policy) or the first ones (``position``).
* Sinkhorn (S-BASE) routing: the experts are the top-k of ``sinkhorn(logits)`` (rows and columns of
  ``exp(logits)`` rescaled in turn until every expert gets an equal share) in training, of the scores otherwise;
  the weights are ``sigmoid`` (k = 1) or ``softmax`` scores of the chosen experts; no aux loss.
* Aux-loss-free balancing (``--moe-router-enable-expert-bias``, sigmoid routing): the bias only chooses the
  top-k, it never scales the weights. Each training forward counts ``c_e``, the tokens routed to e; once per
  step, after the gradients are reduced, ``c`` is summed over the tensor x data (x context) parallel group and
  ``expert_bias_e += rate * sign(mean_e' c_e' - c_e)`` (``--moe-router-bias-update-rate``): an overloaded
  expert becomes less attractive, an idle one more. The counts then restart from zero.
* Forced balancing (``--moe-router-force-load-balancing``, for benchmarks only): the router's logits are replaced
  by standard-normal draws from the expert-parallel RNG stream (one stream per EP x expert-TP rank), so every
  expert gets about ``T * k / E`` tokens whatever the weights; backward passes the logits' gradient straight
  through to the router (a straight-through estimator), so the model still trains.
* ``MoEAuxLossAutoScaler``: forward returns its input unchanged; backward also feeds
  ``main_loss_backward_scale`` into the aux loss, so the loss trains the router without being added to the
  reported LM loss.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from megatron.core.tensor_parallel.mappings import all_to_all  # noqa: F401  (the MoE dispatch's)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name


# ------------------------------------------------------------------------------------------------ routing
class RandomSTE(torch.autograd.Function):
    """Forward: logits replaced by N(0, 1) draws from the expert-parallel RNG stream; backward: the identity."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
            return torch.empty_like(logits).normal_()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output


def apply_random_logits(logits: torch.Tensor) -> torch.Tensor:
    """Random logits for ``--moe-router-force-load-balancing`` (see the module docstring)."""
    return RandomSTE.apply(logits)



def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int):
    """(values, indices) of the top-k experts within the best ``group_topk`` of ``num_groups`` expert groups."""
    tokens, num_experts = scores.shape
    grouped = scores.view(tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    group_idx = group_scores.topk(group_topk, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    score_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, num_experts)
    masked = scores.masked_fill(score_mask == 0, float("-inf"))
    return masked.topk(topk, dim=-1)


def topk_routing_with_score_function(logits: torch.Tensor, topk: int, use_pre_softmax: bool = False,
                                     num_groups: Optional[int] = None, group_topk: Optional[int] = None,
                                     scaling_factor: Optional[float] = None, score_function: str = "softmax",
                                     expert_bias: Optional[torch.Tensor] = None, fused: bool = False,
                                     router_replay=None):
    """``(routing_probs [T, E], routing_map [T, E] bool)`` from router logits ``[T, E]`` (module docstring).

    ``router_replay`` (a :class:`~megatron.core.transformer.moe.router_replay.RouterReplay`) records or replaces
    the top-k selection. ``fused`` asks for Transformer Engine's fused kernel, which this library does not have."""
    if fused:
        raise ValueError("fused top-k routing (--moe-router-fusion) needs Transformer Engine's "
                         "fused_topk_with_score_function, which this library does not provide: drop the flag")
    num_tokens, num_experts = logits.shape

    def compute_topk(scores, k, num_groups=None, group_topk=None):
        if num_groups:
            return group_limited_topk(scores, k, num_groups, group_topk)
        return torch.topk(scores, k=k, dim=1)

    def select(scores):
        if router_replay is None:
            return compute_topk(scores, topk, num_groups, group_topk)
        return router_replay.get_replay_topk(scores, topk, num_groups, group_topk, compute_topk)

    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, top_indices = select(scores)
        else:
            values, top_indices = select(logits)
            probs = torch.softmax(values, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, top_indices = select(scores + expert_bias)
            probs = torch.gather(scores, 1, top_indices)
        else:
            probs, top_indices = select(scores)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"invalid moe_router_score_function {score_function!r} (softmax or sigmoid)")
    if scaling_factor:
        probs = probs * scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_probs, routing_map


def compute_routing_scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str):
    """(routing_map, scores) used only by the load-balancing losses: scores over all E experts (softmax, or sigmoid
    normalised over E) and their own top-k map, independent of pre-softmax, expert bias and capacity."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    _, top_indices = torch.topk(scores, k=topk, dim=1)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_map, scores


def switch_load_balancing_loss_func(probs: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens: int,
                                    topk: int, num_experts: int, moe_aux_loss_coeff: float) -> torch.Tensor:
    """``E * coeff / (k * T_tot^2) * sum_e (sum_t probs[t, e]) * tokens_per_expert[e]``."""
    aggregated = probs.sum(dim=0)
    scale = num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens)
    return torch.sum(aggregated * tokens_per_expert) * scale


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float) -> torch.Tensor:
    """``coeff * mean_t(logsumexp(logits_t)^2)`` (ST-MoE's router z-loss)."""
    return torch.mean(torch.square(torch.logsumexp(logits.float(), dim=-1))) * z_loss_coeff


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of ``exp(cost) [T, E]``: scale rows by ``d0`` and columns by ``d1`` alternately
    (``d0 = 1 / (T * (exp(cost) d1 + eps))``, ``d1 = 1 / (E * (d0^T exp(cost) + eps))``) until the mean change
    of ``d1`` is at most ``tol``; returns ``d1 * exp(cost) * d0`` (rows summing to ~1/T, columns to ~1/E)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps = 1e-8
    change = float("inf")
    while change > tol:
        d0 = 1.0 / (d0.size(0) * (torch.sum(d1 * cost, 1) + eps))
        new_d1 = 1.0 / (d1.size(0) * (torch.sum(d0.unsqueeze(1) * cost, 0) + eps))
        change = torch.mean(torch.abs(d1 - new_d1))
        d1 = new_d1
    return d1 * cost * d0.unsqueeze(1)


def sinkhorn_routing(logits: torch.Tensor, topk: int, training: bool):
    """S-BASE routing (``--moe-router-load-balancing-type sinkhorn``): in training the experts are the top-k of the
    Sinkhorn-balanced ``logits`` (fp32, no gradient), otherwise of the scores; the weights are the scores
    (``sigmoid`` for k = 1, else ``softmax`` over all experts) of the chosen experts, not renormalised."""
    def scores_of(x):
        return torch.sigmoid(x) if topk == 1 else torch.softmax(x, dim=-1, dtype=torch.float32).type_as(x)

    scores = scores_of(logits)
    with torch.no_grad():
        chosen = sinkhorn(logits.float()) if training else scores
        indices = torch.topk(chosen, k=topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return scores * routing_map, routing_map


def updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, rate: float) -> torch.Tensor:
    """``expert_bias + rate * sign(mean(tokens_per_expert) - tokens_per_expert)`` along the last (expert) dim; the
    counts must already be summed over the ranks that saw the step's tokens."""
    average = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    return expert_bias + torch.sign(average - tokens_per_expert) * rate


def get_updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor,
                            expert_bias_update_rate: float) -> torch.Tensor:
    """megatron-core's form of :func:`updated_expert_bias`: first sums ``tokens_per_expert`` in place over
    parallel_state's tensor x data x context parallel group, then moves the bias by the rate."""
    from megatron.core import parallel_state

    with torch.no_grad():
        torch.distributed.all_reduce(
            tokens_per_expert, group=parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True))
        return updated_expert_bias(tokens_per_expert, expert_bias, expert_bias_update_rate)


def get_tokens_per_expert_and_token_count(routing_map: torch.Tensor, reduce_group, topk: Optional[int] = None,
                                          with_padding_mask: bool = False):
    """``(global tokens per expert [E], local token count, total token count)`` of a ``[T, E]`` routing map: the
    per-expert counts summed over ``reduce_group`` (autograd-aware all-reduce); the token counts are T and
    ``T x |reduce_group|``, or, ``with_padding_mask`` (padding tokens routed nowhere), the routed pairs / ``topk``
    locally and globally."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    local_per_expert = routing_map.sum(dim=0)
    global_per_expert = reduce_from_tensor_model_parallel_region(local_per_expert, reduce_group)
    if with_padding_mask:
        return global_per_expert, local_per_expert.sum() / topk, global_per_expert.sum() / topk
    local_tokens = routing_map.shape[0]
    return global_per_expert, local_tokens, local_tokens * torch.distributed.get_world_size(group=reduce_group)


def pad_routing_map(routing_map: torch.Tensor, pad_multiple: int) -> torch.Tensor:
    """Route extra tokens to each expert until its token count is a multiple of ``pad_multiple``: in each expert's
    column of the ``[T, E]`` map the first ``(-count) mod pad_multiple`` unrouted tokens become routed. Modifies
    ``routing_map`` in place and returns it."""
    by_expert = routing_map.t()  # a view: [E, T]
    missing = (-by_expert.sum(dim=1)) % pad_multiple
    free_rank = torch.cumsum((by_expert == 0).int(), dim=1)  # 1, 2, ... at the unrouted tokens of each expert
    by_expert[(by_expert == 0) & (free_rank <= missing.unsqueeze(1))] = 1
    return routing_map


def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """A device tensor copied to the host (non-blocking; as a NumPy array with ``as_numpy``; ``record_stream``
    keeps the device tensor alive for the current stream); anything else is returned unchanged."""
    if not (torch.is_tensor(tensor) and tensor.device.type != "cpu"):
        return tensor
    host = tensor.to("cpu", non_blocking=True)
    if record_stream and tensor.is_cuda:
        tensor.record_stream(torch.cuda.current_stream())
    return host.numpy() if as_numpy else host


class RouterGatingLinearFunction(torch.autograd.Function):
    """``y = x W^T (+ b)`` computed in ``router_dtype`` while only the original (e.g. bf16) ``x``, ``W``, ``b`` are
    saved for backward: ``dx = dy W``, ``dW = dy^T x`` (in ``router_dtype``, cast back to the inputs' dtypes),
    ``db = sum_t dy``."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], router_dtype):
        ctx.save_for_backward(inp, weight, bias)
        ctx.router_dtype = router_dtype
        x = inp.reshape(-1, inp.shape[-1]).to(router_dtype)
        w = weight.to(router_dtype)
        out = torch.mm(x, w.t()) if bias is None else torch.addmm(bias.to(router_dtype), x, w.t())
        return out.view(*inp.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        inp, weight, bias = ctx.saved_tensors
        dtype = ctx.router_dtype
        dy = grad_output.reshape(-1, grad_output.shape[-1]).to(dtype)
        grad_input = torch.mm(dy, weight.to(dtype)).to(inp.dtype).view(inp.shape)
        grad_weight = torch.mm(dy.t(), inp.reshape(-1, inp.shape[-1]).to(dtype)).to(weight.dtype)
        grad_bias = dy.sum(dim=0).to(bias.dtype) if bias is not None else None
        return grad_input, grad_weight, grad_bias, None


def router_gating_linear(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         router_dtype: torch.dtype) -> torch.Tensor:
    """The router's logits ``inp W^T (+ bias)`` in ``router_dtype`` (see :class:`RouterGatingLinearFunction`)."""
    return RouterGatingLinearFunction.apply(inp, weight, bias, router_dtype)


def get_align_size_for_quantization(config) -> int:
    """Token-count alignment the grouped GEMMs need: that of the FP8 recipe with ``config.fp8`` (32 for mxfp8, else
    16), 16 otherwise."""
    if getattr(config, "fp8", None):
        from megatron.core.fp8_utils import get_fp8_align_size

        return get_fp8_align_size(config.fp8_recipe)
    return 16


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: Optional[int] = None):
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


def apply_router_token_dropping(routing_probs: torch.Tensor, routing_map: torch.Tensor, router_topk: int,
                                capacity_factor: float, drop_policy: str = "probs", pad_to_capacity: bool = False):
    """Keep at most ``ceil(T * k / E * factor)`` tokens per expert; ``(probs, map)`` of the kept ones. With
    ``pad_to_capacity`` the map is the capacity mask itself (every expert receives exactly ``capacity`` rows)."""
    num_tokens, num_experts = routing_probs.shape
    capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    if drop_policy == "probs":
        _, idx = torch.topk(routing_probs, k=min(capacity, num_tokens), dim=0, sorted=False)
    elif drop_policy == "position":
        _, idx = torch.topk(routing_map.int(), k=min(capacity, num_tokens), dim=0, sorted=False)
    else:
        raise ValueError(f"invalid moe_token_drop_policy {drop_policy!r} (probs or position)")
    capacity_mask = torch.zeros_like(routing_probs, dtype=torch.bool).scatter(0, idx, True)
    if pad_to_capacity:
        final_map = capacity_mask
        final_probs = routing_probs * final_map
    else:
        final_map = routing_map & capacity_mask
        final_probs = routing_probs * final_map
    return final_probs, final_map


def loss_auto_scaler(name: str, doc: str):
    """An autograd Function attaching an auxiliary loss to an activation: identity forward; backward also sends the
    class's ``main_loss_backward_scale`` (set by the pipeline schedule per step with ``set_loss_scale``; 1 when
    unset) into the loss, so the loss trains without being added to the reported one. One class per kind of loss
    (MoE router losses, multi-token prediction), each with its own scale."""

    class Scaler(torch.autograd.Function):
        main_loss_backward_scale: torch.Tensor = None

        @staticmethod
        def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor):
            ctx.save_for_backward(aux_loss)
            return output

        @staticmethod
        def backward(ctx, grad_output: torch.Tensor):
            (aux_loss,) = ctx.saved_tensors
            scale = Scaler.main_loss_backward_scale
            if scale is None:
                scale = torch.ones((), device=aux_loss.device)
            return grad_output, torch.ones_like(aux_loss) * scale.to(aux_loss.device, aux_loss.dtype)

        @staticmethod
        def set_loss_scale(scale: torch.Tensor):
            """Scale of the loss's gradient relative to the main loss."""
            Scaler.main_loss_backward_scale = torch.as_tensor(scale).detach().reshape(())

    Scaler.__name__ = Scaler.__qualname__ = name
    Scaler.__doc__ = doc
    return Scaler


MoEAuxLossAutoScaler = loss_auto_scaler(
    "MoEAuxLossAutoScaler", "Attach a router loss to an activation (Megatron's API; scale = loss scale / micro-batches).")


# ---------------------------------------------------------------------------------------- permutation

def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: Optional[torch.Tensor] = None,
            num_out_tokens: Optional[int] = None):
    """Rows of ``tokens [T, h]`` grouped by expert (expert 0's tokens in token order, then expert 1's, ...).

    Returns ``(permuted_tokens, permuted_probs or None, sorted_indices)``; ``sorted_indices[j]`` is the source
    token of output row j.
    """
    num_tokens = tokens.shape[0]
    mask = routing_map.bool().T.contiguous()  # [E, T]
    token_ids = torch.arange(num_tokens, device=tokens.device).unsqueeze(0).expand_as(mask)
    sorted_indices = token_ids.masked_select(mask)
    permuted_probs = None
    if probs is not None:
        permuted_probs = probs.T.contiguous().masked_select(mask)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, restore_shape: torch.Size,
              probs: Optional[torch.Tensor] = None, routing_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scatter-add the expert output rows back to their tokens (``[T, h]``), weighting by ``probs`` if given."""
    if probs is not None:
        weights = probs.T.contiguous().masked_select(routing_map.bool().T.contiguous())
        permuted_tokens = permuted_tokens * weights.unsqueeze(-1).to(permuted_tokens.dtype)
    out = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    index = sorted_indices.unsqueeze(1).expand(-1, restore_shape[-1])
    return out.scatter_add(0, index, permuted_tokens)


def sort_chunks_by_idxs(input: torch.Tensor, split_sizes: List[int], sorted_idxs: List[int],
                        probs: Optional[torch.Tensor] = None):
    """Split ``input`` along dim 0 into chunks of ``split_sizes`` and concatenate them in ``sorted_idxs`` order."""
    chunks = torch.split(input, list(split_sizes), dim=0)
    out = torch.cat([chunks[i] for i in sorted_idxs], dim=0)
    if probs is None:
        return out, None
    p = torch.split(probs, list(split_sizes), dim=0)
    return out, torch.cat([p[i] for i in sorted_idxs], dim=0)


# ------------------------------------------------------------------------- collectives with autograd

def _group_size(group) -> int:
    if group is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=group)


class _AllGatherFirstDim(torch.autograd.Function):
    """Concatenate the (possibly uneven) first-dim pieces of every rank; backward: sum the gradients over the
    group and keep this rank's rows (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        rank = torch.distributed.get_rank(group=group)
        ctx.rank = rank
        largest = max(sizes)
        padded = x.new_zeros((largest,) + tuple(x.shape[1:]))
        padded[: x.shape[0]] = x
        pieces = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(pieces, sizes)], dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start:start + ctx.sizes[ctx.rank]], None, None


class _ReduceScatterFirstDim(torch.autograd.Function):
    """Sum ``x`` over the group and keep this rank's rows (``sizes`` per rank); backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        rank = torch.distributed.get_rank(group=group)
        out = x.contiguous().clone()
        torch.distributed.all_reduce(out, group=group)
        start = sum(sizes[:rank])
        return out[start:start + sizes[rank]]

    @staticmethod
    def backward(ctx, grad):
        return _AllGatherFirstDim.apply(grad.contiguous(), ctx.group, ctx.sizes), None, None


def gather_along_first_dim(x: torch.Tensor, group, sizes: Optional[List[int]] = None) -> torch.Tensor:
    """Autograd-aware all-gather over ``group`` (``sizes``: rows per rank, default all equal)."""
    world = _group_size(group)
    if world == 1:
        return x
    sizes = list(sizes) if sizes is not None else [x.shape[0]] * world
    return _AllGatherFirstDim.apply(x, group, sizes)


def reduce_scatter_along_first_dim(x: torch.Tensor, group, sizes: Optional[List[int]] = None) -> torch.Tensor:
    """Autograd-aware reduce-scatter over ``group`` (``sizes``: rows kept by each rank, default equal)."""
    world = _group_size(group)
    if world == 1:
        return x
    sizes = list(sizes) if sizes is not None else [x.shape[0] // world] * world
    return _ReduceScatterFirstDim.apply(x, group, sizes)


# The groups an MoE layer communicates over (megatron-core's get_default_pg_collection).
MOE_GROUPS = ("ep", "tp", "cp", "expt_tp", "expt_dp", "tp_ep", "tp_cp", "tp_dp_cp")


def get_default_pg_collection():
    """megatron-core's: a ProcessGroupCollection with parallel_state's MoE groups (``ep``, ``tp``, ``cp``,
    ``expt_tp``, ``expt_dp``, ``tp_ep``, ``tp_cp``, ``tp_dp_cp``); its other fields are None."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups(list(MOE_GROUPS))


# ------------------------------------------------------------------------------- aux-loss logging tracker
# megatron-core's layer-wise logging tracker: ``{name: {"values": [num_layers] tensor, "reduce_group",
# "avg_group", "reduce_group_has_dp"}}``, one per process (megatron-core's API is a module-level dict).
# ``values[l - 1]`` accumulates ``loss / coeff`` of layer ``l`` over the step's micro-batches. Reduction
# (``reduce_aux_losses_tracker_across_ranks``): SUM over the pipeline group (each layer lives on one stage),
# then, where a ``reduce_group`` was saved, SUM over it followed (unless ``reduce_group_has_dp``) by a MEAN over
# the data-parallel group; then a MEAN over ``avg_group`` where one was saved. ``track_moe_metrics`` logs
# ``loss_scale * sum_l values[l] / num_moe_layers`` (and each layer's value) and zeroes the tracker.
# Our routers keep their own per-layer sums (``TopKRouter.tracked_losses``); ``moe_layer.reduce_moe_losses``
# feeds them into this tracker once per step, so the reduction runs here only.
_MOE_LAYER_WISE_LOGGING_TRACKER: dict = {}


def get_moe_layer_wise_logging_tracker() -> dict:
    """The process's layer-wise MoE logging tracker (a dict, see above)."""
    return _MOE_LAYER_WISE_LOGGING_TRACKER


def _tracker_device():
    from megatron.core.device import current_device

    return current_device()


def _new_tracker_entry(num_layers: int, device=None, reduce_group=None, avg_group=None,
                       reduce_group_has_dp: bool = False) -> dict:
    return {"values": torch.zeros(num_layers, device=device if device is not None else _tracker_device()),
            "reduce_group": reduce_group, "avg_group": avg_group, "reduce_group_has_dp": reduce_group_has_dp}


def save_to_aux_losses_tracker(name: str, loss: torch.Tensor, layer_number: int, num_layers: int,
                               reduce_group=None, avg_group=None, reduce_group_has_dp: bool = False) -> None:
    """Add ``loss`` (detached) to ``tracker[name]["values"][layer_number - 1]`` (a zero vector of ``num_layers``
    on ``loss``'s device when ``name`` is new) and remember the groups its reduction uses. Nothing is saved when
    ``layer_number`` is None."""
    if layer_number is None:
        return
    tracker = get_moe_layer_wise_logging_tracker()
    if name not in tracker:
        tracker[name] = _new_tracker_entry(num_layers, device=loss.device)
    tracker[name]["values"][layer_number - 1] += loss.detach().to(tracker[name]["values"].dtype)
    tracker[name].update(reduce_group=reduce_group, avg_group=avg_group, reduce_group_has_dp=reduce_group_has_dp)


def clear_aux_losses_tracker() -> None:
    """Zero every tracked value (the entries and their groups stay)."""
    for entry in get_moe_layer_wise_logging_tracker().values():
        entry["values"].zero_()


def all_reduce_logged(values: torch.Tensor, group, mean: bool = False) -> None:
    """In-place SUM (``mean``: SUM / group size, which gloo's missing AVG needs) over ``group``; nothing without
    an initialized process group or with no group."""
    if group is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    torch.distributed.all_reduce(values, group=group)
    if mean:
        values /= torch.distributed.get_world_size(group=group)


def reduce_aux_losses_tracker_across_ranks(track_names: Optional[List[str]] = None, pg_collection=None) -> None:
    """Reduce the tracked values of ``track_names`` (default: every name, in the tracker's order, which must be
    the same on every rank) in place: SUM over ``pg_collection.pp`` (else parallel_state's pipeline group), then
    SUM over the saved ``reduce_group`` and, unless ``reduce_group_has_dp``, MEAN over ``pg_collection.dp`` (else
    parallel_state's data-parallel group without CP), then MEAN over the saved ``avg_group``."""
    from megatron.core.process_groups_config import pg_group

    tracker = get_moe_layer_wise_logging_tracker()
    names = list(tracker) if track_names is None else list(track_names)
    pp_group, dp_group = pg_group(pg_collection, "pp"), pg_group(pg_collection, "dp")
    for name in names:
        entry = tracker[name]
        values = entry["values"]
        all_reduce_logged(values, pp_group)
        if entry.get("reduce_group") is not None:
            all_reduce_logged(values, entry["reduce_group"])
            if not entry.get("reduce_group_has_dp", False):
                all_reduce_logged(values, dp_group, mean=True)
        if entry.get("avg_group") is not None:
            all_reduce_logged(values, entry["avg_group"], mean=True)


def _count_moe_layers(num_layers, moe_layer_freq, mtp_num_layers) -> int:
    """megatron-core's count: ``num_layers`` (no frequency), every ``freq``-th layer from layer 0 (an int), or the
    ones of a 0/1 pattern (a list); plus ``mtp_num_layers``."""
    if moe_layer_freq is None:
        count = num_layers
    elif isinstance(moe_layer_freq, int):
        if not isinstance(num_layers, int):
            raise ValueError("track_moe_metrics: an integer moe_layer_freq needs num_layers")
        count = sum(1 for i in range(num_layers) if i % moe_layer_freq == 0)
    elif isinstance(moe_layer_freq, list):
        count = sum(moe_layer_freq)
    else:
        raise ValueError(f"Invalid moe_layer_freq: {moe_layer_freq}")
    return count + (mtp_num_layers or 0)


def track_moe_metrics(loss_scale: float, iteration: int, writer=None, wandb_writer=None,
                      total_loss_dict: Optional[dict] = None, per_layer_logging: bool = False,
                      force_initialize: bool = False, track_names: Optional[List[str]] = None,
                      num_layers: Optional[int] = None, moe_layer_freq=None, mtp_num_layers: Optional[int] = None,
                      pg_collection=None) -> None:
    """Reduce the tracker across ranks and log it, then zero it (megatron-core's contract).

    ``force_initialize`` first creates a zero entry of ``num_layers`` (no groups) for every name of ``track_names``
    the tracker lacks, so ranks without those losses take part in the same collectives. Per name, with
    ``n = num_moe_layers`` (:func:`_count_moe_layers`) and ``v = values * loss_scale``: ``total_loss_dict[name] +=
    v.sum() / n``; ``writer.add_scalar(name, v.sum() / n, iteration)`` and, with ``per_layer_logging``,
    ``moe/{name}_layer_{i}`` for each layer ``i``; ``wandb_writer.log`` the same (only when a ``writer`` is given,
    as in megatron-core)."""
    tracker = get_moe_layer_wise_logging_tracker()
    if force_initialize and track_names is not None:
        for name in track_names:
            if name not in tracker:
                tracker[name] = _new_tracker_entry(num_layers)
    reduce_aux_losses_tracker_across_ranks(track_names, pg_collection=pg_collection)
    num_moe_layers = _count_moe_layers(num_layers, moe_layer_freq, mtp_num_layers)
    for name, entry in tracker.items():
        per_layer = entry["values"].float() * loss_scale
        mean = per_layer.sum() / num_moe_layers
        if total_loss_dict is not None:
            total_loss_dict[name] = total_loss_dict[name] + mean if name in total_loss_dict else mean
        if writer is not None:
            writer.add_scalar(name, mean, iteration)
            layer_values = {f"moe/{name}_layer_{i}": v for i, v in enumerate(per_layer.tolist())}
            if per_layer_logging:
                for key, value in layer_values.items():
                    writer.add_scalar(key, value, iteration)
            if wandb_writer:
                wandb_writer.log({name: mean}, iteration)
                if per_layer_logging:
                    wandb_writer.log(layer_values, iteration)
    clear_aux_losses_tracker()

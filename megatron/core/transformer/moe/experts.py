"""The local experts: ``SequentialMLP`` (a loop of MLPs) and ``GroupedMLP`` (grouped GEMMs).

Expert ``e`` is an MLP with ``F = moe_ffn_hidden_size``: ``y = fc2(act(fc1(x)) * p)`` (plus ``b2 * p`` with
biases), the routing weight ``p`` applied inside the expert as in Megatron. With expert tensor parallelism
(ETP) rank ``r`` holds rows ``[gate_r; up_r]`` of fc1 (``2F/ETP x h`` for gated units, ``F/ETP x h`` otherwise)
and columns ``F/ETP`` of fc2; its fc2 output is a partial sum that the dispatcher's reduce-scatter completes.

Initialisation draws the full fp32 weights of *every* expert from the global generator, in expert order
(fc1 then fc2), and keeps this rank's experts and shards, so EP/ETP layouts and both implementations start
from the same model (``--use-cpu-initialization`` semantics).

``GroupedMLP`` stores Megatron's legacy grouped layout: ``weight1 [h, n * 2F/ETP]`` (expert j's fc1 transposed
in columns ``j*2F/ETP ...``) and ``weight2 [n * F/ETP, h]``; it runs ``torch._grouped_mm`` where the
device/dtype has a working kernel (probed once, forward and backward), else a batched fallback (rows padded to
the largest expert, one ``bmm``); the choice is logged.
"""
from __future__ import annotations

import functools
from typing import List

import torch

from megatron.core import device as _device
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.process_groups_config import pg_rank, pg_size
from megatron.core.transformer.mlp import apply_swiglu_to_fc1, glu_activation
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import param_device, weights_on_meta
from megatron.core.utils import log_once, make_sharded_object_for_checkpoint


def expert_tensor_parallel_size_and_rank(pg_collection=None):
    """(size, rank) of the expert tensor-parallel group (``pg_collection.expt_tp``, else parallel_state's)."""
    return pg_size(pg_collection, "expt_tp"), pg_rank(pg_collection, "expt_tp")


def expert_activation(config):
    """The experts' activation: the MLP's gated unit (offset and clamp included), or ``activation_func``."""
    if config.gated_linear_unit:
        return glu_activation(config)
    return config.activation_func


def init_expert_weights(config, local_expert_indices: List[int], num_experts: int, pg_collection=None):
    """``[(fc1 [2F/ETP or F/ETP, h], fc2 [h, F/ETP])]`` for the local experts (module docstring)."""
    h, ffn = config.hidden_size, config.moe_ffn_hidden_size
    rows = 2 * ffn if config.gated_linear_unit else ffn
    etp, etp_rank = expert_tensor_parallel_size_and_rank(pg_collection)
    if ffn % etp:
        raise ValueError(f"moe_ffn_hidden_size ({ffn}) must be divisible by the expert tensor parallel size ({etp})")
    shard = ffn // etp
    if _device.current_device().type == "meta":  # device.build_on("meta"): shapes only, no values, no RNG draws
        meta = dict(dtype=config.params_dtype, device="meta")
        return [(torch.empty(rows // ffn * shard, h, **meta), torch.empty(h, shard, **meta))
                for _ in local_expert_indices]
    out = []
    for e in range(num_experts):
        fc1 = torch.empty(rows, h, dtype=torch.float32)
        fc2 = torch.empty(h, ffn, dtype=torch.float32)
        if config.perform_initialization:
            config.init_method(fc1)
            config.output_layer_init_method(fc2)
        if e not in local_expert_indices:
            continue
        if config.gated_linear_unit:
            local1 = torch.cat([fc1[etp_rank * shard:(etp_rank + 1) * shard],
                                fc1[ffn + etp_rank * shard:ffn + (etp_rank + 1) * shard]], dim=0)
        else:
            local1 = fc1[etp_rank * shard:(etp_rank + 1) * shard]
        local2 = fc2[:, etp_rank * shard:(etp_rank + 1) * shard]
        out.append((local1.to(config.params_dtype).contiguous(), local2.to(config.params_dtype).contiguous()))
    return out


def expert_weight_shapes(config, pg_collection=None):
    """(fc1, fc2) shapes of one local expert: ``[2F/ETP or F/ETP, h]``, ``[h, F/ETP]``."""
    h, ffn = config.hidden_size, config.moe_ffn_hidden_size
    shard = ffn // expert_tensor_parallel_size_and_rank(pg_collection)[0]
    return ((2 * shard if config.gated_linear_unit else shard, h), (h, shard))


def empty_expert_weight(config, shape):
    return torch.empty(shape, dtype=config.params_dtype, device=param_device(config))


def mark_expert_param(param: torch.nn.Parameter, partition_dim: int, config):
    """Attributes read by DDP, the optimizer and checkpointing: an expert parameter is reduced over the expert
    data-parallel group (``allreduce = False``) when that differs from the dense DP group, and is never a
    tensor-parallel duplicate (each rank of the expert model-parallel group holds a different piece)."""
    param.is_expert = True
    param.allreduce = not expert_parallel_is_separate(config)
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1


def expert_parallel_is_separate(config) -> bool:
    """True when expert grads need their own reduction group (EP > 1 or expert TP != TP)."""
    etp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    return config.expert_model_parallel_size > 1 or etp != config.tensor_model_parallel_size


def expert_checkpoint_layout(pg_collection=None):
    """(EP size, EP rank, expert-TP size, expert-TP rank, expert-DP rank) of this rank, for the sharded state (the
    collection's ``ep`` / ``expt_tp`` / ``expt_dp`` groups, else parallel_state's)."""
    etp, etp_rank = expert_tensor_parallel_size_and_rank(pg_collection)
    return (pg_size(pg_collection, "ep"), pg_rank(pg_collection, "ep"), etp, etp_rank,
            pg_rank(pg_collection, "expt_dp"))


def _local_indices(num_local_experts: int, given, pg_collection) -> List[int]:
    """This rank's global expert indices: ``given``, else the EP rank's block ``ep_rank * n ... + n - 1``."""
    if given is not None:
        return list(given)
    start = pg_rank(pg_collection, "ep") * num_local_experts
    return list(range(start, start + num_local_experts))


def _expert_extra_state(key: str, offsets, etp_rank: int, edp_rank: int):
    """megatron-core's empty ``_extra_state`` object of an expert linear layer (one piece per layer and expert)."""
    return make_sharded_object_for_checkpoint(None, key, offsets, (0, etp_rank, edp_rank))


class ExpertLinear(torch.nn.Module):
    """A local linear layer of one expert (no communication: the dispatcher moves the tokens)."""

    def __init__(self, weight: torch.Tensor, bias: bool, partition_dim: int, config, pg_collection=None):
        super().__init__()
        self.pg_collection = pg_collection
        self.weight = torch.nn.Parameter(weight)
        mark_expert_param(self.weight, partition_dim, config)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device))
            mark_expert_param(self.bias, 0, config)
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None):
        """Weight split over expert TP along its partition dim (fc1 rows, fc2 columns); fc1's bias split with its
        rows, fc2's replicated; replicas over the expert data-parallel group; plus the empty ``_extra_state``."""
        _, _, etp, etp_rank, edp_rank = expert_checkpoint_layout(self.pg_collection)
        axis = len(sharded_offsets)
        out = {}
        for name, tensor in (("weight", self.weight), ("bias", self.bias)):
            if tensor is None:
                continue
            key = f"{prefix}{name}"
            split = name == "weight" or self.weight.partition_dim == 0
            dim = self.weight.partition_dim if name == "weight" else 0
            tp = ((axis + dim, etp_rank, etp),) if split else ()
            out[key] = ShardedTensor.from_rank_offsets(key, tensor, *sharded_offsets, *tp, prepend_axis_num=axis,
                                                       replica_id=(0, 0 if split else etp_rank, edp_rank))
        out[f"{prefix}_extra_state"] = _expert_extra_state(f"{prefix}_extra_state", sharded_offsets, etp_rank,
                                                           edp_rank)
        return out


class ExpertMLP(torch.nn.Module):
    def __init__(self, fc1: torch.Tensor, fc2: torch.Tensor, config, pg_collection=None):
        super().__init__()
        self.linear_fc1 = ExpertLinear(fc1, config.add_bias_linear, 0, config, pg_collection)
        self.linear_fc2 = ExpertLinear(fc2, config.add_bias_linear, 1, config, pg_collection)
        self.activation_func = expert_activation(config)
        self.gated = config.gated_linear_unit

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None):
        out = {}
        for name in ("linear_fc1", "linear_fc2"):
            out.update(getattr(self, name).sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata))
        if self.gated:
            apply_swiglu_to_fc1(out, prefix, sharded_offsets, metadata)
        return out

    def forward(self, x, probs):
        h = self.linear_fc1(x)
        if self.linear_fc1.bias is not None:
            h = h + self.linear_fc1.bias
        # The routing weight multiplies in its own precision (fp32 with --moe-router-dtype fp32), rounded once.
        h = (self.activation_func(h) * probs.unsqueeze(-1)).to(h.dtype)
        y = self.linear_fc2(h)
        if self.linear_fc2.bias is not None:
            y = y + (self.linear_fc2.bias * probs.unsqueeze(-1)).to(y.dtype)
        return y


class SequentialMLP(MegatronModule):
    """``SequentialMLP(num_local_experts, config, submodules=None, pg_collection=None)``; ``forward(tokens,
    tokens_per_expert, probs) -> (out, None)``. The collection's ``ep`` / ``expt_tp`` / ``expt_dp`` groups (else
    parallel_state's) choose this rank's experts and shards; ``local_expert_indices`` (keyword) overrides the
    experts."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None, *,
                 local_expert_indices=None):
        super().__init__(config=config)
        self.pg_collection = pg_collection
        self.local_expert_indices = _local_indices(num_local_experts, local_expert_indices, pg_collection)
        self.num_local_experts = num_local_experts
        fc1, fc2 = expert_weight_shapes(config, pg_collection)
        self.local_experts = torch.nn.ModuleList([
            ExpertMLP(empty_expert_weight(config, fc1), empty_expert_weight(config, fc2), config, pg_collection)
            for _ in self.local_expert_indices])
        self.reset_parameters()
        log_once("moe_experts_sequential", "MoE experts: SequentialMLP (one MLP per local expert)")

    def reset_parameters(self):
        """Every expert drawn in expert order (module docstring); this rank's experts and shards kept."""
        if weights_on_meta(self):
            return
        weights = init_expert_weights(self.config, self.local_expert_indices, self.config.num_moe_experts,
                                      self.pg_collection)
        with torch.no_grad():
            for expert, (w1, w2) in zip(self.local_experts, weights):
                for linear, w in ((expert.linear_fc1, w1), (expert.linear_fc2, w2)):
                    linear.weight.copy_(w)
                    if linear.bias is not None:
                        linear.bias.zero_()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None):
        """Local expert ``j`` is global expert ``e = ep_rank * n + j``: its tensors get the prepended offset
        ``(axis, e, E)`` and keys ``{prefix}experts.<name>`` (``{prefix}experts.{e}.<name>`` without the axis under
        ``singleton_local_shards``)."""
        ep, ep_rank, _, _, _ = expert_checkpoint_layout(self.pg_collection)
        num_global = ep * self.num_local_experts
        singleton = bool((metadata or {}).get("singleton_local_shards", False))
        out = {}
        for j, expert in enumerate(self.local_experts):
            e = ep_rank * self.num_local_experts + j
            local_prefix = f"{prefix}local_experts.{j}."
            if singleton:
                expert_sd = expert.sharded_state_dict(local_prefix, sharded_offsets, metadata)
                replace_prefix_for_sharding(expert_sd, local_prefix, f"{prefix}experts.{e}.")
            else:
                offsets = (*sharded_offsets, (len(sharded_offsets), e, num_global))
                expert_sd = expert.sharded_state_dict(local_prefix, offsets, metadata)
                replace_prefix_for_sharding(expert_sd, local_prefix, f"{prefix}experts.")
            out.update(expert_sd)
        return out

    def forward(self, permuted_tokens, tokens_per_expert, permuted_probs):
        outputs = []
        tokens = torch.split(permuted_tokens, list(tokens_per_expert), dim=0)
        probs = torch.split(permuted_probs, list(tokens_per_expert), dim=0)
        for expert, x, p in zip(self.local_experts, tokens, probs):
            outputs.append(expert(x, p))
        if not outputs:
            return permuted_tokens, None
        return torch.cat(outputs, dim=0), None


@functools.lru_cache(maxsize=None)
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward for this device type and dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        # Fixed inputs, not random ones: the probe runs inside the first forward and must not move the RNG stream
        # (dropout masks would then depend on whether it had run before, e.g. after resuming). Gradients enabled:
        # the first call may come under no_grad (evaluation, the first pass of an activation recompute).
        dev = torch.device(device_type)
        with torch.enable_grad():
            a = torch.linspace(-1, 1, 6 * 16, device=dev, dtype=dtype).view(6, 16).requires_grad_(True)
            b = torch.linspace(-1, 1, 2 * 16 * 8, device=dev, dtype=dtype).view(2, 16, 8).requires_grad_(True)
            offs = torch.tensor([2, 6], device=dev, dtype=torch.int32)
            torch._grouped_mm(a, b, offs=offs).sum().backward()
        return a.grad is not None and b.grad is not None
    except Exception:  # noqa: BLE001 - any failure means "use the fallback"
        return False


def grouped_gemm(x: torch.Tensor, weights: torch.Tensor, tokens_per_expert: List[int]) -> torch.Tensor:
    """``cat_j(x_j @ weights[j])`` for row groups ``x_j`` of sizes ``tokens_per_expert``; ``weights [n, K, N]``."""
    if grouped_mm_works(x.device.type, x.dtype):
        log_once(f"moe_grouped_gemm_{x.device.type}_{x.dtype}",
                 f"MoE grouped GEMM: torch._grouped_mm ({x.device.type}, {x.dtype})")
        offs = torch.tensor(list(tokens_per_expert), device=x.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, weights.contiguous(), offs=offs)  # the probe's layout (strided views may fail)
    log_once(f"moe_grouped_gemm_fallback_{x.device.type}_{x.dtype}",
             f"MoE grouped GEMM: batched bmm fallback (torch._grouped_mm unavailable for {x.device.type}, {x.dtype})")
    n = weights.shape[0]
    counts = torch.tensor(list(tokens_per_expert), device=x.device)
    largest = int(max(tokens_per_expert)) if n else 0
    if largest == 0:
        return x.new_zeros(x.shape[0], weights.shape[-1])
    expert_of_row = torch.repeat_interleave(torch.arange(n, device=x.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(x.shape[0], device=x.device) - starts[expert_of_row]
    padded = x.new_zeros(n, largest, x.shape[-1])
    padded = padded.index_put((expert_of_row, slot), x)
    out = torch.bmm(padded, weights)
    return out[expert_of_row, slot]


class GroupedMLP(MegatronModule):
    """``GroupedMLP(num_local_experts, config, submodules=None, pg_collection=None)`` with Megatron's legacy
    ``weight1``/``weight2`` layout (groups as :class:`SequentialMLP`)."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None, *,
                 local_expert_indices=None):
        super().__init__(config=config)
        if config.add_bias_linear:
            raise ValueError("bias is not supported with --moe-grouped-gemm (pass --disable-bias-linear)")
        self.pg_collection = pg_collection
        self.local_expert_indices = _local_indices(num_local_experts, local_expert_indices, pg_collection)
        self.num_local_experts = n = num_local_experts
        h = config.hidden_size
        (rows, _), (_, shard) = expert_weight_shapes(config, pg_collection)
        self.weight1 = torch.nn.Parameter(empty_expert_weight(config, (h, n * rows)))
        self.weight2 = torch.nn.Parameter(empty_expert_weight(config, (n * shard, h)))
        mark_expert_param(self.weight1, 1, config)
        mark_expert_param(self.weight2, 0, config)
        self.reset_parameters()
        self.hidden_size = h
        self.activation_func = expert_activation(config)
        # --recompute-modules moe_act: keep only the fc1 output; the activation (x routing weight) runs again.
        self.recompute_activation = config.recomputes("moe_act")

    def reset_parameters(self):
        """Every expert drawn in expert order (module docstring), this rank's experts transposed into the grouped
        layout."""
        if weights_on_meta(self):
            return
        weights = init_expert_weights(self.config, self.local_expert_indices, self.config.num_moe_experts,
                                      self.pg_collection)
        with torch.no_grad():
            self.weight1.copy_(torch.cat([w1.t() for w1, _ in weights], dim=1))
            self.weight2.copy_(torch.cat([w2.t() for _, w2 in weights], dim=0))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None):
        """The same checkpoint tensors as :class:`SequentialMLP` (so either implementation loads the other's):
        ``weight1 [h, n * X]`` is saved as this rank's block ``[n, X, h]`` of ``{prefix}experts.linear_fc1.weight``
        ``[(L,) E, 2F or F, h]`` (experts ``ep_rank * n ...``; a gated ``X`` as its gate and up halves),
        ``weight2 [n * X', h]`` as the block ``[n, h, X']`` of ``...linear_fc2.weight [(L,) E, h, F]``; plus the
        empty ``_extra_state`` object of each expert's two linear layers."""
        if (metadata or {}).get("singleton_local_shards"):
            raise NotImplementedError("singleton_local_shards is not supported with --moe-grouped-gemm: save with "
                                      "the default layout")
        ep, ep_rank, etp, etp_rank, edp_rank = expert_checkpoint_layout(self.pg_collection)
        n, h, axis = self.num_local_experts, self.hidden_size, len(sharded_offsets)
        experts = (axis, ep_rank, ep)
        gated = self.config.gated_linear_unit

        def build_fc1(key, tensor, replica_id, flattened_range):
            blocks = tensor.view(h, n, -1).permute(1, 2, 0)  # [n, X, h]
            if not gated:
                placed = [(blocks, etp_rank, etp)]
            else:
                gate, up = torch.chunk(blocks, 2, dim=1)
                placed = [(gate, etp_rank, 2 * etp), (up, etp + etp_rank, 2 * etp)]
            return [ShardedTensor.from_rank_offsets(key, b.contiguous(), *sharded_offsets, experts, (axis + 1, r, f),
                                                    replica_id=replica_id, prepend_axis_num=axis)
                    for b, r, f in placed]

        def merge_fc1(loaded):
            blocks = torch.cat(loaded, dim=1) if isinstance(loaded, list) else loaded  # [n, X, h]
            return blocks.permute(2, 0, 1).reshape(h, -1)

        def build_fc2(key, tensor, replica_id, flattened_range):
            block = tensor.view(n, -1, h).transpose(1, 2).contiguous()  # [n, h, X']
            return ShardedTensor.from_rank_offsets(key, block, *sharded_offsets, experts, (axis + 2, etp_rank, etp),
                                                   replica_id=replica_id, prepend_axis_num=axis)

        def merge_fc2(loaded):
            return loaded.transpose(1, 2).reshape(-1, h)

        replica = (0, 0, edp_rank)
        out = {f"{prefix}weight1": ShardedTensorFactory(f"{prefix}experts.linear_fc1.weight", self.weight1,
                                                        build_fc1, merge_fc1, replica),
               f"{prefix}weight2": ShardedTensorFactory(f"{prefix}experts.linear_fc2.weight", self.weight2,
                                                        build_fc2, merge_fc2, replica)}
        for j in range(n):
            e = ep_rank * n + j
            offsets = (*sharded_offsets, (axis, e, ep * n))
            for linear in ("linear_fc1", "linear_fc2"):
                out[f"{prefix}expert{e}.{linear}._extra_state"] = _expert_extra_state(
                    f"{prefix}experts.{linear}._extra_state", offsets, etp_rank, edp_rank)
        return out

    def _activate(self, inter, permuted_probs):
        # The routing weight multiplies in its own precision (fp32 with --moe-router-dtype fp32), rounded once.
        return (self.activation_func(inter) * permuted_probs.unsqueeze(-1)).to(inter.dtype)

    def forward(self, permuted_tokens, tokens_per_expert, permuted_probs):
        n, h = self.num_local_experts, self.hidden_size
        w1 = self.weight1.view(h, n, -1).transpose(0, 1)  # [n, h, 2F/ETP]
        w2 = self.weight2.view(n, -1, h)                    # [n, F/ETP, h]
        if permuted_tokens.shape[0] == 0:
            # Keep the weights in the graph so every rank's backward produces (zero) expert gradients, and the
            # routing weights too: their all-to-all's backward is a collective that every EP rank must run (without
            # it, a rank whose experts got no token skipped it and the EP group deadlocked or mismatched).
            return permuted_tokens + 0 * (w1.sum() + w2.sum() + permuted_probs.sum()), None
        inter = grouped_gemm(permuted_tokens, w1, tokens_per_expert)
        if self.recompute_activation and self.training and torch.is_grad_enabled():
            inter = tensor_parallel.checkpoint(self._activate, False, inter, permuted_probs)
        else:
            inter = self._activate(inter, permuted_probs)
        return grouped_gemm(inter, w2, tokens_per_expert), None

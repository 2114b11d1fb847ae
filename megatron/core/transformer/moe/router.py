"""TopKRouter: gating logits ``x W^T`` (``W: [E, h]``), top-k routing, capacity, and the router's losses.

Order of operations (Megatron's ``TopKRouter.forward``): optional input jitter ``x * U(1-eps, 1+eps)``
(``--moe-input-jitter-eps``; applied whenever set) -> logits in ``--moe-router-dtype`` -> z-loss (training) ->
``topk_routing_with_score_function`` -> capacity/token dropping (``--moe-expert-capacity-factor``) -> the
load-balancing loss on separate aux scores (training, coefficient > 0). Losses are attached to the probabilities
(aux) or the logits (z) with :class:`MoEAuxLossAutoScaler`, and ``loss / coeff`` is accumulated per layer in
``tracked_losses`` for logging (:func:`megatron.core.transformer.moe.moe_layer.reduce_moe_losses` moves them into
megatron-core's layer-wise tracker once per step). With ``config.moe_enable_routing_replay`` the top-k selection
goes through a :class:`~megatron.core.transformer.moe.router_replay.RouterReplay` (record / replay).

The sums of the load-balancing loss run over the tensor (x context) parallel group, whose ranks hold different
tokens of the same sequences under sequence parallelism: ``c_e`` is all-reduced there and ``T_tot = T x |group|``,
so the group's partial losses add up to the loss of the whole micro-batch.

``global_aux_loss`` (global-batch load balancing) takes ``c_e`` over the tensor x data (x context) parallel group
instead, and averaged over the micro-batches of the step so far: micro-batch m uses ``(c^1 + ... + c^m) / m``
(``T_tot = T x |TP x DP x CP|``); the running sums restart each step in ``finalize_model_grads``. Its logged value
is summed over that group (no average over DP), as Megatron logs it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from typing import Dict

import torch

from megatron.core.process_groups_config import pg_group
from megatron.core.transformer.norms import param_device, weights_on_meta
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    apply_random_logits,
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    sinkhorn_routing,
    switch_load_balancing_loss_func,
    topk_routing_with_score_function,
    z_loss_func,
)
from megatron.core.transformer.moe.router_replay import RouterReplay

LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
              "global_aux_loss": "global_load_balancing_loss"}


def global_load_balancing_group(pg_collection=None):
    """global_aux_loss's group: tensor x data (x context) parallel, every rank of one pipeline stage's replicas
    (``pg_collection.tp_dp_cp``, else parallel_state's); None without process groups."""
    return pg_group(pg_collection, "tp_dp_cp")


def tensor_and_context_parallel_group(pg_collection=None):
    """The group whose ranks hold different tokens of the same sequences: TP x CP (``pg_collection.tp_cp``, else
    parallel_state's; TP without context parallelism); None without process groups."""
    return pg_group(pg_collection, "tp_cp")


def _group_size(group) -> int:
    if group is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=group)


class Router(MegatronModule, ABC):
    """megatron-core's base of the routers: ``Router(config, pg_collection=None)``; a subclass maps the tokens
    ``[s, b, h]`` to ``(probs, routing_map)`` in :meth:`routing`."""

    def __init__(self, config, pg_collection=None):
        super().__init__(config=config)
        self.pg_collection = pg_collection  # tp_cp: the aux losses' sums; tp_dp_cp: the global counts
        self.layer_number = None

    @abstractmethod
    def routing(self, logits: torch.Tensor):
        """``(probs [T, E], routing_map [T, E])`` of the routing logits ``[T, E]``."""

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number


class TopKRouter(Router):
    """``TopKRouter(config, pg_collection=None)``; ``forward(input [s, b, h]) -> (probs [T, E], routing_map [T, E])``."""

    def __init__(self, config, layer_number: int = None, pg_collection=None):
        super().__init__(config, pg_collection)
        self.layer_number = layer_number
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.score_function = config.moe_router_score_function
        types = config.moe_router_load_balancing_type
        coeffs = config.moe_aux_loss_coeff
        self.lb_types = list(types) if isinstance(types, (list, tuple)) else [types]
        coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(self.lb_types)
        self.lb_coeffs = dict(zip(self.lb_types, coeffs))
        self.weight = torch.nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=config.params_dtype,
                                                     device=param_device(config)))
        self.weight.sequence_parallel = config.sequence_parallel
        if config.add_bias_linear:
            self.bias = torch.nn.Parameter(torch.empty(self.num_experts, dtype=config.params_dtype,
                                                       device=param_device(config)))
            self.bias.sequence_parallel = config.sequence_parallel
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32),
                                 persistent=False)
        else:
            self.expert_bias = None
        if self.lb_coeffs.get("global_aux_loss"):
            self.register_buffer("global_tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32),
                                 persistent=False)
            self.register_buffer("ga_steps", torch.zeros((), dtype=torch.float32), persistent=False)
        else:
            self.global_tokens_per_expert = self.ga_steps = None
        self.tracked_losses: Dict[str, torch.Tensor] = {}
        self.router_replay = RouterReplay() if config.moe_enable_routing_replay else None

    def reset_parameters(self):
        """The weight created in fp32 from the global generator (identical on every rank), then cast like
        Megatron; a zero bias."""
        if weights_on_meta(self):
            return
        with torch.no_grad():
            if self.config.perform_initialization:
                weight = torch.empty(self.num_experts, self.config.hidden_size, dtype=torch.float32)
                self.config.init_method(weight)
                self.weight.copy_(weight)
            if self.bias is not None:
                self.bias.zero_()

    # ------------------------------------------------------------------------------------- pieces
    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        bias = self.bias.to(dtype) if self.bias is not None else None
        return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)

    def apply_input_jitter(self, input: torch.Tensor) -> torch.Tensor:
        eps = self.config.moe_input_jitter_eps
        if eps is None:
            return input
        noise = torch.empty_like(input).uniform_(1.0 - eps, 1.0 + eps)
        return input * noise

    def _track(self, name: str, value: torch.Tensor):
        value = value.detach().float()
        self.tracked_losses[name] = self.tracked_losses.get(name, 0.0) + value

    def _needs_losses(self) -> bool:
        return self.training and torch.is_grad_enabled()

    def _global_counts(self, counts: torch.Tensor, num_tokens: int):
        """global_aux_loss: (running mean over this step's micro-batches of the counts summed over TP x DP (x CP),
        T_tot)."""
        group = global_load_balancing_group(self.pg_collection)
        size = _group_size(group)
        if size > 1:
            torch.distributed.all_reduce(counts, group=group)
        with torch.no_grad():
            self.global_tokens_per_expert.add_(counts)
            self.ga_steps.add_(1)
        return self.global_tokens_per_expert / self.ga_steps, num_tokens * size

    def reset_global_aux_loss_tracker(self):
        """Start the next step's global-batch counts (finalize_model_grads calls it once per step)."""
        if self.global_tokens_per_expert is not None:
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()

    def _token_count_factor(self, num_tokens: int) -> float:
        # --calculate-per-token-loss divides all gradients by the global token count later: pre-multiply.
        return float(num_tokens) if self.config.calculate_per_token_loss else 1.0

    def apply_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        coeff = self.config.moe_z_loss_coeff
        if coeff is None or not self._needs_losses():
            return logits
        group = tensor_and_context_parallel_group(self.pg_collection)
        z = z_loss_func(logits, coeff / _group_size(group)) * self._token_count_factor(logits.shape[0])
        self._track("z_loss", z / coeff)
        return MoEAuxLossAutoScaler.apply(logits, z)

    def apply_load_balancing_losses(self, logits: torch.Tensor, probs: torch.Tensor, seq_length: int,
                                    batch: int) -> torch.Tensor:
        if not self._needs_losses():
            return probs
        group = tensor_and_context_parallel_group(self.pg_collection)
        group_size = _group_size(group)
        for lb_type in self.lb_types:
            coeff = self.lb_coeffs[lb_type]
            if lb_type not in LOSS_NAMES or not coeff:
                continue
            routing_map, scores = compute_routing_scores_for_aux_loss(logits, self.topk, self.score_function)
            num_tokens = logits.shape[0]
            if lb_type == "seq_aux_loss":
                # Tokens are [s, b] flattened (s major): every sample's experts become separate columns.
                scores = scores.reshape(seq_length, batch * self.num_experts)
                routing_map = routing_map.reshape(seq_length, batch * self.num_experts)
                total = seq_length * group_size
            else:
                total = num_tokens * group_size
            counts = routing_map.sum(dim=0).float()
            if lb_type == "global_aux_loss":
                counts, total = self._global_counts(counts, num_tokens)
            elif group_size > 1:
                torch.distributed.all_reduce(counts, group=group)
            aux = switch_load_balancing_loss_func(scores, counts, total, self.topk, self.num_experts, coeff)
            if lb_type == "seq_aux_loss":
                aux = aux / batch
            aux = aux * self._token_count_factor(num_tokens)
            self._track(LOSS_NAMES[lb_type], aux / coeff)
            probs = MoEAuxLossAutoScaler.apply(probs, aux)
        return probs

    def routing(self, logits: torch.Tensor, seq_length: int, batch: int):
        logits = logits.view(-1, self.num_experts)
        logits = self.apply_z_loss(logits)
        cfg = self.config
        if "sinkhorn" in self.lb_types:
            probs, routing_map = sinkhorn_routing(logits, self.topk, self.training)
        else:
            probs, routing_map = topk_routing_with_score_function(
                logits, self.topk, use_pre_softmax=cfg.moe_router_pre_softmax, num_groups=cfg.moe_router_num_groups,
                group_topk=cfg.moe_router_group_topk, scaling_factor=cfg.moe_router_topk_scaling_factor,
                score_function=self.score_function, expert_bias=self.expert_bias, router_replay=self.router_replay)
        if cfg.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, self.topk, cfg.moe_expert_capacity_factor, cfg.moe_token_drop_policy,
                cfg.moe_pad_expert_input_to_capacity)
        probs = self.apply_load_balancing_losses(logits, probs, seq_length, batch)
        if self.expert_bias is not None and self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0).float()
        return probs, routing_map

    def _keep_expert_bias_fp32(self):
        """Float16Module casts every floating buffer to fp16/bf16: the bias and the counts stay fp32, as in
        Megatron (a bf16 bias would lose the small steps of its update; bf16 counts are exact only up to 256)."""
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias.data = self.expert_bias.data.float()
            self.local_tokens_per_expert.data = self.local_tokens_per_expert.data.float()

    def _load_from_state_dict(self, *args, **kwargs):
        self._keep_expert_bias_fp32()
        return super()._load_from_state_dict(*args, **kwargs)

    def forward(self, input: torch.Tensor):
        self._keep_expert_bias_fp32()
        seq_length, batch = input.shape[0], input.shape[1]
        input = self.apply_input_jitter(input)
        logits = self.gating(input)
        if self.config.moe_router_force_load_balancing:
            logits = apply_random_logits(logits)
        return self.routing(logits, seq_length, batch)

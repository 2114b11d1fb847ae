"""MoELayer: router -> token dispatcher -> local experts -> combine (+ shared experts).

``forward(hidden_states [s, b, h]) -> (output [s, b, h], None)``, a drop-in for the dense MLP of a transformer
layer. Expert model parallelism gives EP rank ``j`` the experts ``j * E/EP ... (j+1) * E/EP - 1``. With tensor
parallelism the layer needs sequence parallelism (every TP rank routes its own tokens), as in Megatron.

:func:`reduce_moe_losses` turns the per-layer sums that the routers tracked during a step into the values
Megatron logs (``load_balancing_loss``, ``seq_load_balancing_loss``, ``z_loss``): per layer the sum over
micro-batches of ``loss / coeff``, summed over the tensor (x context) parallel group, averaged over data
parallel ranks (``global_load_balancing_loss``: summed over them too), divided by the number of micro-batches;
logged value = sum over layers / number of MoE layers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Tuple, Union

import torch

from megatron.core import tensor_parallel
from megatron.core.device import current_device
from megatron.core.process_groups_config import pg_group, pg_rank, pg_size
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import param_device
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
    save_to_aux_losses_tracker,
    track_moe_metrics,
)
from megatron.core.transformer.moe.router import (
    LOSS_NAMES,
    TopKRouter,
    global_load_balancing_group,
    tensor_and_context_parallel_group,
)
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import make_sharded_tensors_for_checkpoint


class RouterInterface(Protocol):
    """What an MoE layer needs of its router: ``forward(input [s, b, h]) -> (probs [T, E], routing_map [T, E])``
    and ``set_layer_number(layer_number)`` (the layer's 1-based number, used to log its losses)."""

    def forward(self, input: torch.Tensor, /) -> Tuple[torch.Tensor, torch.Tensor]:
        ...

    def set_layer_number(self, layer_number: int) -> None:
        ...


class RouterBuilder(Protocol):
    """A callable building a router from keywords: ``builder(config=..., pg_collection=...) -> RouterInterface``
    (a router class such as :class:`TopKRouter` is one)."""

    def __call__(self, /, *, config, pg_collection) -> RouterInterface:
        ...


@dataclass
class MoESubmodules:
    experts: Union[ModuleSpec, type] = None
    shared_experts: Union[ModuleSpec, type] = None
    router: RouterBuilder = TopKRouter


class BaseMoELayer(MegatronModule):
    """The expert layout of an MoE layer: ``pg_collection``'s groups (``ep``, ``expt_tp``, ``tp_ep``, ``expt_dp`` for
    the experts and dispatcher, ``tp_cp`` / ``tp_dp_cp`` for the router's losses; a group left None, or no collection,
    is parallel_state's)."""

    def __init__(self, config, layer_number: Optional[int] = None, pg_collection=None):
        super().__init__(config=config)
        self.pg_collection = pg_collection
        self.layer_number = layer_number
        ep = pg_size(pg_collection, "ep")
        if config.num_moe_experts % ep != 0:
            raise ValueError(f"num_moe_experts ({config.num_moe_experts}) must be divisible by the expert model "
                             f"parallel size ({ep})")
        self.expert_parallel_size = ep
        self.num_local_experts = config.num_moe_experts // ep
        ep_rank = pg_rank(pg_collection, "ep")
        offset = ep_rank * self.num_local_experts
        self.local_expert_indices = [offset + i for i in range(self.num_local_experts)]

    def set_layer_number(self, layer_number: int) -> None:
        """The layer's number, passed on to its router."""
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)


class MoELayer(BaseMoELayer):
    """``MoELayer(config, submodules=MoESubmodules(experts=..., shared_experts=...), layer_number=None,
    pg_collection=None)``."""

    def __init__(self, config, submodules: MoESubmodules = None, layer_number: Optional[int] = None,
                 pg_collection=None):
        super().__init__(config, layer_number, pg_collection)
        submodules = submodules or MoESubmodules()
        groups = {} if pg_collection is None else {"pg_collection": pg_collection}
        self.router: RouterInterface = (submodules.router or TopKRouter)(config=config, pg_collection=pg_collection)
        if layer_number is not None:
            self.router.set_layer_number(layer_number)
        experts = submodules.experts
        if experts is None:
            from megatron.core.transformer.moe.experts import SequentialMLP

            experts = SequentialMLP
        expert_config = config
        if config.moe_latent_size:  # experts on the latent width, between two replicated projections
            expert_config = dataclasses.replace(config, hidden_size=config.moe_latent_size)
            self.fc1_latent_proj = _latent_projection(config, config.hidden_size, config.moe_latent_size,
                                                      config.init_method)
            self.fc2_latent_proj = _latent_projection(config, config.moe_latent_size, config.hidden_size,
                                                      config.output_layer_init_method)
        self.experts = build_module(experts, self.num_local_experts, expert_config,
                                    local_expert_indices=self.local_expert_indices, **groups)
        dispatcher = config.moe_token_dispatcher_type
        if dispatcher == "allgather":
            cls = MoEAllGatherTokenDispatcher
        elif dispatcher == "alltoall":
            cls = MoEAlltoAllTokenDispatcher
        else:
            raise ValueError(f"moe_token_dispatcher_type {dispatcher!r} is not implemented (allgather or alltoall)")
        self.token_dispatcher = cls(self.num_local_experts, self.local_expert_indices, config, **groups)
        self.use_shared_expert = config.moe_shared_expert_intermediate_size is not None
        if self.use_shared_expert:
            shared = submodules.shared_experts
            if shared is None:
                from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

                shared = SharedExpertMLP
            self.shared_experts = build_module(shared, config=config, gate=config.moe_shared_expert_gate, **groups)
        self.recompute_shared_experts = config.recomputes("shared_experts")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None):
        """The default; the latent projections (replicated linear layers) also carry megatron-core's empty
        ``_extra_state`` object, as its Transformer Engine linears do."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for name in ("fc1_latent_proj", "fc2_latent_proj"):
            if hasattr(self, name):
                metadata = ensure_metadata_has_dp_cp_group(metadata)
                out.update(make_sharded_tensors_for_checkpoint(
                    {"_extra_state": None}, f"{prefix}{name}.", {}, sharded_offsets,
                    tp_group=metadata.get("tp_group"), dp_cp_group=metadata["dp_cp_group"]))
        return out

    def route(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """The router: ``(probs, routing_map)`` over all experts for each token."""
        if padding_mask is not None:
            raise NotImplementedError("MoELayer.route: padding_mask (padding tokens left out of the router's "
                                      "losses) is not supported")
        return self.router(hidden_states)

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """Before the dispatch: the latent down-projection (``moe_latent_size``), Llama 4's routing weight on the
        input (``moe_apply_probs_on_input``), the dispatcher's local permutation. Returns ``(tokens, probs)``."""
        if self.config.moe_latent_size:
            hidden_states = self.fc1_latent_proj(hidden_states)
        if self.config.moe_apply_probs_on_input:
            # Llama 4: the (top-1) routing weight scales the expert's input; its output is taken as it is.
            weight = probs.sum(dim=-1).view(*hidden_states.shape[:-1], 1)
            hidden_states = hidden_states * weight.to(hidden_states.dtype)
            probs = routing_map.to(probs.dtype)
        return self.token_dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)

    def dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The dispatcher's communication (all-to-all / all-gather): ``(tokens, probs)`` on the experts' ranks."""
        return self.token_dispatcher.token_dispatch(hidden_states, probs)

    def shared_experts_compute(self, hidden_states: torch.Tensor):
        """The shared experts' output on the (un-dispatched) tokens, or None without shared experts."""
        if not self.use_shared_expert:
            return None
        if self.recompute_shared_experts and self.training and torch.is_grad_enabled():
            return tensor_parallel.checkpoint(self.shared_experts, False, hidden_states)
        return self.shared_experts(hidden_states)

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Sort the received tokens by local expert, run the experts, unsort: ``(output, None)``."""
        tokens, tokens_per_expert, permuted_probs = self.token_dispatcher.dispatch_postprocess(hidden_states, probs)
        expert_output, mlp_bias = self.experts(tokens, tokens_per_expert, permuted_probs)
        if mlp_bias is not None:
            raise ValueError("expert biases are added inside the experts")
        return self.token_dispatcher.combine_preprocess(expert_output), None

    def combine(self, output: torch.Tensor):
        """The dispatcher's communication back to the tokens' ranks."""
        return self.token_dispatcher.token_combine(output)

    def postprocess(self, output: torch.Tensor, shared_expert_output: Optional[torch.Tensor]):
        """Un-permute into the tokens, the latent up-projection, plus the shared experts' output."""
        output = self.token_dispatcher.combine_postprocess(output)
        if self.config.moe_latent_size:
            output = self.fc2_latent_proj(output)
        if shared_expert_output is not None:
            output = output + shared_expert_output
        return output

    def forward(self, hidden_states: torch.Tensor):
        """route -> preprocess -> dispatch -> routed experts -> combine -> postprocess (+ shared experts): the
        stages that megatron-core's combined 1F1B schedule also runs one by one."""
        if (self.training and pg_size(self.pg_collection, "tp") > 1
                and not self.config.sequence_parallel):
            raise ValueError("During training, performance may degrade if MoE and tensor parallelism are enabled "
                             "without also enabling sequence parallelism.")
        probs, routing_map = self.route(hidden_states)
        tokens, probs = self.preprocess(hidden_states, probs, routing_map)
        tokens, probs = self.dispatch(tokens, probs)
        output, _ = self.routed_experts_compute(tokens, probs)
        output = self.combine(output)
        return self.postprocess(output, self.shared_experts_compute(hidden_states)), None


def _latent_projection(config, in_features: int, out_features: int, init_method) -> torch.nn.Linear:
    """``fc1_latent_proj`` / ``fc2_latent_proj`` (``--moe-latent-size``): a bias-free linear layer replicated on the
    tensor-parallel ranks; under sequence parallelism each rank projects its own tokens, so its gradient is
    all-reduced over TP like a norm's (``sequence_parallel`` attribute)."""
    layer = tensor_parallel.InitializedLinear(in_features, out_features, init_method, bias=False, fp32_master=True,
                                              perform_initialization=config.perform_initialization,
                                              dtype=config.params_dtype, device=param_device(config))
    layer.weight.sequence_parallel = config.sequence_parallel
    return layer


def moe_routers(model) -> List[TopKRouter]:
    """The routers of a model (or list of model chunks), in layer order."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


def reduce_moe_losses(model, num_microbatches: int, num_moe_layers: int,
                      per_layer_logging: bool = False, pg_collection=None) -> Dict[str, float]:
    """Megatron's MoE metrics of the last step (module docstring); clears the routers' tracked sums.

    The routers' sums go into megatron-core's layer-wise tracker (:func:`save_to_aux_losses_tracker`, with the
    router loss's reduce group: ``tp_cp``, or ``tp_dp_cp`` for ``global_load_balancing_loss``), together with any
    value saved there directly this step; :func:`track_moe_metrics` then reduces (SUM over PP and the reduce group,
    MEAN over DP unless the group spans it) and scales by ``1 / num_microbatches``. Collective over the world (every
    rank must call it, with the same ``num_moe_layers``); the groups are ``pg_collection``'s (else parallel_state's).
    """
    tracker = get_moe_layer_wise_logging_tracker()
    routers = moe_routers(model)
    local = {name for r in routers for name in r.tracked_losses}
    local |= {name for name, entry in tracker.items() if bool(entry["values"].ne(0).any())}
    # Agree on the names: a pipeline stage may hold no MoE layer.
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, sorted(local))
    names = sorted({n for g in gathered for n in g})
    for stale in [name for name in tracker if name not in names]:
        del tracker[stale]  # zero entries of an earlier model's losses
    if not names or num_moe_layers == 0:
        for r in routers:
            r.tracked_losses.clear()
        clear_aux_losses_tracker()
        return {}
    num_layers = max([r.layer_number or 0 for r in routers] + [len(e["values"]) for e in tracker.values()] + [0])
    num_layers = torch.tensor([num_layers], dtype=torch.int64)
    torch.distributed.all_reduce(num_layers, op=torch.distributed.ReduceOp.MAX)
    total_layers = int(num_layers.item())
    groups = {"reduce_group": tensor_and_context_parallel_group(pg_collection), "reduce_group_has_dp": False}
    global_groups = {"reduce_group": global_load_balancing_group(pg_collection), "reduce_group_has_dp": True}
    for name in names:
        entry = tracker.get(name)
        if entry is None or len(entry["values"]) != total_layers:
            values = torch.zeros(total_layers, device=current_device())
            if entry is not None:
                values[:len(entry["values"])] += entry["values"].cpu()
            tracker[name] = {"values": values}
        # This step's groups (an entry may hold the groups of an earlier parallel_state initialisation).
        kind = global_groups if name == LOSS_NAMES["global_aux_loss"] else groups
        tracker[name].update(avg_group=None, **kind)
    for r in routers:
        for name, value in r.tracked_losses.items():
            kind = global_groups if name == LOSS_NAMES["global_aux_loss"] else groups
            save_to_aux_losses_tracker(name, value.to(tracker[name]["values"].device), r.layer_number,
                                       total_layers, **kind)
        r.tracked_losses.clear()
    totals, logged = {}, _ScalarLog()
    track_moe_metrics(1.0 / num_microbatches, 0, writer=logged, total_loss_dict=totals,
                      per_layer_logging=per_layer_logging, track_names=names, num_layers=num_moe_layers,
                      pg_collection=pg_collection)
    out = {}
    for name in names:
        out[name] = float(totals[name])
        if per_layer_logging:
            out.update({key: float(v) for key, v in logged.scalars.items()
                        if key.startswith(f"moe/{name}_layer_") and v != 0})
    return out


class _ScalarLog:
    """A writer that keeps what :func:`track_moe_metrics` logs (``add_scalar``)."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, key, value, iteration):
        self.scalars[key] = value

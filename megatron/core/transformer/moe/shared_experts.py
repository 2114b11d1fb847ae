"""Shared experts: a dense tensor-parallel MLP of width ``moe_shared_expert_intermediate_size`` that every token
goes through, added to the routed output; with ``--moe-shared-expert-gate`` its output is scaled by
``sigmoid(x . g)`` (``gate_weight [1, h]``)."""
from __future__ import annotations

import dataclasses

import torch

from megatron.core.process_groups_config import group_of
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.norms import param_device, weights_on_meta


class SharedExpertMLP(MLP):
    """megatron-core: ``SharedExpertMLP(config, submodules, gate, pg_collection=None)``."""

    def __init__(self, config, submodules=None, gate: bool = False, pg_collection=None):
        shared_config = dataclasses.replace(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size,
                                            add_bias_linear=False)
        super().__init__(shared_config, submodules=submodules, tp_group=group_of(pg_collection, "tp"))
        self.pg_collection = pg_collection
        self.use_shared_expert_gate = gate
        if gate:
            self.gate_weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype,
                                                              device=param_device(config)))
            self.gate_weight.sequence_parallel = config.sequence_parallel
            self._draw_gate()
        else:
            self.gate_weight = None

    def _draw_gate(self):
        if self.config.perform_initialization and not weights_on_meta(self):
            weight = torch.empty(1, self.config.hidden_size, dtype=torch.float32)
            self.config.init_method(weight)
            with torch.no_grad():
                self.gate_weight.copy_(weight)

    def reset_parameters(self):
        """The MLP's linears, then the gate, drawn in the constructor's order."""
        self.linear_fc1.reset_parameters()
        self.linear_fc2.reset_parameters()
        if self.gate_weight is not None:
            self._draw_gate()

    def forward(self, hidden_states):
        output, bias = super().forward(hidden_states)
        if bias is not None:
            output = output + bias
        if self.use_shared_expert_gate:
            output = output * torch.sigmoid(torch.nn.functional.linear(hidden_states, self.gate_weight))
        return output


def set_tensor_grad_fn_sequence_sr(tensor, value):
    """Give ``tensor.grad_fn`` the autograd sequence number ``value`` (nothing for None or a leaf): among nodes
    ready at the same time the engine runs the higher number first, so this moves a node's backward earlier
    (larger) or later (smaller). Needs PyTorch >= 2.2; older versions only warn."""
    from megatron.core.utils import is_torch_min_version

    if not is_torch_min_version("2.2.0"):
        import warnings

        warnings.warn("PyTorch < 2.2 cannot set an autograd node's sequence number; the backward order is unchanged")
        return
    if tensor is not None and tensor.grad_fn is not None:
        tensor.grad_fn._set_sequence_nr(value)

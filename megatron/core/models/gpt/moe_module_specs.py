"""The MoE MLP's module spec (megatron-core's ``get_moe_module_spec``): ``MoELayer`` with a TopKRouter, the token
dispatcher, the experts (``SequentialMLP``, one MLP per local expert, or ``GroupedMLP``, one batched GEMM over
them, with ``moe_grouped_gemm``) and the shared experts (``SharedExpertMLP``), built from megatron.core's own
column / row parallel linears."""
from __future__ import annotations

from typing import Optional

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec


def get_moe_module_spec(use_te: Optional[bool] = True, num_experts: Optional[int] = None,
                        moe_grouped_gemm: Optional[bool] = False,
                        moe_use_legacy_grouped_gemm: Optional[bool] = False) -> ModuleSpec:
    """The MoE MLP spec. ``use_te`` (megatron-core's default) asks for Transformer Engine layers, which this
    library does not build: a clear error says so (pass ``use_te=False`` for the local layers)."""
    if use_te:
        from megatron.core.transformer.te_support import transformer_engine_layers_unavailable

        transformer_engine_layers_unavailable()
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(
        experts=GroupedMLP if moe_grouped_gemm else SequentialMLP,
        shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))))

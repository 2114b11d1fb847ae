"""The MoE MLP's module spec (megatron-core's ``get_moe_module_spec``): ``MoELayer`` with a TopKRouter, the token
dispatcher, the experts (``SequentialMLP``, one MLP per local expert, or ``GroupedMLP``, one batched GEMM over
them, with ``moe_grouped_gemm``) and the shared experts (``SharedExpertMLP``), with the classes a backend provider
names (:mod:`megatron.core.models.backends`)."""
from __future__ import annotations

from typing import Optional

from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec


def get_moe_module_spec(use_te: Optional[bool] = True, num_experts: Optional[int] = None,
                        moe_grouped_gemm: Optional[bool] = False,
                        moe_use_legacy_grouped_gemm: Optional[bool] = False) -> ModuleSpec:
    """The MoE MLP spec with this library's layers. ``use_te`` (megatron-core's default) asks for Transformer Engine
    layers, which this library does not build: a clear error says so (pass ``use_te=False``)."""
    if use_te:
        from megatron.core.transformer.te_support import transformer_engine_layers_unavailable

        transformer_engine_layers_unavailable()
    return get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts, moe_grouped_gemm,
                                           moe_use_legacy_grouped_gemm)


def get_moe_module_spec_for_backend(backend: BackendSpecProvider, num_experts: Optional[int] = None,
                                    moe_grouped_gemm: Optional[bool] = False,
                                    moe_use_legacy_grouped_gemm: Optional[bool] = False,
                                    use_te_activation_func: bool = False) -> ModuleSpec:
    """The MoE MLP spec from ``backend``'s experts and linears (the number of experts the layer builds is
    ``config.num_moe_experts``; ``num_experts`` is megatron-core's argument and may be left out). An activation
    module (``use_te_activation_func``) is not supported by this library's MLPs: refused."""
    if use_te_activation_func and backend.activation_func() is not None:
        raise ValueError("use_te_activation_func: this library's MLPs apply config.activation_func themselves")
    expert_module, expert_submodules = backend.grouped_mlp_modules(bool(moe_grouped_gemm),
                                                                   bool(moe_use_legacy_grouped_gemm))
    shared = MLPSubmodules(linear_fc1=backend.column_parallel_linear(), linear_fc2=backend.row_parallel_linear())
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(
        experts=ModuleSpec(module=expert_module, submodules=expert_submodules),
        shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=shared)))

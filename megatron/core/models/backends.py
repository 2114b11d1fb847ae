"""Which module classes a layer spec uses (megatron-core's backend spec providers).

A provider answers the spec builders' questions (``get_mlp_module_spec_for_backend``,
``get_moe_module_spec_for_backend``, ``get_mtp_layer_spec_for_backend``): the column / row parallel linears, whether
a norm is fused into the following linear, the norm, the core attention, the expert modules and an activation
module. :class:`LocalSpecProvider` gives this library's own layers; Transformer Engine's provider is not built here.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Tuple

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.norms import FusedLayerNorm


class BackendSpecProvider(ABC):
    """The questions a spec builder asks a backend."""

    @abstractmethod
    def column_parallel_linear(self) -> type:
        """The column-parallel linear class."""

    @abstractmethod
    def row_parallel_linear(self) -> type:
        """The row-parallel linear class."""

    @abstractmethod
    def fuse_layernorm_and_linear(self) -> bool:
        """Whether a norm and the linear after it are one module."""

    @abstractmethod
    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        """The fused norm + column-parallel linear class (None without one)."""

    @abstractmethod
    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        """The norm class."""

    @abstractmethod
    def core_attention(self) -> type:
        """The core attention class."""

    @abstractmethod
    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool,
                            moe_use_legacy_grouped_gemm: bool) -> Tuple[type, Optional[MLPSubmodules]]:
        """The experts' class and its submodules."""

    @abstractmethod
    def activation_func(self) -> type:
        """An activation module (None: the MLP applies ``config.activation_func`` itself)."""


class LocalSpecProvider(BackendSpecProvider):
    """This library's layers: ColumnParallelLinear / RowParallelLinear, no fused norm + linear, ``FusedLayerNorm``
    (LayerNorm or RMSNorm as ``config.normalization`` says, so ``rms_norm`` needs no other class),
    DotProductAttention, GroupedMLP (with grouped GEMM) or SequentialMLP experts, no activation module."""

    def column_parallel_linear(self) -> type:
        return ColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return RowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return False

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        return None

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return FusedLayerNorm

    def core_attention(self) -> type:
        return DotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool,
                            moe_use_legacy_grouped_gemm: bool) -> Tuple[type, Optional[MLPSubmodules]]:
        if moe_use_grouped_gemm:
            return GroupedMLP, None
        return SequentialMLP, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)

    def activation_func(self) -> type:
        return None

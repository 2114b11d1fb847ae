"""Enums of the transformer (Megatron's legacy values; megatron-core uses the same names). Defined in
:mod:`megatron.core.enums` (below the fused kernels, which need ``AttnMaskType``); this is megatron-core's path."""
from megatron.core.enums import AttnBackend, AttnMaskType, AttnType, LayerType, ModelType  # noqa: F401

__all__ = ["AttnBackend", "AttnMaskType", "AttnType", "LayerType", "ModelType"]

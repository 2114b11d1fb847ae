"""The norms of the transformer (``LayerNorm``, ``RMSNorm``, ``get_norm``, ``FusedLayerNorm``); they are defined in
:mod:`megatron.core.fusions.fused_layer_norm` (megatron-core's home of ``FusedLayerNorm``)."""
from megatron.core.fusions.fused_layer_norm import FusedLayerNorm, LayerNorm, RMSNorm, get_norm, param_device  # noqa: F401

__all__ = ["FusedLayerNorm", "LayerNorm", "RMSNorm", "get_norm", "param_device"]

"""The norms of the transformer (``LayerNorm``, ``RMSNorm``, ``get_norm``, ``FusedLayerNorm``); they are defined in
:mod:`megatron.core.fusions.fused_layer_norm` (megatron-core's home of ``FusedLayerNorm``)."""
from megatron.core.fusions.fused_layer_norm import (FusedLayerNorm, LayerNorm, RMSNorm, get_norm,  # noqa: F401
                                                    init_device, param_device, weights_on_meta)

__all__ = ["FusedLayerNorm", "LayerNorm", "RMSNorm", "get_norm", "init_device", "param_device",
           "weights_on_meta"]

"""megatron.core.transformer: the one transformer implementation (legacy and megatron-core APIs)."""
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.transformer.transformer_block import TransformerBlock

__all__ = ["TransformerConfig", "MegatronModule", "ModuleSpec", "build_module", "TransformerLayer",
           "TransformerLayerSubmodules", "TransformerBlock"]

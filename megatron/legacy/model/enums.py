"""megatron.model.enums (legacy path)."""
from megatron.core.enums import ModelType
from megatron.core.transformer.enums import AttnMaskType, AttnType, LayerType

__all__ = ["LayerType", "AttnType", "AttnMaskType", "ModelType"]

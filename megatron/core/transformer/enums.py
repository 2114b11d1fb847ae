"""Enums of the transformer (Megatron's legacy values; megatron-core uses the same names)."""
import enum

from megatron.core.enums import ModelType  # noqa: F401  (re-exported as Megatron does)


class LayerType(enum.Enum):
    encoder = 1
    decoder = 2
    retro_encoder = 3
    retro_decoder = 4
    retro_decoder_with_retriever = 5


class AttnType(enum.Enum):
    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    """Legacy values 1-2; megatron-core's further names. Every type honours an explicit boolean mask (True =
    masked); ``causal`` alone builds the triangular mask when none is given."""
    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5


class AttnBackend(enum.Enum):
    """Attention implementation choice (megatron-core's ``--attention-backend``)."""
    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5

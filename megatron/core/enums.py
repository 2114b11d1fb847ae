"""Enums of the library, defined once at the bottom of ``megatron.core`` so that every layer (fusions, transformer,
models) can import them; ``megatron.core.transformer.enums`` re-exports the transformer ones under megatron-core's
path."""
import enum


class ModelType(enum.Enum):
    encoder_or_decoder = 1
    encoder_and_decoder = 2
    retro_encoder = 3
    retro_decoder = 4


class Fp8Recipe(str, enum.Enum):
    """``--fp8-recipe`` values (megatron-core's enum; the string values are the flag's choices)."""
    delayed = "delayed"
    tensorwise = "tensorwise"
    mxfp8 = "mxfp8"
    blockwise = "blockwise"
    custom = "custom"


class Fp4Recipe(str, enum.Enum):
    """``--fp4-recipe`` values (megatron-core's enum): ``nvfp4`` (NVIDIA's 4-bit block format, Transformer Engine
    only) or ``custom`` (a user quantizer factory). FP4 training itself needs Transformer Engine on a Blackwell GPU
    and is not available here; the enum is the names' one home."""
    nvfp4 = "nvfp4"
    custom = "custom"


class LayerType(enum.Enum):
    """Legacy values 1-5; ``embedding`` / ``loss`` / ``mtp`` (megatron-core's) name the entries of a pipeline layer
    layout (:mod:`megatron.core.transformer.pipeline_parallel_layer_layout`)."""
    encoder = 1
    decoder = 2
    retro_encoder = 3
    retro_decoder = 4
    retro_decoder_with_retriever = 5
    embedding = 6
    loss = 7
    mtp = 8


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

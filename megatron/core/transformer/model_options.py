"""Model settings that Megatron keeps on the command line rather than in TransformerConfig.

Megatron's legacy model classes read a handful of settings from the global ``args`` (vocabulary size,
position-embedding type, ``--openai-gelu``, ``--use-flash-attn`` ...). ``megatron.core`` never reads global
args, so the one implementation reads them as attributes of the config object instead, falling back to
Megatron's flag defaults listed here. The legacy wrappers in ``megatron.legacy.model`` copy the values from the
global args onto (a copy of) the config; library users simply set the attributes they need::

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    config.padded_vocab_size = 128
    config.max_position_embeddings = 256
"""
from __future__ import annotations

import copy

# name -> default. Names equal the argparse destinations of the corresponding Megatron flags.
MODEL_OPTION_DEFAULTS = {
    "padded_vocab_size": None,                 # tokenizer vocab padded (--make-vocab-size-divisible-by x TP)
    "max_position_embeddings": None,           # --max-position-embeddings
    "position_embedding_type": "learned_absolute",  # --position-embedding-type {learned_absolute, rope}
    "add_position_embedding": True,            # --no-position-embedding (deprecated)
    "rotary_percent": 1.0,                     # --rotary-percent
    "rotary_base": 10000,                      # --rotary-base (later Megatron)
    "rotary_seq_len_interpolation_factor": None,  # --rotary-seq-len-interpolation-factor
    "untie_embeddings_and_output_weights": False,  # --untie-embeddings-and-output-weights
    "openai_gelu": False,                      # --openai-gelu
    "onnx_safe": None,                         # --onnx-safe
    "squared_relu": False,                     # --squared-relu
    "use_flash_attn": False,                   # --use-flash-attn
    "attention_backend": "auto",               # auto: SDPA for causal/padding masks; unfused: explicit softmax
    "transformer_impl": "local",               # --transformer-impl {local, transformer_engine}
    "embedding_weights_in_fp32": False,        # --embedding-weights-in-fp32
    "fp16_lm_cross_entropy": False,            # --fp16-lm-cross-entropy
    "standalone_embedding_stage": False,       # --standalone-embedding-stage
    "output_bert_embeddings": False,           # --output-bert-embeddings
    "add_qkv_bias": False,                     # --add-qkv-bias (bias on QKV only, later Megatron)
}

_ATTENTION_BACKENDS = ("auto", "unfused", "sdpa", "flash", "local")


def model_option(config, name: str):
    """The value of model setting ``name``: ``config.<name>`` if set, else Megatron's default."""
    if name not in MODEL_OPTION_DEFAULTS:
        raise KeyError(f"unknown model option {name!r}")
    value = getattr(config, name, MODEL_OPTION_DEFAULTS[name])
    if name == "attention_backend":
        value = getattr(value, "name", value)  # accept an AttnBackend enum member
        if value not in _ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {_ATTENTION_BACKENDS}, got {value!r}")
    return value


def required_model_option(config, name: str, flag: str):
    """Like :func:`model_option` for settings without a default; raise a clear error when missing."""
    value = model_option(config, name)
    if value is None:
        raise ValueError(
            f"the model needs {name}: pass {flag} (training scripts), or set config.{name} when building the "
            f"model directly from a TransformerConfig"
        )
    return value


def config_with_options(config, **options):
    """A shallow copy of ``config`` with the given model options set (those that are not None)."""
    new = copy.copy(config)
    for name, value in options.items():
        if name not in MODEL_OPTION_DEFAULTS:
            raise KeyError(f"unknown model option {name!r}")
        if value is not None:
            setattr(new, name, value)
    return new

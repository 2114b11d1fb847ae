"""``megatron.model``: Megatron's pre-2024 import path, an alias of megatron.legacy.model (same module objects)."""
import importlib
import sys

from megatron.legacy.model import *  # noqa: F401,F403
from megatron.legacy.model import __all__, __getattr__  # noqa: F401

_SUBMODULES = ("bert_model", "classification", "enums", "fused_bias_gelu", "fused_layer_norm", "fused_softmax",
               "global_args", "gpt_model", "t5_model", "language_model", "module", "multiple_choice", "rms_norm",
               "rotary_pos_embedding", "transformer", "utils")
for _name in _SUBMODULES:
    _module = importlib.import_module(f"megatron.legacy.model.{_name}")
    sys.modules[f"{__name__}.{_name}"] = _module
    globals()[_name] = _module

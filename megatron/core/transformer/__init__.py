"""megatron.core.transformer: the one transformer implementation (legacy and megatron-core APIs).

The public names are resolved on first access (PEP 562), so importing a light submodule such as
``megatron.core.transformer.enums`` (e.g. from ``megatron.core.fusions.fused_softmax``) does not build the whole
package: there is no import cycle between the transformer and the fused kernels it uses.
"""
import importlib

_EXPORTS = {
    "TransformerConfig": "megatron.core.transformer.transformer_config",
    "MegatronModule": "megatron.core.transformer.module",
    "ModuleSpec": "megatron.core.transformer.spec_utils",
    "build_module": "megatron.core.transformer.spec_utils",
    "TransformerLayer": "megatron.core.transformer.transformer_layer",
    "TransformerLayerSubmodules": "megatron.core.transformer.transformer_layer",
    "TransformerBlock": "megatron.core.transformer.transformer_block",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megatron.core.transformer' has no attribute {name!r}")

"""megatron-core's module specs: which classes a TransformerLayer is assembled from.

A :class:`ModuleSpec` names a module class (or function), keyword params and nested ``submodules``;
:func:`build_module` instantiates it. Layer specs come from
:func:`megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec`.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Tuple, Union

import torch


class IdentityOp(torch.nn.Module):
    """Returns its first input (an absent norm in a spec)."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x, *args, **kwargs):
        return x


class IdentityFuncOp(IdentityOp):
    """Returns a function that returns its first input (an absent bias-dropout-add in a spec)."""

    def forward(self, *args, **kwargs):
        return super().forward


@dataclass
class ModuleSpec:
    module: Union[Tuple, type, types.FunctionType]
    params: dict = field(default_factory=lambda: {})
    submodules: object = None
    metainfo: dict = field(default_factory=lambda: {})   # hints for spec builders (e.g. fuse_input_layernorm)


def import_module(module_path: Tuple[str, str]):
    base_path, name = module_path
    module = __import__(base_path, globals(), locals(), [name])
    return vars(module)[name]


def get_module(spec_or_module, **additional_kwargs):
    if isinstance(spec_or_module, (type, types.FunctionType)):
        return spec_or_module
    if isinstance(spec_or_module.module, (type, types.FunctionType)):
        return spec_or_module.module
    return import_module(spec_or_module.module)


def build_module(spec_or_module, *args, **kwargs):
    """Instantiate a spec (class + params + submodules), a class, or return a function as is."""
    if isinstance(spec_or_module, types.FunctionType):
        return spec_or_module
    if isinstance(spec_or_module, ModuleSpec) and isinstance(spec_or_module.module, types.FunctionType):
        return spec_or_module.module
    if isinstance(spec_or_module, type):
        module = spec_or_module
    elif isinstance(spec_or_module.module, type):
        module = spec_or_module.module
    else:
        module = import_module(spec_or_module.module)
    if isinstance(module, types.FunctionType):
        return module
    if isinstance(spec_or_module, ModuleSpec) and spec_or_module.submodules is not None:
        kwargs["submodules"] = spec_or_module.submodules
    params = spec_or_module.params if isinstance(spec_or_module, ModuleSpec) else {}
    try:
        return module(*args, **params, **kwargs)
    except Exception as e:  # name the module that failed, the spec error is otherwise hard to place
        if hasattr(e, "add_note"):
            e.add_note(f"(when instantiating {module.__name__} from a ModuleSpec)")
        raise

"""megatron-core's config logger: with ``config.config_logger_dir`` set (``--config-logger-dir``), the entry points
(models, DistributedDataParallel, the optimizers) dump their constructor arguments to that directory, so that two
runs can be compared file by file.

Files: ``<dir>/<prefix>.rank_<rank_str>.iter<k>.json`` for a plain dict (JSON through
:class:`JSONEncoderWithMcoreTypes`) or ``.pth`` for an ``OrderedDict`` (``torch.save``, e.g. a state dict or a
model's inputs and logits). ``prefix`` defaults to the class of ``dict_data['self']`` (a constructor's
``locals()``); ``rank_str`` to ``"<tp>_<dp>_<cp>_<pp>_<ep>"`` (parallel_state's ranks); ``k`` counts the dumps to
the same ``<dir>/<prefix>.rank_<rank_str>`` in this process, from 0.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections import OrderedDict

import torch

# Dumps made so far to each path prefix (the ``.iter<k>`` counter of this process).
_path_counts: dict = {}


def get_config_logger_path(config) -> str:
    """``config.config_logger_dir``; ``''`` when the config has none."""
    return getattr(config, "config_logger_dir", "")


def has_config_logger_enabled(config) -> bool:
    """Whether the config names a config-logger directory."""
    return get_config_logger_path(config) != ""


def get_path_count(path) -> int:
    """How many times ``path`` was counted before this call (0 the first time); counts this call."""
    count = _path_counts.get(path, 0)
    _path_counts[path] = count + 1
    return count


def get_path_with_count(path) -> str:
    """``f"{path}.iter{k}"`` with ``k = get_path_count(path)``."""
    return f"{path}.iter{get_path_count(path)}"


class JSONEncoderWithMcoreTypes(json.JSONEncoder):
    """JSON for megatron-core objects that ``json`` cannot write: functions, process groups, dtypes, classes and
    ``AttnMaskType`` as ``str(o)``; dicts and lists (incl. ``ModuleList``) element by element; a ``Float16Module``
    as ``{"Float16Module": {"module": ...}}``; an ``nn.Module`` as ``{child name: child}`` (a leaf module as
    ``str(module)``); dataclasses (configs, specs) field by field; anything else as ``str(o)``."""

    def default(self, o):
        kind = type(o).__name__
        if kind in ("function", "ProcessGroup"):
            return str(o)
        if kind in ("dict", "OrderedDict"):
            return {key: self.default(value) for key, value in o.items()}
        if kind in ("list", "ModuleList"):
            return [self.default(value) for value in o]
        if kind == "UniqueDescriptor":
            return {name: self.default(getattr(o, name)) for name in dir(o) if not name.startswith("__")}
        if isinstance(o, torch.dtype):
            return str(o)
        if kind == "Float16Module":
            return {"Float16Module": {"module": self.default(o.module)}}
        if isinstance(o, torch.nn.Module):
            children = getattr(o, "_modules", {})
            return {name: self.default(child) for name, child in children.items()} if children else str(o)
        if kind in ("ABCMeta", "type", "AttnMaskType"):
            return str(o)
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            # Field by field (the encoder then writes each value): what dataclasses.asdict gives, without
            # deep-copying values such as process groups.
            return {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}
        try:
            return super().default(o)
        except Exception:  # noqa: BLE001 - whatever json cannot write is written as its str
            return str(o)


def log_config_to_disk(config, dict_data, prefix: str = "", rank_str: str = "") -> None:
    """Dump ``dict_data`` under ``config.config_logger_dir`` (created if missing) as described in the module
    docstring. A ``'self'`` entry is removed from ``dict_data`` (and names the default prefix)."""
    directory = get_config_logger_path(config)
    if not directory:
        raise ValueError("log_config_to_disk: the config has no config_logger_dir (--config-logger-dir)")
    os.makedirs(directory, exist_ok=True)
    if "self" in dict_data:
        prefix = prefix or type(dict_data["self"]).__name__
        del dict_data["self"]
    if not rank_str:
        from megatron.core import parallel_state

        rank_str = parallel_state.get_all_ranks()
    path = get_path_with_count(os.path.join(directory, f"{prefix}.rank_{rank_str}"))
    if isinstance(dict_data, OrderedDict):
        torch.save(dict_data, f"{path}.pth")
    else:
        with open(f"{path}.json", "w") as f:
            json.dump(dict_data, f, cls=JSONEncoderWithMcoreTypes)


__all__ = ["has_config_logger_enabled", "log_config_to_disk"]

"""``--yaml-cfg FILE``: the run's configuration from Megatron-LM's YAML form instead of the command line.

The file's form (Megatron-LM's ``yaml_arguments``)::

    language_model:            # TransformerConfig fields
      num_layers: 2
      hidden_size: 64
      activation_func: swiglu  # swiglu | squaredrelu | gelu
    model_parallel:            # ModelParallelConfig fields
      tensor_model_parallel_size: 2
      bf16: true
    micro_batch_size: 2        # every other key: a training argument, by its dest
    data_path: ${DATA}/corpus_text_document   # ${VAR}: an environment variable (it must be set)

As in Megatron-LM the other command-line flags are ignored (the log lists them); every setting the file leaves out
keeps its command-line default, then ``validate_args`` checks the result like any command line. A ``language_model``
or ``model_parallel`` key is a field of that dataclass whose flag writes the field of the same name; the few fields
whose flag has another name are translated (``activation_func``, ``num_moe_experts`` -> ``--num-experts``,
``init_method: xavier_uniform``, ``params_dtype`` -> ``--fp16``/``--bf16``). A key that is neither a field nor an
argument, or a field that no flag sets, stops with one line naming it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
from typing import Any, Dict

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.errors import ConfigurationError

_ENV = re.compile(r"\$\{([^}]+)\}")
_ACTIVATIONS = {"swiglu": {"swiglu": True}, "squaredrelu": {"squared_relu": True}, "gelu": {}}
_DTYPES = {"float32": {}, "float16": {"fp16": True}, "bfloat16": {"bf16": True}}
_SECTIONS = (("language_model", TransformerConfig), ("model_parallel", ModelParallelConfig))


def _expand(value, path: str, where: str):
    """``${VAR}`` in strings (recursively in lists) replaced by the environment's value."""
    if isinstance(value, list):
        return [_expand(v, path, where) for v in value]
    if not isinstance(value, str):
        return value

    def sub(match):
        name = match.group(1)
        if name not in os.environ:
            raise ConfigurationError(f"--yaml-cfg {path}: {where} uses ${{{name}}}, which is not set in the "
                                     "environment: export it")
        return os.environ[name]

    return _ENV.sub(sub, value)


def _section_settings(section: str, config_class, values: Dict[str, Any], dests, path: str) -> Dict[str, Any]:
    fields = {f.name for f in dataclasses.fields(config_class)}
    out: Dict[str, Any] = {}
    for key, value in values.items():
        where = f"{section}.{key}"
        value = _expand(value, path, where)
        if key not in fields:
            raise ConfigurationError(f"--yaml-cfg {path}: {where} is not a {config_class.__name__} field")
        if key == "activation_func":
            if value not in _ACTIVATIONS:
                raise ConfigurationError(f"--yaml-cfg {path}: {where} {value!r}: use swiglu, squaredrelu or gelu")
            out.update(_ACTIVATIONS[value])
        elif key == "params_dtype":
            if value not in _DTYPES:
                raise ConfigurationError(f"--yaml-cfg {path}: {where} {value!r}: use float32, float16 or bfloat16")
            out.update(_DTYPES[value])
        elif key in ("init_method", "output_layer_init_method"):
            if value not in (None, "xavier_uniform"):
                raise ConfigurationError(f"--yaml-cfg {path}: {where} {value!r}: use xavier_uniform (or leave it out "
                                         "for the normal initialisation of --init-method-std)")
            if value:
                out["init_method_xavier_uniform"] = True
        elif key == "num_moe_experts":
            out["num_experts"] = value
        elif key in dests:
            out[key] = value
        elif value is not None:
            raise ConfigurationError(f"--yaml-cfg {path}: {where} is derived from other settings here (no flag "
                                     "sets it): leave it out")
    return out


def load_yaml_args(path: str, parser: argparse.ArgumentParser, parsed: argparse.Namespace,
                   log) -> argparse.Namespace:
    """The namespace ``--yaml-cfg path`` describes: the parser's defaults, then the file (module docstring)."""
    try:
        import yaml
    except ImportError:
        raise ConfigurationError("--yaml-cfg needs PyYAML: pip install pyyaml") from None
    try:
        with open(path) as f:
            config = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigurationError(f"--yaml-cfg {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigurationError(f"--yaml-cfg {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise ConfigurationError(f"--yaml-cfg {path}: expected a mapping of settings at the top level")
    args = parser.parse_args([])
    dests = set(vars(args))
    ignored = sorted(d for d, v in vars(parsed).items() if d != "yaml_cfg" and v != getattr(args, d, v))
    if ignored:
        log(f"--yaml-cfg {path}: the other command-line settings are ignored (Megatron-LM's rule): "
            + ", ".join(ignored))
    settings: Dict[str, Any] = {}
    for section, config_class in _SECTIONS:
        values = config.get(section) or {}
        if not isinstance(values, dict):
            raise ConfigurationError(f"--yaml-cfg {path}: {section} must be a mapping of {config_class.__name__} "
                                     "fields")
        settings.update(_section_settings(section, config_class, values, dests, path))
    for key, value in config.items():
        if key in dict(_SECTIONS):
            continue
        if key not in dests:
            raise ConfigurationError(f"--yaml-cfg {path}: {key} is not a Megatron argument (a top-level key is an "
                                     "argument's dest, e.g. micro_batch_size)")
        settings[key] = _expand(value, path, key)
    actions = {a.dest: a for a in parser._actions}
    for key, value in settings.items():
        setattr(args, key, _typed(actions.get(key), value, path, key))
    args.yaml_cfg = path
    return args


def _typed(action, value, path: str, key: str):
    """A YAML string read as the flag would read it: a list option splits on whitespace; ``${VAR}`` expansions and
    quoted numbers go through the flag's type."""
    if action is None or not isinstance(value, str):
        return value
    convert = action.type if action.type not in (None, str) else (lambda v: v)
    try:
        if action.nargs in ("*", "+"):
            return [convert(v) for v in value.split()]
        return convert(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        raise ConfigurationError(f"--yaml-cfg {path}: {key} {value!r}: {e}") from None

"""Megatron-LM HEAD's whole command line against the dump of HEAD's own parser (tests/data/megatron_head_cli.json:
every option's spellings, dest, action, default and choices): every option is accepted with HEAD's default and has
exactly one class in the registry; every not-available option stops with one line naming it; performance-only options
leave the losses bit-identical and are logged once; docs/arguments.md is the generated one."""
import argparse
import collections
import contextlib
import enum
import io
import json
import os
import subprocess
import sys

import pytest
from helpers.args_test_helpers import BASE_ARGV
from helpers.dist_harness import run_distributed

from megatron.training.arguments import build_parser
from megatron.training.arguments.model_args import int_pair, layer_pattern
from megatron.training.arguments.registry import (OptionClass, class_counts, entries, head_entries,
                                                  refuse_not_available, value_rules)
from megatron.training.errors import ConfigurationError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
with open(os.path.join(REPO, "tests", "data", "megatron_head_cli.json")) as _f:
    HEAD = json.load(_f)


@pytest.fixture(scope="module")
def parser():
    return build_parser()


@pytest.fixture(scope="module")
def defaults(parser):
    return vars(parser.parse_known_args([])[0])


# Defaults kept different from HEAD's on purpose (none: --check-for-nan-in-loss-and-grad is on, as in HEAD, since the
# rerun state machine checks it; with --fp16 it leaves NaN / Inf gradients to the loss scaler).
KEPT_DEFAULTS = {}


def _same(ours, head) -> bool:
    if isinstance(ours, enum.Enum):  # --attention-backend: the dump holds the repr of the AttnBackend member
        return repr(ours) == head
    return ours == head and type(ours) is type(head)


def _choices_differ(action, head_choices) -> bool:
    if head_choices is None or action.choices is None:
        return (head_choices is None) != (action.choices is None)
    if isinstance(head_choices, str):  # an enum's members, as their repr
        return repr(list(action.choices)) != head_choices
    return set(action.choices) != set(head_choices)


def test_every_head_option_is_accepted_with_heads_spelling_default_and_choices(parser, defaults):
    problems, first_default = [], {}
    for option in HEAD:
        first_default.setdefault(option["dest"], option["default"])
        for flag in option["options"]:
            action = parser._option_string_actions.get(flag)
            if action is None:
                problems.append(f"{flag}: not accepted")
                continue
            if type(action).__name__ != option["kind"] or action.dest != option["dest"]:
                problems.append(f"{flag}: {type(action).__name__} -> {action.dest}, HEAD: {option['kind']} -> "
                                f"{option['dest']}")
            if not _same(action.default, option["default"]):
                problems.append(f"{flag}: default {action.default!r}, HEAD's {option['default']!r}")
            if _choices_differ(action, option["choices"]):
                problems.append(f"{flag}: choices {action.choices}, HEAD's {option['choices']}")
            default = option["default"]
            if (type(action).__name__ == "_StoreAction" and action.nargs is None and not action.choices
                    and type(default) in (int, float)):  # the type reads the default back (int stays int)
                try:
                    parsed = action.type(str(default)) if action.type else str(default)
                except (TypeError, ValueError, argparse.ArgumentTypeError):
                    parsed = "<error>"
                if parsed != default:
                    problems.append(f"{flag}: type {action.type} reads {default!r} as {parsed!r}")
    for dest, want in first_default.items():  # what a run without the option sees
        if not _same(defaults.get(dest, "<missing>"), KEPT_DEFAULTS.get(dest, want)):
            problems.append(f"args.{dest} = {defaults.get(dest, '<missing>')!r} without the option, HEAD: {want!r}")
    assert not problems, "\n".join(problems)


def test_every_option_has_exactly_one_class(parser):
    classes = collections.defaultdict(list)
    for flag, entry in entries().items():
        action = parser._option_string_actions.get(flag)
        assert action is not None, f"the registry lists {flag}, which the parser does not define"
        classes[id(action)].append((flag, entry.cls))
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            assert len(classes[id(action)]) == 1, (action.option_strings, classes[id(action)])
    head_actions = {id(parser._option_string_actions[o["options"][0]]) for o in HEAD}
    assert {id(parser._option_string_actions[e.flag]) for e in head_entries()} == head_actions
    counts = class_counts()
    assert sum(counts.values()) == len(HEAD) == 838
    print("classes of HEAD's options:", {c.value: n for c, n in counts.items()})


_SAMPLES = {int: "7", float: "0.25", str: "x", int_pair: "1,0", layer_pattern: "2", None: "x"}


def _text(value) -> str:
    return value.name if isinstance(value, enum.Enum) else str(value)


def non_default_argv(action, default):
    """A command line that sets ``action``'s option to something other than ``default``."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [action.option_strings[1] if default else flag]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        current = default if isinstance(default, list) else [default]
        return [flag, _text(next(c for c in action.choices if c not in current))]
    sample = _SAMPLES[action.type]
    if action.type is not None and action.type(sample) == default:
        sample = {"7": "8", "0.25": "0.5", "x": "y"}[sample]
    return [flag, sample]


def test_not_available_options_stop_with_one_line_naming_them(parser, defaults):
    refuse_not_available(parser.parse_args([]), parser)  # nothing set: nothing refused
    checked = 0
    for entry in entries().values():
        if entry.cls is not OptionClass.NOT_AVAILABLE:
            continue
        action = parser._option_string_actions[entry.flag]
        args = parser.parse_args(non_default_argv(action, defaults[action.dest]))
        with pytest.raises(ConfigurationError) as error:
            refuse_not_available(args, parser)
        message = str(error.value)
        named = message.split(":")[0].split("/")  # every spelling of the setting (two options may share it)
        assert "\n" not in message and set(action.option_strings) <= set(named), message
        assert ("not available yet" in message) == entry.block.pending, message
        checked += 1
    for rule in value_rules():
        if rule.cls is OptionClass.NOT_AVAILABLE:
            for value in rule.values:
                with pytest.raises(ConfigurationError) as error:
                    refuse_not_available(parser.parse_args([rule.flag, str(value)]), parser)
                assert str(error.value).startswith(f"{rule.flag} {value}: not available"), str(error.value)
    # (the floor shrinks as features land)
    assert checked == sum(1 for e in entries().values() if e.cls is OptionClass.NOT_AVAILABLE) > 300


def test_not_available_option_on_the_command_line_prints_one_line():
    """pretrain_gpt.py with --perform-rl-step: exit code 2, and stderr is one line naming the option."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *BASE_ARGV, "--mock-data",
                           "--perform-rl-step"], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: --perform-rl-step: not available in this library: the RL trainer")


# Performance-only options: one tiny run with every one of them switched on against the same run without them. The
# model has MoE layers, so the MoE-only options (DeepEP, fused router/permute, --moe-token-dispatcher-type flex ...)
# mean something; options of one class never share a destination, so nothing conflicts within the run.
MOE = ["--mock-data", "--num-layers", "2", "--train-iters", "3", "--log-interval", "1", "--eval-iters", "1",
       "--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm",
       "--disable-bias-linear"]


def _performance_argv():
    parser = build_parser()
    defaults = vars(parser.parse_known_args([])[0])
    argv, flags = [], []
    for entry in entries().values():
        if entry.cls is OptionClass.PERFORMANCE:
            action = parser._option_string_actions[entry.flag]
            argv += non_default_argv(action, defaults[action.dest])
            flags.append(entry.flag)
    return argv, flags


def performance_body(perf_argv):
    from helpers.train_helpers import run_pretrain

    out = {}
    for name, extra in (("base", []), ("perf", perf_argv + ["--moe-token-dispatcher-type", "flex"])):
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            records = run_pretrain("pretrain_gpt", MOE + extra)
        out[name] = [(r["iteration"], {k: float(v).hex() for k, v in r["loss"].items()}) for r in records]
        out[name + "_log"] = log.getvalue()
    return out


@pytest.mark.timeout(300)
def test_performance_only_options_leave_losses_bit_identical_and_are_logged_once():
    perf_argv, flags = _performance_argv()
    assert len(flags) >= 130
    out = run_distributed(performance_body, 1, perf_argv, timeout=240)[0]
    assert len(out["base"]) == 3 and all(losses for _, losses in out["base"])
    assert out["perf"] == out["base"], "a performance-only option changed the losses"
    for flag in flags:
        assert out["perf_log"].count(f"{flag}: performance only here;") == 1, flag
    assert "performance only here" not in out["base_log"]
    assert out["perf_log"].count("--moe-token-dispatcher-type flex: performance only here; the alltoall") == 1


def test_docs_arguments_md_is_generated():
    from megatron.training.arguments.arguments_doc import arguments_markdown

    with open(os.path.join(REPO, "docs", "arguments.md")) as f:
        assert f.read() == arguments_markdown(), "docs/arguments.md is out of date: python tools/generate_arguments_doc.py"


def test_transformer_configuration_flags_are_generated_from_the_config_fields(parser):
    """HEAD generates its "transformer configuration" group from TransformerConfig's fields; here too: each such
    option whose setting is a field of our TransformerConfig is the flag config_args.py made from that field (its
    dest, default and type come from the field), so the two cannot drift apart."""
    import dataclasses
    import typing

    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.arguments.config_args import config_flags

    generated = {field.name: (flags, kwargs) for field, flags, kwargs in config_flags()}
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    # (a field of a feature still not available keeps the registry's flag until the feature lands)
    classes = {flag: entry.cls for flag, entry in entries().items()}
    head_config = [o for o in HEAD if o["group"] == "transformer configuration" and o["dest"] in fields
                   and classes.get(o["options"][0]) is not OptionClass.NOT_AVAILABLE]
    assert len(head_config) >= 70
    for option in head_config:
        assert option["dest"] in generated, f"{option['options']}: written by hand, not generated from the field"
        flags, kwargs = generated[option["dest"]]
        assert option["options"][0] in flags
        action = parser._option_string_actions[option["options"][0]]
        assert action.dest == option["dest"] and action.help == kwargs["help"]
    hints = typing.get_type_hints(TransformerConfig)
    for name, (flags, kwargs) in generated.items():  # the flag's type is the field's (Optional stripped)
        if "type" in kwargs and not kwargs.get("choices"):
            assert kwargs["type"] in typing.get_args(hints[name]) + (hints[name],) or \
                any(kwargs["type"] in typing.get_args(a) for a in typing.get_args(hints[name])), name

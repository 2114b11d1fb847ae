"""The registry of Megatron-LM's whole command line: every option, its class, and what using it does.

Megatron-LM HEAD (0.20) has 838 command-line options. This library accepts every one of them with HEAD's spelling,
type, choices and default, and puts each in one of three classes:

* **implemented**: the option changes what Megatron-LM changes (each one is tested);
* **performance-only**: it selects a kernel, a stream, an overlap, a buffer, a placement or a GPU library, none of
  which changes the math. It is accepted, and the log says once, at ``validate_args``, which implementation ran
  instead (``log_performance_only``);
* **not available**: the feature is not in this library (or not yet: ``pending=True`` marks a feature being built).
  A value other than the default stops ``validate_args`` (its first step, before anything else is checked or
  built) with one :class:`ConfigurationError` line naming the option and why (``refuse_not_available``).

An option left at its default changes nothing in any class, so a script that spells a default out still runs. The
2023 options that HEAD removed and this library keeps (``--DDP-impl``, ``--retro-*`` ...) are classified the same way
(``head=False`` blocks). A few values of implemented options are classified on their own (``ValueRule``: e.g.
``--optimizer muon`` is not available; ``--moe-token-dispatcher-type flex`` runs the alltoall dispatcher).

Where the options are defined. Each block lists its options either as a flag string, for an option a group file
defines (``model_args.py``, ``training_args.py``, ``system_args.py``, ``task_args.py``, or a flag generated from a
dataclass config), or as an :class:`Opt`: HEAD's flags, type, default and choices, added to the parser here
(``add_registry_options``, called by ``build_parser`` after the group files and before a script's own flags). One
option is defined in one place: an ``Opt`` whose flag a group file also defines stops ``build_parser`` with a message
saying which to remove.

The tables: ``head_implemented.py`` (implemented), ``head_performance.py`` (performance-only) and
``head_unavailable.py`` (not available, and the ``ValueRule`` table). ``docs/arguments.md`` is generated from them
(``python tools/generate_arguments_doc.py``); ``tests/training/test_args_head_cli.py`` checks every option against
the dump of HEAD's own parser.

How a developer moves an option to *implemented* (the feature's owner does this when the feature lands):

1. implement and test what the option does (read ``args.<dest>``, or the config field it maps to);
2. move the option's entry (its ``Opt`` line, or its flag string) from its block in ``head_unavailable.py`` (or
   ``head_performance.py``) into a block of ``head_implemented.py``. An ``Opt`` keeps defining the flag with HEAD's
   type and default wherever it moves; give it a ``help=`` text when it becomes implemented. To define the flag by
   hand in a group file instead, delete the ``Opt`` and list the flag string. An option of HEAD's "transformer
   configuration" group whose setting is a ``TransformerConfig`` field is generated from the field instead: declare
   the field with ``flag(default, "help", ...)`` (megatron/core/config_cli.py), delete the ``Opt`` and list the flag
   string;
3. run ``python tools/generate_arguments_doc.py`` to regenerate ``docs/arguments.md``;
4. run ``python -m pytest tests/training/test_args_head_cli.py -q``: it fails for an option classified twice or not at
   all, a flag defined twice, or a default, type or choice that is not HEAD's.

A new option that is not HEAD's goes into a ``head=False`` block of the file of its class.
"""
from __future__ import annotations

import argparse
import enum
import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple, Union

from megatron.training.errors import ConfigurationError


class OptionClass(str, enum.Enum):
    IMPLEMENTED = "implemented"
    PERFORMANCE = "performance-only"
    NOT_AVAILABLE = "not available"


@dataclass(frozen=True)
class Opt:
    """An option that no group file defines: its flags and the ``add_argument`` keywords (HEAD's action, type,
    default, choices, nargs, dest)."""

    flags: Tuple[str, ...]
    kwargs: Tuple[Tuple[str, Any], ...]
    help: Optional[str] = None

    @property
    def dest(self) -> str:
        return dict(self.kwargs).get("dest") or self.flags[0].lstrip("-").replace("-", "_")


def switch(*flags: str, dest: Optional[str] = None, default: Any = False, help: Optional[str] = None) -> Opt:
    """A ``store_true`` option."""
    return Opt(flags, (("action", "store_true"), ("default", default), ("dest", dest)), help)


def negated(*flags: str, dest: str, help: Optional[str] = None) -> Opt:
    """A ``store_false`` option (its setting defaults to True)."""
    return Opt(flags, (("action", "store_false"), ("dest", dest)), help)


def no_or_disable(name: str, help: Optional[str] = None) -> Opt:
    """HEAD's form of a config boolean that defaults to True: ``--no-<name>`` / ``--disable-<name>``."""
    return negated(f"--no-{name}", f"--disable-{name}", dest=name.replace("-", "_"), help=help)


def both(flag: str, dest: Optional[str] = None, help: Optional[str] = None) -> Opt:
    """``--<name>`` / ``--no-<name>`` (argparse's BooleanOptionalAction), default False."""
    return Opt((flag, "--no-" + flag[2:]), (("action", argparse.BooleanOptionalAction), ("default", False),
                                            ("dest", dest)), help)


def value(*flags: str, type: Callable = str, default: Any = None, choices: Optional[Sequence] = None,
          nargs: Optional[str] = None, dest: Optional[str] = None, help: Optional[str] = None) -> Opt:
    """An option that takes a value (``nargs`` for a list)."""
    return Opt(flags, (("type", type), ("default", default), ("choices", tuple(choices) if choices else None),
                       ("nargs", nargs), ("dest", dest)), help)


@dataclass(frozen=True)
class Block:
    """Options of one class that share the reason they are in it (``note``).

    ``note``: for performance-only options what runs instead, for not-available ones why (the user reads it after
    the flag's name); for implemented ones a short description (optional). ``group`` titles the ``--help`` section of
    the options this block defines. ``pending``: not available *yet* (a feature being built). ``head``: False for
    the 2023 options HEAD removed."""

    cls: OptionClass
    note: str
    options: Tuple[Union[str, Opt], ...]
    group: str = "other"
    pending: bool = False
    head: bool = True


@dataclass(frozen=True)
class ValueRule:
    """Values of an implemented option with a class of their own: ``NOT_AVAILABLE`` stops ``validate_args``;
    ``PERFORMANCE`` logs the note and runs ``replace`` (when given) instead."""

    flag: str
    values: Tuple[Any, ...]
    cls: OptionClass
    note: str
    pending: bool = False
    replace: Any = None


@dataclass(frozen=True)
class Entry:
    """One option as the registry knows it (``flag`` is its first spelling)."""

    flag: str
    block: Block
    opt: Optional[Opt] = None

    @property
    def cls(self) -> OptionClass:
        return self.block.cls


def _block_lists():
    from megatron.training.arguments import head_implemented, head_performance, head_unavailable

    return head_implemented.BLOCKS + head_performance.BLOCKS + head_unavailable.BLOCKS, head_unavailable.VALUE_RULES


def blocks() -> Tuple[Block, ...]:
    return tuple(_block_lists()[0])


def value_rules() -> Tuple[ValueRule, ...]:
    return tuple(_block_lists()[1])


@functools.lru_cache(maxsize=None)
def entries() -> Dict[str, Entry]:
    """Every registered option by its first flag; a flag registered twice is an error (in the tables)."""
    result: Dict[str, Entry] = {}
    for block in blocks():
        for option in block.options:
            entry = Entry(option, block) if isinstance(option, str) else Entry(option.flags[0], block, option)
            if entry.flag in result:
                raise ValueError(f"{entry.flag} is registered twice (as {result[entry.flag].cls.value} and as "
                                 f"{entry.cls.value}): keep one entry (megatron/training/arguments/registry.py)")
            result[entry.flag] = entry
    return result


def add_registry_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``Opt`` of the tables to ``parser``, in a ``--help`` group titled by its block."""
    groups = {g.title: g for g in parser._action_groups}
    for block in blocks():
        for opt in (o for o in block.options if isinstance(o, Opt)):
            taken = [f for f in opt.flags if f in parser._option_string_actions]
            if taken:
                raise ValueError(f"{', '.join(taken)} is defined by a group file and by the registry's table "
                                 f"({block.cls.value}): delete the Opt entry and list the flag string instead "
                                 "(megatron/training/arguments/registry.py)")
            if block.group not in groups:
                groups[block.group] = parser.add_argument_group(title=block.group)
            kwargs = {k: v for k, v in opt.kwargs if v is not None or k == "default"}
            kwargs["help"] = opt.help or _help(block)
            groups[block.group].add_argument(*opt.flags, **kwargs)
    return parser


def _help(block: Block) -> str:
    if block.cls is OptionClass.NOT_AVAILABLE:
        return f"Not available{' yet' if block.pending else ''} in this library: {block.note}."
    if block.cls is OptionClass.PERFORMANCE:
        return f"Performance only (accepted; the math is unchanged): {block.note}."
    return block.note


def _defaults(parser: argparse.ArgumentParser) -> Dict[str, Any]:
    """What ``parser`` puts in the namespace when no option is given (the first action of a dest sets it)."""
    return vars(parser.parse_known_args([])[0])


def _changed(entry: Entry, args, parser: argparse.ArgumentParser, defaults: Dict[str, Any]) -> bool:
    """Whether ``args`` holds a value other than the default for ``entry``'s option."""
    action = parser._option_string_actions.get(entry.flag)
    if action is None or not hasattr(args, action.dest):
        return False
    return getattr(args, action.dest) != defaults.get(action.dest)


def _message(flag: str, cls_note: str, pending: bool) -> str:
    return f"{flag}: not available{' yet' if pending else ''} in this library: {cls_note}"


def refuse_not_available(args, parser: Optional[argparse.ArgumentParser] = None) -> None:
    """ConfigurationError (one line naming the option and why) for a not-available option or value in ``args``
    (``parser``: the one that parsed them; Megatron's own by default)."""
    parser = parser or _default_parser()
    defaults = _defaults(parser)
    for entry in entries().values():
        if entry.cls is OptionClass.NOT_AVAILABLE and _changed(entry, args, parser, defaults):
            action = parser._option_string_actions[entry.flag]
            flags = "/".join(f for a in parser._actions if a.dest == action.dest for f in a.option_strings)
            advice = "drop it" if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) else \
                "drop it (or pass its default)"
            raise ConfigurationError(_message(flags, entry.block.note, entry.block.pending) + f"; {advice}")
    for rule in value_rules():
        if rule.cls is not OptionClass.NOT_AVAILABLE:
            continue
        bad = _rule_hits(rule, args, parser)
        if bad is not None:
            raise ConfigurationError(_message(f"{rule.flag} {bad}", rule.note, rule.pending))


def _rule_hits(rule: ValueRule, args, parser: argparse.ArgumentParser):
    action = parser._option_string_actions.get(rule.flag)
    if action is None:
        return None
    current = getattr(args, action.dest, None)
    for v in (current if isinstance(current, (list, tuple)) else [current]):
        if v in rule.values:
            return v
    return None


@functools.lru_cache(maxsize=1)
def _default_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments.parser import build_parser

    return build_parser()


def log_performance_only(args, log: Callable[[str], None], parser: Optional[argparse.ArgumentParser] = None) -> None:
    """Log once, for every performance-only option or value in ``args``, which implementation runs instead (and
    replace a performance-only value by the one that runs)."""
    parser = parser or _default_parser()
    defaults = _defaults(parser)
    for entry in entries().values():
        if entry.cls is OptionClass.PERFORMANCE and _changed(entry, args, parser, defaults):
            log(f"{entry.flag}: performance only here; {entry.block.note} (the math is unchanged)")
    for rule in value_rules():
        if rule.cls is not OptionClass.PERFORMANCE:
            continue
        hit = _rule_hits(rule, args, parser)
        if hit is not None:
            log(f"{rule.flag} {hit}: performance only here; {rule.note} (the math is unchanged)")
            if rule.replace is not None:
                setattr(args, parser._option_string_actions[rule.flag].dest, rule.replace)


def head_entries() -> Iterator[Entry]:
    """The entries of HEAD's options (838 when the tables are complete)."""
    return (e for e in entries().values() if e.block.head)


def class_counts() -> Dict[OptionClass, int]:
    counts = {c: 0 for c in OptionClass}
    for entry in head_entries():
        counts[entry.cls] += 1
    return counts


def names(text: str) -> Tuple[str, ...]:
    """Flag strings written one after another (a block's options that group files define)."""
    return tuple(text.split())


__all__ = ["Block", "Entry", "Opt", "OptionClass", "ValueRule", "add_registry_options", "both", "class_counts",
           "entries", "head_entries", "log_performance_only", "names", "negated", "no_or_disable",
           "refuse_not_available", "switch", "value", "value_rules"]

"""Each setting defined once, as a dataclass field: ``x: int = setting(1, help=..., flag=...)``.

Its metadata holds what the package derives from it: flags and help (``cli/flags.py``), allowed values
and bounds (``field_problems``), and the TransformerConfig field it sets as it is (``config_kwargs``).
Plain data, no torch or Megatron import: the command line uses it before any rank starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

class ConfigError(ValueError):
    """Settings a run cannot honour; ``problems`` holds one line per problem, each saying what to change.
    Raised by the ranks of a job, it is re-raised wherever the job was launched from."""

    def __init__(self, problems: List[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


KEY = "megatron_siamese.setting"  # the field-metadata key holding a Setting


@dataclass(frozen=True)
class Switch:
    """A further flag that sets the same field another way (``--disable-bias-linear``, ``--bf16``)."""

    flags: Tuple[str, ...]
    help: str
    action: Any = None
    const: Any = None


@dataclass(frozen=True)
class Setting:
    """A field's definition beyond its type and default; ``definitions`` fills in the rest."""

    help: str = ""
    flags: Tuple[str, ...] = ()  # Megatron-LM's name first, then our short alias; none: no flag
    group: Optional[str] = None  # the argparse group of its flags
    choices: Optional[Tuple[Any, ...]] = None
    minimum: Optional[float] = None
    check: Optional[Callable[[Any], Optional[str]]] = None  # a problem with the value, or None
    config: Optional[str] = None  # the TransformerConfig field it sets unchanged
    layout: Optional[str] = None  # the runtime.layout.Layout field it sets unchanged
    # a model setting the checkpoint's weights do not depend on (kernels, init), so a resume may
    # change it (training/checkpoint_settings.py); every other ModelSettings field must be the checkpoint's
    resumable: bool = False
    action: Any = None  # argparse's, for switches
    metavar: Optional[str] = None
    nargs: Optional[str] = None  # argparse's: "*" takes a list (kept as a tuple)
    switches: Tuple[Switch, ...] = ()
    # filled in by ``definitions`` from the field itself
    name: str = ""
    default: Any = None
    value_type: Optional[type] = None  # int or float: what argparse converts a flag's text to
    optional: bool = False  # Optional[...]: None is always allowed

    @property
    def all_flags(self) -> Tuple[str, ...]:
        """Every flag a parser gets for it: its own (with their ``--no-`` forms for an on/off
        switch), then its switches'."""
        on_off = self.action is argparse.BooleanOptionalAction
        negated = tuple("--no-" + flag[2:] for flag in self.flags) if on_off else ()
        return self.flags + negated + tuple(flag for switch in self.switches for flag in switch.flags)

    @property
    def spelled(self) -> str:
        """How a message names it: ``--train-iters/--steps``."""
        return "/".join(self.flags) or self.name


def setting(default: Any, *, help: str = "", flag: Tuple[str, ...] | str = (), **definition) -> Any:
    """A dataclass field with its definition (see ``Setting``) in the metadata."""
    flags = (flag,) if isinstance(flag, str) else tuple(flag)
    return dataclasses.field(default=default, metadata={KEY: Setting(help=help, flags=flags, **definition)})


class DuplicateSetting(ValueError):
    """Two fields claim one flag, or one TransformerConfig or Layout field."""


def _unwrap_optional(hint) -> Tuple[Any, bool]:
    """``Optional[int]`` -> (int, True); ``int`` -> (int, False)."""
    arguments = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in arguments and len(arguments) == 2:
        return next(a for a in arguments if a is not type(None)), True
    return hint, False


@functools.lru_cache(maxsize=None)  # classes do not change; validation runs on every construction
def definitions(cls) -> Mapping[str, Setting]:
    """The settings of dataclass ``cls``, by field name, in field order (fields without one are
    left out); each flag, TransformerConfig field and Layout field is claimed by one field only."""
    hints = typing.get_type_hints(cls)
    found: Dict[str, Setting] = {}
    claimed: Dict[str, str] = {}
    for field in dataclasses.fields(cls):
        if KEY not in field.metadata:
            continue
        definition: Setting = field.metadata[KEY]
        claims = list(definition.all_flags)
        claims += [f"TransformerConfig.{definition.config}"] if definition.config else []
        claims += [f"Layout.{definition.layout}"] if definition.layout else []
        for claim in claims:
            if claim in claimed:
                raise DuplicateSetting(f"{cls.__name__}.{field.name} claims {claim}, which "
                                       f"{cls.__name__}.{claimed[claim]} already defines")
            claimed[claim] = field.name
        if definition.flags and not definition.help:
            raise ValueError(f"{cls.__name__}.{field.name} has flags but no help text")
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        kind, optional = _unwrap_optional(hints[field.name])
        found[field.name] = dataclasses.replace(definition, name=field.name, default=default, optional=optional,
                                                value_type=kind if kind in (int, float) else None)
    return types.MappingProxyType(found)  # shared by every caller: read-only


def field_problems(values, cls=None) -> Dict[str, str]:
    """A problem per field of ``values`` whose value its definition in ``cls`` (default: its
    own class) refuses, as ``{field: one line saying what to change}``."""
    found = {name: _problem(definition, getattr(values, name))
             for name, definition in definitions(cls or type(values)).items()}
    return {name: problem for name, problem in found.items() if problem}


def _problem(definition: Setting, value) -> Optional[str]:
    if value is None and definition.optional:
        return None
    if definition.choices is not None and value not in definition.choices:
        return f"{definition.spelled} must be one of {', '.join(map(str, definition.choices))} (got {value!r})"
    if definition.minimum is not None and value < definition.minimum:
        return f"{definition.spelled} must be at least {definition.minimum:g} (got {value})"
    return definition.check(value) if definition.check else None


def config_kwargs(values, cls) -> Dict[str, Any]:
    """The TransformerConfig keywords ``values`` set unchanged, from the definitions in ``cls``
    (a base class: a subclass that only changes defaults keeps the base's definitions)."""
    return {d.config: getattr(values, name) for name, d in definitions(cls).items() if d.config}


def typos(words, known) -> str:
    """`` (--nrom: did you mean --norm?)`` for each flag in ``words`` not in ``known`` that one there is close to."""
    hints = [f"{flag}: did you mean {close[0]}?"
             for flag in dict.fromkeys(word.split("=", 1)[0] for word in words if word.startswith("--"))
             if flag not in known for close in [difflib.get_close_matches(flag, list(known), 1, 0.8)] if close]
    return f" ({'; '.join(hints)})" if hints else ""


def add_setting(group, definition: Setting, dest: Optional[str] = None) -> None:
    """The argparse flags of one setting (an argparse parser or group): its own, then its switches,
    all setting the same field (``dest``, default: the setting's name)."""
    options = dict(action=definition.action, metavar=definition.metavar, choices=definition.choices,
                   type=definition.value_type, nargs=definition.nargs)
    dest = dest or definition.name
    group.add_argument(*definition.flags, dest=dest, default=definition.default, help=definition.help,
                       **{key: value for key, value in options.items() if value is not None})
    for switch in definition.switches:
        extra = {"const": switch.const} if switch.const is not None else {}
        group.add_argument(*switch.flags, dest=dest, default=definition.default, help=switch.help,
                           action=switch.action, **extra)

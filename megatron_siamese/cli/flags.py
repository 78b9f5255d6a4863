"""Command-line flags from the settings' definitions (``runtime/settings.py``, ``training/args.py``):
Megatron-LM's names (short names kept), help and default on every flag, in groups a command picks from."""

from __future__ import annotations

import argparse

from megatron_siamese.runtime.registry import add_setting, definitions
from megatron_siamese.runtime.settings import MODEL, MOE, PRECISION
from megatron_siamese.training.args import DATA, TrainArgs

SETTINGS = definitions(TrainArgs)
DEFAULTS = {name: definition.default for name, definition in SETTINGS.items()}
# what upcycle and analyze decide themselves (their model is SiameseNorm's: the baselines' settings mean nothing there)
SCHEME_SETTINGS = ("norm", "model", "hybrid_layer_pattern", "mix_ln_alpha", "hybridnorm_star")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown on every flag, except where the help says it already, ``sets_other_value``, or there
    is none (a required flag; a None, which the help says the meaning of); descriptions keep their line breaks."""

    def _get_help_string(self, action):
        if sets_other_value(action) or "default:" in (action.help or "") or action.required or action.default is None:
            return action.help
        return super()._get_help_string(action)


def sets_other_value(action: argparse.Action) -> bool:
    """A flag that sets another value than its own (``--bf16`` the dtype, ``--untie-...`` a True
    setting off): its field's default would read as the flag's."""
    return isinstance(action, argparse._StoreFalseAction) or (
        type(action) is argparse._StoreConstAction and not isinstance(action.const, bool))


def add_group(parser: argparse.ArgumentParser, title: str, leave_out=(), settings=SETTINGS) -> None:
    """The argparse group ``title``: the flags of every setting in it, in definition order
    (``settings``: a class's definitions, ``TrainArgs``' by default)."""
    group = parser.add_argument_group(title)
    for name, definition in settings.items():
        if definition.group == title and definition.flags and name not in leave_out:
            add_setting(group, definition)


def add_model_flags(parser: argparse.ArgumentParser, schemes: bool = True) -> None:
    add_group(parser, MODEL, leave_out=() if schemes else SCHEME_SETTINGS)
    add_group(parser, MOE)
    add_group(parser, PRECISION)


def add_data_flags(parser: argparse.ArgumentParser) -> None:
    add_group(parser, DATA)


def given_settings(words, settings=SETTINGS) -> set:
    """The settings a command line's ``words`` give a value, by any of their flags (``--flag value`` or
    ``--flag=value``), whatever the value."""
    spelled = {word.split("=", 1)[0] for word in words}
    return {name for name, definition in settings.items() if spelled & set(definition.all_flags)}


def train_args(options: argparse.Namespace, cls=TrainArgs, **changes) -> TrainArgs:
    """TrainArgs (or ``cls``, a subclass) from the parsed flags; fields without a flag keep their defaults."""
    settings = definitions(cls)
    fields = {name: getattr(options, name) for name in settings if hasattr(options, name)}
    fields = {name: tuple(value) if settings[name].nargs and value is not None else value
              for name, value in fields.items()}  # a list flag's values, kept as the field's tuple
    return cls(**{**fields, **changes})

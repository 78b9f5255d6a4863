"""The megatron-core releases this package supports, checked once at import.

Tested: 0.16.1 and 0.19.2 (HybridModel needs 0.19). Older fails the import, newer warns once on rank 0
(MEGATRON_SIAMESE_UNTESTED_MEGATRON=1: a warning, or silence). What keeps a newer release from changing
the math unnoticed is ``support.py``: a TransformerConfig field docs/settings.md has no row for, set
to other than its default, is refused. docs/design.md, "Megatron-Core versions".
"""

from __future__ import annotations

import os
import re
import warnings
from importlib.metadata import PackageNotFoundError, version

SUPPORTED = ((0, 16, 1), (0, 20, 0))  # [lowest, first untested)
SUPPORTED_TEXT = "megatron-core >= 0.16.1, < 0.20 (tested: 0.16.1 and 0.19.2)"
UNTESTED_ENV = "MEGATRON_SIAMESE_UNTESTED_MEGATRON"
TRAINING_LOOP_SINCE = (0, 17, 0)  # the first megatron-core wheel with megatron.training
TRAINING_LOOP_TEXT = "megatron-core >= 0.17 (its wheel ships Megatron-LM's training loop; 0.19.2 is tested)"
CHECK_COMMAND = "megatron-siamese check --layouts all"


def installed_megatron_core() -> str:
    try:
        return version("megatron-core")
    except PackageNotFoundError:  # a source checkout on sys.path (Megatron-LM's own tree)
        from megatron.core.package_info import __version__

        return __version__


def release(text: str) -> tuple:
    """'0.19.2rc1' -> (0, 19, 2): the numeric release, pre-release and local parts dropped."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        raise ValueError(f"cannot read the megatron-core version {text!r}")
    return tuple(int(part or 0) for part in match.groups())


def unsupported_reason(found: str) -> str | None:
    """Why ``found`` is older than the supported range (refused), or None."""
    if release(found) >= SUPPORTED[0]:
        return None
    return f"megatron_siamese supports {SUPPORTED_TEXT}; megatron-core {found} is installed. Install a supported release, e.g. pip install 'megatron-core==0.19.2'."


def untested_notice(found: str) -> str | None:
    """What a user of a release newer than the tested range is told, or None."""
    if release(found) < SUPPORTED[1]:
        return None
    return (f"megatron-core {found} is newer than the releases megatron_siamese was tested with ({SUPPORTED_TEXT}). "
            f"Run `{CHECK_COMMAND}` on your machines before training (it compares every parallel layout with one "
            f"rank); settings this release added are refused if set (docs/settings.md lists those reviewed). "
            f"{UNTESTED_ENV}=1 silences this.")


def speaks_for_the_job() -> bool:
    """Not one of the job's other ranks (RANK; no launcher: rank 0)."""
    return os.environ.get("RANK", "0") == "0"


def check_megatron_core() -> None:
    found = installed_megatron_core()
    untested = os.environ.get(UNTESTED_ENV) == "1"
    reason = unsupported_reason(found)
    if reason is not None:
        if not untested:
            raise ImportError(f"{reason} (Set {UNTESTED_ENV}=1 to try it anyway.)")
        warnings.warn(f"{reason} Going on because {UNTESTED_ENV}=1.", stacklevel=3)
        return
    notice = untested_notice(found)
    if notice is not None and not untested and speaks_for_the_job():
        warnings.warn(notice, stacklevel=3)


def ships_megatron_training() -> bool:
    """Whether the installed megatron-core carries Megatron-LM's training loop
    (``megatron.training``, in its wheel since 0.17), told by its version without importing it."""
    return release(installed_megatron_core()) >= TRAINING_LOOP_SINCE


def training_loop_problem(what: str) -> str | None:
    """Why ``what``, which runs Megatron-LM's training loop, cannot run with the installed
    megatron-core, or None."""
    if ships_megatron_training():
        return None
    return (f"{what} runs Megatron-LM's own training loop, which needs {TRAINING_LOOP_TEXT}; this environment has "
            f"megatron-core {installed_megatron_core()}. Upgrade it: pip install 'megatron-core==0.19.2' "
            "(Python >= 3.12; in this repository, bash scripts/setup.sh mcore019 makes .venv-mcore019).")

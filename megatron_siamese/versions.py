"""The megatron-core releases this package supports, checked once at import.

Tested: 0.16.1 (Python 3.11) and 0.19.2 (Python 3.12); the hooks it overrides are the same
across that range (docs/design.md, "Megatron-Core versions"). HybridModel support needs 0.19.
Outside the range the import fails naming it; MEGATRON_SIAMESE_UNTESTED_MEGATRON=1 turns
that into a warning for whoever wants to try a newer Megatron (e.g. Megatron-LM main).
"""

from __future__ import annotations

import os
import re
import warnings
from importlib.metadata import PackageNotFoundError, version

SUPPORTED = ((0, 16, 1), (0, 20, 0))  # [lowest, first unsupported)
SUPPORTED_TEXT = "megatron-core >= 0.16.1, < 0.20 (tested: 0.16.1 and 0.19.2)"
UNTESTED_ENV = "MEGATRON_SIAMESE_UNTESTED_MEGATRON"


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
    """Why ``found`` is outside the supported range, or None."""
    low, high = SUPPORTED
    if low <= release(found) < high:
        return None
    return f"megatron_siamese supports {SUPPORTED_TEXT}; megatron-core {found} is installed. Install a supported release, e.g. pip install 'megatron-core==0.19.2'."


def check_megatron_core() -> None:
    reason = unsupported_reason(installed_megatron_core())
    if reason is None:
        return
    if os.environ.get(UNTESTED_ENV) == "1":
        warnings.warn(f"{reason} Going on because {UNTESTED_ENV}=1.", stacklevel=3)
        return
    raise ImportError(f"{reason} (Set {UNTESTED_ENV}=1 to try it anyway.)")

"""A GPU's memory, by name (``h100-80gb``) or size (``80GiB``, ``81559MiB``, ``141GB``).

A job also needs a few GiB the plan does not count (docs/scale.md): a plan with no headroom does not fit.
"""

from __future__ import annotations

import re
from typing import Optional

MIB, GIB = 2**20, 2**30
GPUS = {  # nvidia-smi's total memory
    "a100-40gb": 40960 * MIB,
    "a100-80gb": 81920 * MIB,
    "h100-80gb": 81559 * MIB,
    "h200-141gb": 143771 * MIB,
}
ALIASES = {"h100": "h100-80gb", "h200": "h200-141gb"}
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": MIB, "gib": GIB, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b)\s*$", re.IGNORECASE)


def gpu_memory(text: str) -> int:
    """Bytes of a named GPU or of a size with its unit; ValueError saying what is accepted."""
    name = text.strip().lower()
    name = ALIASES.get(name, name)
    if name in GPUS:
        return GPUS[name]
    size = _SIZE.match(text)
    if size and size.group(2).lower() in UNITS:
        found = int(float(size.group(1)) * UNITS[size.group(2).lower()])
        if found <= 0:
            raise ValueError("a GPU holds more than nothing: give its memory, e.g. 80GiB")
        return found
    names = ", ".join(list(GPUS) + list(ALIASES))
    raise ValueError(f"expected a GPU ({names}) or a size with its unit (80GiB, 81559MiB, 141GB)")


def gpu_memory_problem(text: str) -> Optional[str]:
    try:
        gpu_memory(text)
    except ValueError as error:
        return f"--gpu-memory {text!r}: {error}"
    return None


def human(size: float) -> str:
    """Bytes in binary units, three significant figures (whole numbers from 100 on)."""
    for unit, scale in (("TiB", 2**40), ("GiB", GIB), ("MiB", MIB), ("KiB", 2**10)):
        if abs(size) >= scale:
            value = size / scale
            return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"
    return f"{size:.0f} B"

"""Which collective the CPU shim is emulating right now, so that a collective counter
(bench/collective_counter.py) books the one Megatron asked for, not the calls standing in for it.
Its own module so that the counter need not import the shim.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, List, Optional

_emulating = threading.local()


@contextlib.contextmanager
def standing_in_for(op: str, payload: int):
    """While collective ``op`` on ``payload`` bytes is emulated with other calls."""
    _emulating.current = [op, payload, False]
    try:
        yield
    finally:
        _emulating.current = None


def emulated_collective() -> Optional[List[Any]]:
    """``[op, payload bytes, booked]`` of the collective an emulation running now stands in for
    (a counter sets ``booked`` once it has booked it), or None."""
    return getattr(_emulating, "current", None)

"""Which collective the CPU shim is emulating right now, for a count of collectives to book.

On gloo the shim stands in for some collectives with others (a reduce-scatter as an all-reduce and
a slice, for one). A counter of collectives (bench/collective_counter.py) should book the collective
Megatron asked for, with its payload, not the calls the emulation makes: the shim marks the span
with ``standing_in_for`` and the counter reads ``emulated_collective``. Its own module so that the
counter need not import the shim (only the launchers install it)."""

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

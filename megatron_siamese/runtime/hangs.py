"""A rank that hangs: the others time out in a collective after --distributed-timeout-minutes, and the
job says which collective, where it was called, in which step or layout, and which rank never came.

Inside ``watched(what)`` (one unit of work every rank does together: a training step, a checked layout):

* a rank whose collective times out raises ``CollectiveTimeout`` instead of the bare transport error.
  First it marks itself in the job's rendezvous store (outside the process groups, so it still answers
  after they broke) and waits ``grace_s`` for the rest of its group: a rank that never marks itself was
  not waiting in any collective, so it is the one that hangs;
* a rank still inside the unit after the timeout prints every thread's Python stack (faulthandler's
  watchdog, "Timeout (h:mm:ss)!"): the hung rank says where it stands without anyone reaching it.

On NCCL torch's own watchdog aborts a timed-out rank (its log names the op); the stack dump still applies.
"""

from __future__ import annotations

import contextlib
import faulthandler
import re
import sys
import time
import traceback
from typing import Iterator, List, Optional

import torch

from megatron_siamese.runtime import job
from megatron_siamese.runtime.job import GroupsBroken

# gloo's transport (every collective and p2p op); NCCL's watchdog where it raises (torch's words, unseen here)
_TIMED_OUT = re.compile(r"Timed out waiting \d+ ?ms|ran for \d+ milliseconds before timing out")
GRACE_CAP_S = 10.0  # ranks waiting in the same collective time out within seconds of each other


class CollectiveTimeout(GroupsBroken):
    """A collective of this rank timed out: one line naming it, the unit of work and the ranks that never came."""


def grace_s(timeout_s: float) -> float:
    """How long a rank that timed out waits for the others of its group to time out too."""
    return min(GRACE_CAP_S, timeout_s / 4)


def timed_out(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and bool(_TIMED_OUT.search(str(error)))


def _short(filename: str) -> str:
    """A frame's file from its package on (``megatron/core/...``), not the install's path."""
    for root in ("/megatron/", "/megatron_siamese/", "/torch/"):
        if root in filename:
            return root[1:] + filename.split(root, 1)[1]
    return filename


def waited_in(error: BaseException) -> str:
    """Where the timed-out collective was waited on: the innermost traceback line outside torch.distributed
    (the collective's call, or an asynchronous op's ``handle.wait()``), with its file, line and function."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if "/torch/distributed/" not in frame.filename]
    if not frames:
        return "a collective"
    frame = frames[-1]
    return f"`{(frame.line or '').strip()}` at {_short(frame.filename)}:{frame.lineno} ({frame.name})"


def _never_came(timeout_s: float) -> Optional[List[int]]:
    """Mark this rank as timed out in the job's store, wait for the others of the default group
    to do the same, and return those that did not (None if the store cannot say)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        store = job.store_of_these_groups("timeouts")
        store.append("ranks", f"{rank} ")
        deadline = time.monotonic() + grace_s(timeout_s)
        while True:
            came = {int(r) for r in store.get("ranks").decode().split()}
            if len(came) >= world or time.monotonic() >= deadline:
                return [r for r in range(world) if r not in came]
            time.sleep(0.2)
    except (RuntimeError, OSError):  # the store is gone (its host died): no names
        return None


def _ranks(ranks: List[int]) -> str:
    named = ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {named}"


def describe(error: BaseException, what: str, timeout_s: float) -> str:
    rank = torch.distributed.get_rank()
    head = (f"rank {rank} timed out after {timeout_s:g} s (--distributed-timeout-minutes {timeout_s / 60:g}) "
            f"in {what}, waiting in {waited_in(error)}")
    missing = _never_came(timeout_s)
    if missing is None:
        return f"{head}; the job's store is gone, so which rank hangs is unknown"
    if not missing:
        return (f"{head}; every rank timed out in a collective of its own: they disagree on what comes "
                f"next (each rank's error names its collective)")
    return (f"{head}; {_ranks(missing)} of {torch.distributed.get_world_size()} never reached it nor timed out "
            f"within {grace_s(timeout_s):.0f} s: hung (its Python stack follows faulthandler's 'Timeout' line in its "
            "output; --debug shows it)")


def _arm(timeout_s: float) -> bool:
    """faulthandler's watchdog: every thread's stack on stderr if this rank is still inside
    the unit after ``timeout_s``."""
    try:
        faulthandler.dump_traceback_later(timeout_s, exit=False, file=sys.__stderr__)
        return True
    except (AttributeError, ValueError, OSError):  # no stderr file (replaced in-process): no dump
        return False


@contextlib.contextmanager
def watched(what: str) -> Iterator[None]:
    """One unit of work every rank of the joined job does together (``what``: "step 13",
    "layout tp2-dp2"); see the module's docstring."""
    timeout_s = job.group_timeout_minutes() * 60
    armed = _arm(timeout_s) if job.joined() is not None else False
    try:
        yield
    except RuntimeError as error:
        if not timed_out(error) or not torch.distributed.is_initialized():
            raise
        raise CollectiveTimeout(describe(error, what, timeout_s)) from error
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()

"""What the launcher makes of its ranks' reports: the next report (printing rank 0's console
lines as they come), a rank that died without one, and, when a rank failed, which rank's error
is the job's cause (``RankFailed``: one line, with every rank's report and output as details).

A rank that fails on a broken connection is usually a peer's consequence: its report waits up
to ``PEER_REPORT_WAIT_S`` for the peer's own error, which is then what the job reports.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import time
from typing import Optional

from megatron_siamese.runtime.hangs import STACK_SIGNAL, CollectiveTimeout
from megatron_siamese.runtime.job import CONSOLE, Failure, RankReport


class RankFailed(RuntimeError):
    """A rank failed. ``str()`` is one line (the rank and its error); ``details`` holds the
    rank's traceback and the tail of its output."""

    def __init__(self, summary: str, details: str = ""):
        super().__init__(summary)
        self.details = details


INTERRUPTED = "interrupted"  # a rank's report: a second stop signal stopped it at once


CRASH_TAIL_LINES = 400  # of a rank's output when it died without a report


def tail(path: Optional[str], lines: int = 40) -> str:
    if path is None or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def next_result(results, procs, timeout_s: float, logs) -> RankReport:
    """The next rank's report (printing rank 0's console lines as they come); fails at once
    when a rank died without one (a crash, a signal, a script without a ``__main__`` guard
    re-running itself)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            message = results.get(timeout=1.0)
            if message.rank != CONSOLE:
                return message
            print(message.value, flush=True)
        except queue.Empty:
            dead = dead_rank(procs, logs)
            if dead is not None:
                raise dead from None
    raise RankFailed(f"no result from some rank within {timeout_s:.0f}s")


def dead_rank(procs, logs) -> Optional[RankFailed]:
    """A rank that died without a report (killed by a signal, or exited non-zero: a crash), if
    one did. (A rank that reports its error still exits 0.)"""
    for rank, proc in enumerate(procs):
        if proc.exitcode is not None and proc.exitcode != 0:
            how = (f"was killed by {signal.Signals(-proc.exitcode).name}" if proc.exitcode < 0
                   else f"exited with code {proc.exitcode}")
            # all of a crash's Python stacks (faulthandler's, innermost frame first) and what led to it
            return RankFailed(f"rank {rank} {how} before reporting", tail(logs[rank], CRASH_TAIL_LINES))
    return None


def _ask_for_stacks(procs, wait_s: float = 1.0) -> None:
    """Have these ranks print every thread's Python stack into their output (``hangs.STACK_SIGNAL``)."""
    asked = False
    for proc in procs:
        if proc.pid is not None and proc.exitcode is None:
            try:
                os.kill(proc.pid, STACK_SIGNAL)
                asked = True
            except ProcessLookupError:
                pass
    if asked:
        time.sleep(wait_s)  # faulthandler writes at once; give the file a moment


# How a rank fails when a peer went away first: on the broken connection (gloo's "Connection
# closed by peer ... Check the logs of the remote worker", a reset, a refused connect, the
# rendezvous store's "Failed to recv, got 0 bytes. Connection was likely closed"), or where the
# package's own agreement says another rank failed ("failed on another rank (rank 0 says why)").
_PEER_GONE = re.compile(r"closed by peer|reset by peer|[Bb]roken pipe|[Cc]onnection refused|logs of the remote worker"
                        r"|[Cc]onnection was likely closed|on another rank")
PEER_REPORT_WAIT_S = 10.0  # how long a failure on a broken connection waits for the peer's own report


def cause(rank: int, report: Failure, results, procs, logs, pending: int, wait_s: Optional[float] = None,
          rendezvous: str = "") -> RankFailed:
    """What to report for a job in which ``rank`` reported ``report`` (a failure) and ``pending``
    ranks have not reported yet: a rank that died without a report; else, when that failure is
    a broken connection, the first other rank's failure that is not, if it comes within
    ``wait_s`` (the peer's own error, not its consequence); else this one, saying so. Its
    details hold every rank's report and output that came, and the job's ``rendezvous``
    address (which a rank's lost connection names as its remote, or not)."""
    world_size = len(procs)
    wait_s = PEER_REPORT_WAIT_S if wait_s is None else wait_s
    heard = {rank: report}  # every report that came, by rank
    deadline = time.monotonic() + (wait_s if _PEER_GONE.search(report.summary) else 1.0)
    while time.monotonic() < deadline:
        dead = dead_rank(procs, logs)
        if dead is not None:
            return dead
        if pending == 0 or not _PEER_GONE.search(report.summary):
            time.sleep(0.05)  # a crashed rank's exit status takes a moment to show
            continue
        try:
            other = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if other.rank == CONSOLE:
            print(other.value, flush=True)
            continue
        pending -= 1
        heard[other.rank] = other.value if not other.ok else Failure("finished")
        if not other.ok and other.value.summary != INTERRUPTED and not _PEER_GONE.search(other.value.summary):
            rank, report = other.rank, other.value
            deadline = min(deadline, time.monotonic() + 1.0)  # the cause: only a death would say more
    summary = f"rank {rank} of {world_size} failed: {report.summary}"
    silent = sorted(set(range(world_size)) - set(heard))
    if _PEER_GONE.search(report.summary):
        summary += (f" (no rank died or reported another error within {wait_s:.0f} s"
                    f"{'; still running: ranks ' + ', '.join(map(str, silent)) if silent else ''})")
    if report.summary.startswith(CollectiveTimeout.__name__):  # the ranks that never came: where they hang
        _ask_for_stacks(procs[r] for r in silent)
    details = [f"(the job's rendezvous store: {rendezvous})\n" if rendezvous else "", report.traceback + tail(logs[rank])]
    for other in sorted(set(range(world_size)) - {rank}):
        said = f"reported: {heard[other].summary}\n{heard[other].traceback}" if other in heard else "no report"
        details.append(f"-- rank {other}: {said}\n{tail(logs[other], CRASH_TAIL_LINES if other in silent else 40)}")
    return RankFailed(summary, "\n".join(filter(None, details)))

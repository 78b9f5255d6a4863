"""No orphan ranks: a rank that outlives the process that started it ends itself.

``die_with_parent(signum)`` asks Linux to send this process ``signum`` when its parent dies
(``prctl(PR_SET_PDEATHSIG)``), whatever killed the parent, SIGKILL included: a torchrun rank
stops (and saves) when its agent dies. A rank ``launch.py`` started has the fork server for its
parent, which outlives a killed launcher, so it ``watch``es the launcher itself (a thread waiting
on a pidfd of it) and is SIGKILLed within a second of the launcher's death, instead of finishing
the run or waiting forever for peers. Megatron's checkpoint writer's manager process gets the
parent-death signal of its rank (``checkpoint_writer_dies_with_its_rank``: our writer's and
Megatron-LM's loop's), and on CPU Megatron's persistent checkpoint worker ``watch``es its rank
(``cpu_checkpoint_worker``). Elsewhere than Linux
the parent-death signal does nothing and the watch looks once a second.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from typing import Optional

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(signum: int, launcher_pid: Optional[int] = None) -> bool:
    """Have ``signum`` sent to this process when its parent dies; returns whether it is set.
    If the parent (or ``launcher_pid``) is already gone, the signal is sent now: the death
    signal is not sent for a parent that died before it was asked for."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # this process's own symbols: libc's prctl among them
        if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent or parent == 1 or (launcher_pid is not None and not _alive(launcher_pid)):
        os.kill(os.getpid(), signum)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch(pid: int, signum: int = signal.SIGKILL) -> bool:
    """Send this process ``signum`` as soon as process ``pid`` ends (a daemon thread); returns whether it watches."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signum)
        return True
    except (AttributeError, OSError):  # no pidfds (not Linux >= 5.3): look once a second
        pidfd = None

    def wait():
        if pidfd is not None:
            select.select([pidfd], [], [])  # readable once the process has ended (reaped or not)
        else:
            while _alive(pid):
                time.sleep(1.0)
        os.kill(os.getpid(), signum)

    threading.Thread(target=wait, name="megatron-siamese-watch-launcher", daemon=True).start()
    return True


def _checkpoint_writer_manager() -> None:
    """The writer's manager: dies with its rank, and imports what the writer's results are made of
    now, while its rank waits for it to start, rather than at the first result it is sent (seconds
    of importing torch: an --async-save's writer would wait that long to report)."""
    die_with_parent(signal.SIGKILL)
    import torch.distributed.checkpoint  # noqa: F401


def checkpoint_writer_dies_with_its_rank(start_method: str = "spawn") -> None:
    """Megatron's checkpoint writer (dist_checkpointing's ``filesystem_async``) keeps its results
    queue in a multiprocessing manager, a process it spawns at a rank's first save and nothing
    ends once the rank is gone: a rank SIGKILLed under torchrun (which stops a failed worker's
    process group only while the worker lives) left it and its resource tracker running for
    good. This gives the writer its queue from a manager that gets SIGKILL when its rank dies
    (the tracker then sees its last holder go and exits); Megatron uses a queue already there.
    ``start_method`` "fork" (what Megatron-LM's loop uses, in well under a second) only before the
    rank has process groups, whose threads a fork would copy mid-work; "spawn" (seconds: a new
    interpreter) at any time."""
    from multiprocessing import get_context
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = SyncManager(ctx=get_context(start_method))
    manager.start(initializer=_checkpoint_writer_manager)
    filesystem_async._results_queue = manager.Queue()  # its proxy keeps the manager alive

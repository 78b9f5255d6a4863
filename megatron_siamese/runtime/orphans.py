"""No orphan ranks: a rank that outlives the process that started it ends itself.

``die_with_parent`` asks Linux for a signal when the parent dies (``PR_SET_PDEATHSIG``, SIGKILL of the
parent included). A rank ``launch.py`` started has the fork server for parent, which outlives a killed
launcher, so it ``watch``es the launcher (a pidfd) and is SIGKILLed within a second of its death.
Megatron's checkpoint writer's manager and its persistent CPU worker die with their rank too.
Elsewhere than Linux the death signal does nothing and the watch polls once a second.
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
    """Have ``signum`` sent to this process when its parent dies; returns whether it is set. A parent
    already gone gets the signal sent now: Linux does not send it for a parent that died before."""
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
    """The writer's manager: dies with its rank, and imports the writer's result types now, while its
    rank waits, rather than at the first result (seconds an --async-save's writer would wait)."""
    die_with_parent(signal.SIGKILL)
    import torch.distributed.checkpoint  # noqa: F401


def checkpoint_writer_dies_with_its_rank(start_method: str = "spawn") -> None:
    """Megatron's checkpoint writer keeps its results queue in a multiprocessing manager that nothing
    ends once its rank is gone (a rank SIGKILLed under torchrun left it and its resource tracker running
    for good). This gives the writer a queue from a manager SIGKILLed when its rank dies. ``start_method``
    "fork" only before the rank has process groups, whose threads a fork would copy; "spawn" any time."""
    from multiprocessing import get_context
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = SyncManager(ctx=get_context(start_method))
    manager.start(initializer=_checkpoint_writer_manager)
    filesystem_async._results_queue = manager.Queue()  # its proxy keeps the manager alive

"""No orphan ranks: a rank that outlives the process that started it ends itself.

``die_with_parent(signum)`` asks Linux to send this process ``signum`` when its parent dies
(``prctl(PR_SET_PDEATHSIG)``), whatever killed the parent, SIGKILL included. A spawned rank's
parent is the fork server, not the launcher, and the fork server outlives a killed launcher
while any rank runs (every rank holds the write end of its "alive" pipe), so spawned ranks
also ``watch`` the launcher itself: a thread waiting on a pidfd of it. Together a launcher
killed alone or with its process group (the fork server too) takes its ranks with it within a
second, instead of leaving them to finish the run and keep writing checkpoints. Elsewhere
than Linux they do nothing.
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
    """Send this process ``signum`` as soon as process ``pid`` ends (a daemon thread; returns
    whether it watches)."""
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

"""Stop signals as users and schedulers send them: SIGINT (Ctrl-C), SIGTERM, and SIGUSR1/SIGUSR2 as
SLURM's ``--signal`` sends them. They stop a command at once, whichever process gets them: the
launcher of spawned ranks raises KeyboardInterrupt and ends its ranks with everything they started
(``launch.py``), a rank ends as Python's defaults end it. The launcher's helpers (fork server,
resource tracker) start with these signals ignored (``ignored``): they end with the launcher, and
a fork server killed by a job-wide SIGTERM would lose the ranks' exit codes. (Training, which
stops gracefully and saves, is Megatron-LM's loop and its ``--exit-signal-handler``.)
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def default_in_this_rank() -> None:
    """A rank forked from the fork server (which ignores the stop signals) ends on them again:
    Ctrl-C as KeyboardInterrupt, the others as their default."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


@contextmanager
def ignored():
    """Start the fork server and resource tracker (if not yet running) with the stop signals
    ignored, which they keep: a job-wide SIGTERM must not kill them under the ranks (the ranks'
    exit codes reach the launcher through the fork server; lost, they read as 255)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def handled_by_launcher():
    """The launcher's stop signals: KeyboardInterrupt, whichever it gets, so that it ends its ranks."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)

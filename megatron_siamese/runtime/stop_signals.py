"""Stop signals as schedulers send them, to any process of a job.

``STOP_SIGNALS``: SIGINT (Ctrl-C), SIGTERM, and SIGUSR1/SIGUSR2 as SLURM's ``--signal`` sends
them. They may reach the launcher alone, one rank, or all of them at once (a scheduler's time
limit). The first one a process gets asks for a stop after the step the ranks are in
(``stop_requested()``: the signal's number; the trainer all-reduces it, so every rank stops
after the same step and saves); a second one stops that process at once. Another stop signal
within ``SAME_SIGNAL_S`` of the first is the same request (torchrun forwards the SIGTERM its
ranks already got from the scheduler; a torchrun agent killed by SIGUSR1 sends its ranks their
parent-death SIGTERM). Without ``graceful`` the launcher's first signal stops at once. The
launcher's helpers (fork server, resource tracker) start with these signals ignored
(``ignored``): they end with the launcher, and a fork server killed by a job-wide SIGTERM
would lose the ranks' exit codes.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
SAME_SIGNAL_S = 1.0  # a stop signal this soon after the first is the same request, not a second one

_stop = {"shared": None, "signum": 0, "at": 0.0}


def stop_requested() -> int:
    """The stop signal this rank was asked to stop by, after its current step (by the
    launcher, or by a signal to this process); 0 if none. Ranks must agree on when: all-reduce it."""
    shared = _stop["shared"]
    return _stop["signum"] or (shared.value if shared is not None else 0)


def handle_in_this_rank() -> None:
    """This rank's stop signals: the first asks for a stop, a second (not a repeat of the first
    within SAME_SIGNAL_S) stops at once."""

    def handler(signum, frame):
        first, at = _stop["signum"], _stop["at"]
        if not first:
            _stop.update(signum=signum, at=time.monotonic())
            return
        if time.monotonic() - at < SAME_SIGNAL_S:  # one request arriving twice (torchrun forwarding, its death)
            return
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)  # a third one ends the process even inside a collective
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, handler)


def share(stop_value) -> None:
    """A spawned rank: the launcher's stop requests arrive in ``stop_value`` (a shared int)."""
    _stop.update(shared=stop_value, signum=0, at=0.0)


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
def handled_by_launcher(stop_value, graceful: bool, echo: Callable[[str], None]):
    """The launcher's stop signals: a stop request first (graceful), at once after."""
    received = []

    def handler(signum, frame):
        received.append(signum)
        if graceful and len(received) == 1:
            stop_value.value = signum
            name = signal.Signals(signum).name
            again = "Ctrl-C" if signum == signal.SIGINT else name
            echo(f"{name}: finishing this step, then stopping ({again} again to stop at once)")
            return
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():  # e.g. the study's parallel runs:
        yield  # signals reach the main thread only; it owns them
        return
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)

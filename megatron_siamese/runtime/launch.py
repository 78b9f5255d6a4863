"""Launch a function on N ranks: CPU processes with gloo, or GPUs with NCCL when CUDA is present.

``launch(fn, world_size, *args)`` starts ``world_size`` processes, initializes
``torch.distributed`` in each (on CPU it installs the CPU shim first), calls ``fn(*args)``
and returns the per-rank return values in rank order. A failing rank's error is re-raised
in the caller (``RankFailed``: its last line, and the traceback and output as details) and
the other ranks are stopped, so a broken layout fails fast instead of hanging.
``run_on_ranks`` does the same, or, inside a ``torchrun`` job, runs ``fn`` as this rank.

Signals belong to the launcher: ranks ignore SIGINT and SIGTERM. With ``graceful_stop`` the
first SIGINT (Ctrl-C) or SIGTERM (what a cluster scheduler sends before a job's end) asks
the ranks to stop after the step they are in (``stop_requested()``; the trainer saves a
checkpoint then); a second one stops them at once. Without it, the first one does.
``quiet_ranks`` send those ranks' output to a log file, shown only when they fail.
"""

from __future__ import annotations

import io
import os
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterable, List, Optional

import torch
import torch.multiprocessing as mp

from megatron_siamese.runtime import cpu_shim
from megatron_siamese.runtime.quiet import silence_known_notices, warning_options

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RankFailed(RuntimeError):
    """A rank failed. ``str()`` is one line (the rank and its error); ``details`` holds the
    rank's traceback and the tail of its output."""

    def __init__(self, summary: str, details: str = ""):
        super().__init__(summary)
        self.details = details


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


# -- stop requests ---------------------------------------------------------------------

_stop = {"event": None, "signalled": False}


def stop_requested() -> bool:
    """Whether this rank was asked to stop after its current step (by the launcher, or, under
    torchrun, by a signal to this process). Ranks must agree on when: all-reduce it."""
    event = _stop["event"]
    return _stop["signalled"] or (event is not None and event.is_set())


def _stop_on_first_signal() -> None:
    """torchrun ranks: the first SIGINT/SIGTERM asks for a stop, the second one stops at once."""

    def handler(signum, frame):
        if _stop["signalled"]:
            signal.signal(signum, signal.SIG_DFL)
            raise KeyboardInterrupt
        _stop["signalled"] = True

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


# -- ranks -----------------------------------------------------------------------------


def init_distributed(rank: int, world_size: int, backend: str, port: int, timeout_s: float) -> None:
    """Initialize torch.distributed for this rank (the CPU shim first when on gloo)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        CUDA_DEVICE_MAX_CONNECTIONS="1",
    )
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        os.environ[cpu_shim.ENV_VAR] = "1"  # inherited by helper processes
        cpu_shim.install()
    torch.distributed.init_process_group(
        backend=backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )


def _worker(rank, world_size, backend, port, timeout_s, fn, args, results, stop_event, log_path):
    os.setpgrp()  # a group of its own: the launcher can stop it with whatever it started (writer processes)
    for sig in STOP_SIGNALS:  # the launcher decides when ranks stop
        signal.signal(sig, signal.SIG_IGN)
    _stop["event"] = stop_event
    if log_path is not None:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(log, 1)
        os.dup2(log, 2)
    silence_known_notices()
    try:
        torch.set_num_threads(1)
        init_distributed(rank, world_size, backend, port, timeout_s)
        value = fn(*args)
        # Tensors travel as bytes: torch's shared-memory handles die with this process.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException as error:  # report every failure, including SystemExit from asserts in fn
        summary = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
        results.put((rank, False, (summary[:500], traceback.format_exc())))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


# Imported once by the fork server, so that a rank starts in well under a second instead of
# importing torch and Megatron again (several seconds a rank, most of a CPU test's time).
_PRELOAD = ["megatron_siamese.runtime.forkserver_preload", "torch", "megatron.core", "megatron.core.distributed",
            "megatron.core.optimizer", "megatron.core.pipeline_parallel", "megatron_siamese.runtime.gpt",
            "megatron_siamese.models"]


def _context(backend: str):
    """On gloo, fresh ranks forked from a server that imported torch and Megatron once, in a clean
    process (never from the caller, whose threads and state a fork would copy). On NCCL, spawned
    ranks: those imports ask torch.cuda.is_available(), after which CUDA refuses to start in any
    process forked from the server."""
    if backend == "nccl":
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
    known = warning_options()  # in the server before it imports Megatron (inherited when it starts)
    if known not in os.environ.get("PYTHONWARNINGS", ""):
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"), known)))
    return ctx


def _tail(path: Optional[str], lines: int = 40) -> str:
    if path is None or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def _next_result(results, procs, timeout_s: float, logs):
    """The next rank's report; fails at once when a rank died without one (a crash, a
    signal, a script without a ``__main__`` guard re-running itself)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            dead = [(rank, proc.exitcode) for rank, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
            if dead:
                rank, code = dead[0]
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                raise RankFailed(f"rank {rank} {how} before reporting", _tail(logs[rank])) from None
    raise RankFailed(f"no result from some rank within {timeout_s:.0f}s")


def _kill_group(proc) -> None:
    """Stop a rank and everything it started (ranks ignore SIGTERM; a killed rank's helper
    processes would otherwise outlive it, holding its files and the terminal's output)."""
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the rank and its helpers are gone
    proc.join()


def _root_cause(procs, logs, wait_s: float = 1.0) -> Optional[RankFailed]:
    """A rank killed by a signal, if one was: the others then fail on their broken
    connections, and the one that died is what to report."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for rank, proc in enumerate(procs):
            if proc.exitcode is not None and proc.exitcode < 0:
                name = signal.Signals(-proc.exitcode).name
                return RankFailed(f"rank {rank} was killed by {name}", _tail(logs[rank]))
        time.sleep(0.05)
    return None


@contextmanager
def _signals_handled(stop_event, graceful: bool, echo: Callable[[str], None]):
    """The launcher's SIGINT/SIGTERM: a stop request first (graceful), at once after."""
    received = []

    def handler(signum, frame):
        received.append(signum)
        if graceful and len(received) == 1:
            stop_event.set()
            echo(f"{signal.Signals(signum).name}: finishing this step and saving a checkpoint "
                 "(Ctrl-C again to stop at once)")
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


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: Optional[str] = None,
    timeout_s: float = 600.0,
    quiet_ranks: Iterable[int] = (),
    graceful_stop: bool = False,
    echo: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> List[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh ranks; return their results in rank order."""
    backend = backend or default_backend()
    ctx = _context(backend)
    results = ctx.Queue()
    stop_event = ctx.Event()
    port = free_port()
    log_dir = tempfile.mkdtemp(prefix="megatron-siamese-ranks-")
    quiet = set(quiet_ranks)
    logs = [os.path.join(log_dir, f"rank{rank}.log") if rank in quiet else None for rank in range(world_size)]
    procs = [
        ctx.Process(target=_worker, daemon=False,
                    args=(rank, world_size, backend, port, timeout_s, fn, args, results, stop_event, logs[rank]))
        for rank in range(world_size)
    ]
    values: List[Any] = [None] * world_size
    with _signals_handled(stop_event, graceful_stop, echo):
        for proc in procs:
            proc.start()
        try:
            for _ in range(world_size):
                rank, ok, value = _next_result(results, procs, timeout_s, logs)
                if not ok:
                    summary, trace = value
                    raise _root_cause(procs, logs) or RankFailed(f"rank {rank} of {world_size} failed: {summary}",
                                                                 trace + _tail(logs[rank]))
                values[rank] = torch.load(io.BytesIO(value), weights_only=False)
        finally:
            for proc in procs:
                proc.join(timeout=5 if all(v is not None for v in values) else 0.1)
                _kill_group(proc)
    return values


def in_torchrun() -> bool:
    """This process is one rank of a ``torchrun`` job (and has not joined it yet)."""
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ and not torch.distributed.is_initialized()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0, **launch_options) -> Any:
    """Rank 0's result of ``fn(*args)`` on ``world_size`` ranks: launched here (``launch_options``
    go to ``launch``), or, under ``torchrun``, this rank joining the job (its own result)."""
    if not in_torchrun():
        return launch(fn, world_size, *args, timeout_s=timeout_s, **launch_options)[0]
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} ranks; this run needs {world_size}")
    _stop_on_first_signal()
    backend = default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        cpu_shim.install()
    torch.distributed.init_process_group(backend=backend)
    return fn(*args)

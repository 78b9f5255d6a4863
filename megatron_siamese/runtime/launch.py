"""Run a function on the ranks of a job: ``run_job(fn, world_size, *args)``, the one way every command
runs on ranks.

With no launcher, torch's ``elastic_launch`` starts the ranks here as ``torchrun --nproc-per-node`` would
(gloo ranks forked from a server that imported torch and Megatron once; NCCL ranks spawned); a failed
rank stops the others and is raised as ``RankFailed``. Under torchrun or another ``env://`` launcher this
process joins the job. docs/parallelism.md, "On a cluster".
"""

from __future__ import annotations

import faulthandler
import io
import logging
import os
import pickle
import random
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Callable, Iterable, List, NamedTuple, Optional, Tuple

import torch
import torch.multiprocessing as mp

from megatron_siamese import device
from megatron_siamese.runtime import job, launchers, orphans
from megatron_siamese.runtime.launchers import Launch, LaunchError
from megatron_siamese.runtime.quiet import silence_known_notices, warning_options
from megatron_siamese.runtime.registry import ConfigError

__all__ = ["RankFailed", "agent_in_this_process", "default_signal_handlers", "free_port", "launch", "run_job",
           "start_method", "start_rank_server"]


class RankFailed(RuntimeError):
    """A rank failed. ``str()`` is one line (the rank and its error); ``details`` holds the
    failed ranks' tracebacks and the tails of their output."""

    def __init__(self, summary: str, details: str = ""):
        super().__init__(summary)
        self.details = details


def free_port() -> int:
    """A port free now, for a server another process binds later. Below the kernel's ephemeral range:
    a port bound to 0 in between (another job's gloo listener) once got the same one."""
    low, _ = ephemeral_ports()
    candidates = range(max(1024, low - 10000), low)
    # the OS's randomness, not the random module's state: a loaded checkpoint restores that state, and
    # two processes that loaded the same one then tried the same ports at the same time
    for port in random.SystemRandom().sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # all taken: the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ephemeral_ports() -> Tuple[int, int]:
    """The kernel's range for ports bound to 0 (Linux's default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(value) for value in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


class Report(NamedTuple):
    """What a failed rank leaves for the launcher: its error in one line, its traceback, a ConfigError's
    problems (raised as the job's own ConfigError), and when it failed."""

    summary: str
    traceback: str
    problems: Optional[List[str]]
    time: float


# How a rank fails when a peer went away first; such a rank waits before it exits, so that the
# peer's own error, not its consequence, is the job's.
_PEER_GONE = re.compile(r"closed by peer|reset by peer|[Bb]roken pipe|[Cc]onnection refused|logs of the remote worker"
                        r"|[Cc]onnection was likely closed|on another rank")
PEER_REPORT_WAIT_S = 10.0


def _rank(fn, args, timeout_s: float, directory: str, quiet: frozenset, launcher_pid: int, console) -> bytes:
    """One rank: joins the job torch's agent started, runs ``fn(*args)``, returns its value as
    bytes (torch's shared-memory handles of tensors die with this process)."""
    default_signal_handlers()  # first: the server's ignored stop signals would lose the agent's meanwhile
    launch = launchers.detect()
    orphans.watch(launcher_pid)  # the fork server, this rank's parent, outlives a killed launcher
    job.set_console(console)  # rank 0's lines for the user, printed by the launcher
    if launch.rank in quiet:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        log = os.open(_log(directory, launch.rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
    faulthandler.enable()  # a crash (SIGSEGV, SIGABRT) leaves each thread's Python stack in the rank's output
    silence_known_notices()
    torch.set_num_threads(1)
    with interrupt_as_exit_status():
        try:
            job.join(launch, timeout_s)
            buffer = io.BytesIO()
            torch.save(fn(*args), buffer)
            return buffer.getvalue()
        except BaseException as error:
            summary = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
            problems = error.problems if isinstance(error, ConfigError) else None
            with open(os.path.join(directory, f"rank{launch.rank}.report"), "wb") as out:
                pickle.dump(Report(summary[:500], traceback.format_exc(), problems, time.time()), out)
            if _PEER_GONE.search(summary):
                time.sleep(PEER_REPORT_WAIT_S)  # the peer's own failure, if it comes, is the job's
            raise
        finally:
            job.leave()


# the signals torch's agent handles to stop a job (and passes on to its ranks)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def default_signal_handlers() -> None:
    """In a rank forked from the server: the fork server ignores Ctrl-C and the other stop signals
    (forkserver_preload.py) and its children inherit that, so the rank ends on the stop signal torch's
    agent passes on (Ctrl-C as KeyboardInterrupt), not 30 s later on its SIGKILL."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _interrupted_once if sig == signal.SIGINT else signal.SIG_DFL)


@contextmanager
def interrupt_as_exit_status():
    """A rank's Ctrl-C ends it with status 130. torch's worker wrapper ends a rank that a KeyboardInterrupt
    unwound with status 0 and no result, and an agent not itself signalled (study's, on a thread; a rank
    sent SIGINT alone) waited for that result for good."""
    try:
        yield
    except KeyboardInterrupt:
        raise SystemExit(INTERRUPTED) from None


INTERRUPTED = 128 + signal.SIGINT  # a shell's status for a process Ctrl-C ended


@contextmanager
def ctrl_c_noted():
    """An Event Ctrl-C (SIGINT) sets while this holds (in the main thread; elsewhere SIGINT stays Python's),
    for code waiting on threads to raise KeyboardInterrupt itself, between waits (``all_results``). Python's
    own, raised wherever the main thread stood, was once raised inside a weakref callback, which swallows
    it: study went on after Ctrl-C."""
    noted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: noted.set())
    try:
        yield noted
    finally:
        signal.signal(signal.SIGINT, previous)


def all_results(futures, interrupted: threading.Event) -> None:
    """Waits for ``futures``, raising the first failure as it comes, and KeyboardInterrupt once ``interrupted``."""
    from concurrent.futures import FIRST_EXCEPTION, wait

    pending = set(futures)
    while pending:
        if interrupted.is_set():
            raise KeyboardInterrupt
        done, pending = wait(pending, timeout=0.2, return_when=FIRST_EXCEPTION)
        for future in done:
            future.result()


def _interrupted_once(signum, frame):
    # Ctrl-C reaches a rank twice, from the terminal and passed on by the agent: the second one, raised
    # while the first unwinds, broke the data loader's shutdown with a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _print_lines(console) -> None:
    for line in iter(console.get, None):
        print(line, flush=True)


def _log(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.log")


def _tail(path: str, lines: int = 40) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def _report(directory: str, rank: int) -> Optional[Report]:
    try:
        with open(os.path.join(directory, f"rank{rank}.report"), "rb") as f:
            return pickle.load(f)
    except OSError:
        return None


def _failure(failed, directory: str, world_size: int) -> BaseException:
    """The job's error from torch's ``ChildFailedError``: a ConfigError as itself; else the cause
    (a rank's own error before a peer's broken connection, then the earliest) as ``RankFailed``."""
    reports = {rank: _report(directory, rank) for rank in failed.failures}
    settings = [report for report in reports.values() if report is not None and report.problems is not None]
    if settings:
        return ConfigError(settings[0].problems)

    def order(rank):
        report = reports[rank]
        if report is None:  # died without one: killed, or a crash
            return (0, failed.failures[rank].timestamp)
        return (1 if _PEER_GONE.search(report.summary) else 0, report.time)

    rank = min(failed.failures, key=order)
    report, exitcode = reports[rank], failed.failures[rank].exitcode
    if report is not None:
        summary = f"rank {rank} of {world_size} failed: {report.summary}"
    elif exitcode < 0:
        summary = f"rank {rank} was killed by {signal.Signals(-exitcode).name} before reporting"
    else:
        summary = f"rank {rank} exited with code {exitcode} before reporting"
    # every rank's state, the cause first: a rank the agent stopped still running has no report,
    # but its output may hold where it hung (faulthandler's 'Timeout' dump, hangs.watched)
    details = []
    for other in [rank] + sorted(set(range(world_size)) - {rank}):
        said = (reports[other].traceback if reports.get(other) is not None else
                "no report\n" if other in failed.failures else "still running when the job stopped\n")
        details.append(f"-- rank {other}: {said}{_tail(_log(directory, other), 40 if reports.get(other) else 400)}")
    return RankFailed(summary, "\n".join(details))


# Imported once by the fork server: a rank then starts in well under a second, not several.
_PRELOAD = ["megatron_siamese.runtime.forkserver_preload", "torch", "megatron.core", "megatron.core.distributed",
            "megatron.core.optimizer", "megatron.core.pipeline_parallel", "megatron_siamese.runtime.gpt",
            "megatron_siamese.models", "matplotlib.pyplot"]


def start_method(backend: str, preload: Iterable[str] = ()) -> str:
    """On gloo, ranks forked from a clean server that imported torch and Megatron once (and ``preload``,
    where this process starts the server). On NCCL, spawned: those imports ask torch.cuda.is_available(),
    after which CUDA refuses to start in a forked process."""
    if backend == "nccl":
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload(_PRELOAD[:1] + list(preload) + _PRELOAD[1:])
    known = warning_options()  # in the server before it imports Megatron (inherited when it starts)
    if known not in os.environ.get("PYTHONWARNINGS", ""):
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"), known)))
    return "forkserver"


def start_rank_server() -> None:
    """Start the fork server now, if this process will fork ranks, so its imports (several seconds) run
    beside the caller's own."""
    if job.joined() is None and launchers.detect() is None and device.backend() == "gloo":
        from multiprocessing import forkserver

        start_method("gloo")
        forkserver.ensure_running()


@contextmanager
def agent_in_this_process():
    """torch's agent, run here: its log lines off (the failure is raised, said once), and this
    process's signal handlers, which the agent replaces with its own, given back after. Agents may run
    on several threads at once (study's): the first to start quiets the loggers, the last to end restores them."""
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    with _agents_lock:
        if not _agents.running:
            _agents.levels = {logger: logger.level for logger in  # each has a level of its own
                              (logging.getLogger(name) for name in list(logging.root.manager.loggerDict))
                              if logger.name.startswith(("torch.distributed.elastic", "torch.multiprocessing"))}
            for logger in _agents.levels:
                logger.setLevel(logging.CRITICAL)
            _agents.had_variable = "TORCHELASTIC_SIGNALS_TO_HANDLE" in os.environ
        _agents.running += 1
    try:
        yield
    finally:
        with _agents_lock:
            _agents.running -= 1
            if not _agents.running:
                for logger, level in _agents.levels.items():
                    logger.setLevel(level)
                if not _agents.had_variable:
                    os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        if threading.current_thread() is threading.main_thread():  # elsewhere the agent sets none
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)


_agents_lock = threading.Lock()
_agents = SimpleNamespace(running=0, levels={}, had_variable=False)  # the agents running in this process


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: Optional[str] = None,
    timeout_s: float = 600.0,
    quiet_ranks: Iterable[int] = (),
) -> List[Any]:
    """Start ``world_size`` ranks here, run ``fn(*args)`` on each; their values in rank order.
    ``timeout_s``: how long ranks wait for one another (to meet, in a collective)."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if (backend or device.backend()) != device.backend():
        raise ValueError(f"backend {backend} asked for, but this machine runs {device.backend()}")
    directory = tempfile.mkdtemp(prefix="megatron-siamese-ranks-")  # reports, quiet ranks' output, the agent's files
    # the rendezvous store: the agent's, served from here for the job's life. Static: one node, known
    # now (c10d's rendezvous waits a random 0-0.3 s first, to spread many nodes' arrivals)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=f"megatron-siamese-{uuid.uuid4()}",
                          rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{free_port()}",
                          rdzv_configs={"rank": 0, "timeout": timeout_s},
                          max_restarts=0, monitor_interval=0.05, start_method=start_method(device.backend()),
                          logs_specs=DefaultLogsSpecs(log_dir=os.path.join(directory, "agent")))
    console = mp.get_context(config.start_method).Queue()
    printer = threading.Thread(target=_print_lines, args=(console,), name="megatron-siamese-console", daemon=True)
    printer.start()
    try:
        with agent_in_this_process():
            values = elastic_launch(config, _rank)(fn, args, timeout_s, directory, frozenset(quiet_ranks), os.getpid(),
                                                   console)
    except ChildFailedError as failed:
        raise _failure(failed, directory, world_size) from None
    except SignalException:  # Ctrl-C or a stop signal: torch's agent has stopped the ranks
        raise KeyboardInterrupt from None
    finally:
        console.put(None)  # after every line the ranks sent: they have exited
        printer.join()
        console.close()
        shutil.rmtree(directory, ignore_errors=True)
    return [torch.load(io.BytesIO(values[rank]), weights_only=False) for rank in range(world_size)]


def run_job(fn: Callable[..., Any], world_size: Optional[int], *args: Any, timeout_s: float = 600.0,
            needs: str = "", **launch_options) -> Any:
    """``fn(*args)`` on the job's ranks: rank 0's value when started here, this rank's in a launched job.
    ``world_size`` None takes the launched job's size; otherwise it must match (``needs`` names the asker)."""
    joined = job.joined()
    if joined is None:
        joined = launchers.detect()
        if joined is None:
            if world_size is None:
                raise ValueError("run_job outside a launched job needs a world size")
            return launch(fn, world_size, *args, timeout_s=timeout_s, **launch_options)[0]
        if world_size is not None and world_size != joined.world_size:
            raise LaunchError(_mismatch(joined, world_size, needs))
        if joined.launcher == "torchrun":  # its agent is this rank's parent: stop when it dies
            orphans.die_with_parent(signal.SIGTERM)
        job.join(joined, timeout_s)
    elif world_size is not None and world_size != joined.world_size:
        raise LaunchError(_mismatch(joined, world_size, needs))
    return fn(*args)


def _mismatch(launch: Launch, world_size: int, needs: str) -> str:
    """``needs``: the flags whose layout asks for ``world_size`` ranks, or a command that runs on
    that many (``upcycle``, ``analyze``: one), which only a launch of that size can change."""
    what = f"{needs} uses" if needs else "this run needs"
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
    layout = needs.startswith("--") or needs.startswith("layout")
    return (f"the {launch.launcher} job has {launch.world_size} ranks but {what} {ranks}: launch {ranks}"
            + (f", or change the layout to use {launch.world_size}" if layout else
               f" (torchrun --nproc-per-node {world_size})"))

"""Run a function on the ranks of a job: spawned here, or this process joining a launched job.

``run_job(fn, world_size, *args)`` is the one way every command runs on ranks:

* no launcher started this process (``launchers.detect()`` is None): it spawns
  ``world_size`` ranks on this host (CPU processes with gloo, or one per GPU with NCCL), each
  joins the job exactly as a torchrun rank would, runs ``fn(*args)``, and the ranks' values
  are gathered to rank 0 with torch.distributed; ``run_job`` returns rank 0's value
  (``launch`` returns all of them, in rank order). A failing rank's error is re-raised here
  (``RankFailed``: its last line, and its traceback and output as details) and the other
  ranks are stopped, so a broken run fails fast instead of hanging;
* under ``torchrun`` (single- or multi-node, c10d rendezvous), a SLURM step (``srun``) or
  another ``env://`` launcher, this process joins the job (``join``) and returns its own
  value of ``fn(*args)``. The job's size must be the run's; a later ``run_job`` in the same
  process reuses the joined job.

``on_first_ranks(size, fn)`` runs ``fn`` on the job's first ``size`` ranks as their whole
world (Megatron builds its groups over the default group), while the other ranks wait: how
``check`` runs layouts of every size in one job. ``console(line)`` prints for the job
(rank 0) even when rank 0's own output goes to a log.

Stop signals may reach any process of the job (``stop_signals``): the ranks agree on the step to
stop after and save; a spawned rank dies with the launcher (``orphans``).
It is long because spawning a job here and joining a launched one are one thing seen from two
sides: they share the job's state (``_job``), its console and its failure reports.
``quiet_ranks`` send those ranks' output to a log file, shown only when they fail.
"""

from __future__ import annotations

import io
import os
import queue
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterable, List, Optional

import torch
import torch.multiprocessing as mp

from megatron_siamese import device
from megatron_siamese.runtime import cpu_shim, launchers, orphans, stop_signals
from megatron_siamese.runtime.stop_signals import stop_requested  # noqa: F401  (the trainer asks launch)
from megatron_siamese.runtime.launchers import JoinError, Launch, LaunchError
from megatron_siamese.runtime.registry import ConfigError
from megatron_siamese.runtime.quiet import silence_known_notices, warning_options



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
    return device.backend()


# -- this process in a job -------------------------------------------------------------

# the joined job: its launch, backend, timeout, the rendezvous store the process groups
# are formed on, and how many times they were re-formed
_job: dict = {}
_console = {"queue": None}  # spawned ranks: the launcher prints what rank 0 sends it


def synchronize() -> None:
    """In a launched job, wait here for every rank (e.g. until rank 0 has written its report,
    before a rank's exit lets the launcher stop the others)."""
    if joined() is not None and torch.distributed.is_initialized():
        torch.distributed.barrier()


def joined() -> Optional[Launch]:
    """The job this process joined, if it did."""
    return _job.get("launch")


def console(line: str) -> None:
    """Print ``line`` for the job, on rank 0 only: in a launched job to its output, in a job
    spawned here by the launching process (to its stdout, whatever rank 0's own output is)."""
    launch = joined()
    if launch is not None and launch.rank != 0:
        return
    if _console["queue"] is None:
        print(line, flush=True)
    else:
        _console["queue"].put((CONSOLE, None, line))


def _init_group(size: int, tag: str) -> None:
    """torch.distributed over the job's first ``size`` ranks, on the rendezvous store under
    ``tag``; returns once every one of them has formed it. torch returns from
    ``init_process_group`` when this rank's own connections are made (its barrier there is off
    by default), and a rank that then tears the group down again (``on_first_ranks``) would
    close connections a slower rank is still completing: gloo's "Connection closed by peer"."""
    store = torch.distributed.PrefixStore(tag, _job["store"])
    rank = _job["launch"].rank
    torch.distributed.init_process_group(backend=_job["backend"], store=store, rank=rank, world_size=size,
                                         timeout=timedelta(seconds=_job["timeout_s"]))
    store.set(f"formed/{rank}", b"1")
    store.wait([f"formed/{other}" for other in range(size)])


def join(launch: Launch, timeout_s: float) -> None:
    """Join ``launch``'s job: the rendezvous (the launching process's store for ranks spawned by
    ``launch``, else env://; every rank within ``timeout_s``, else an error saying how many
    came), this rank's GPU (its local rank) or the CPU shim, and torch.distributed over the
    whole job."""
    os.environ.update(launch.environment(), CUDA_DEVICE_MAX_CONNECTIONS="1")
    backend = device.backend()
    if backend == "nccl":
        if launch.local_rank >= device.gpu_count():
            raise JoinError(f"local rank {launch.local_rank} has no GPU ({device.gpu_count()} visible): start at "
                              "most one rank per GPU on each node")
        torch.cuda.set_device(launch.local_rank)
    else:
        os.environ[cpu_shim.ENV_VAR] = "1"  # inherited by helper processes
        cpu_shim.install()
    try:
        if launch.launcher == "spawn":  # the launching process hosts the store (``launch``)
            store = torch.distributed.TCPStore(launch.master_addr, launch.master_port, launch.world_size,
                                               is_master=False, timeout=timedelta(seconds=timeout_s))
        else:
            store, _, _ = next(torch.distributed.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    except (RuntimeError, OSError) as error:  # torch's DistStoreError is a RuntimeError
        raise JoinError(
            f"rank {launch.rank} of the {launch.describe()} did not meet the others within {timeout_s:.0f}s "
            f"({str(error).strip().splitlines()[0][:160]}): check that every node started and reaches "
            f"{launch.master_addr}:{launch.master_port}") from None
    _job.update(launch=launch, backend=backend, timeout_s=timeout_s, store=store, generation=0)
    _init_group(launch.world_size, "world/0")


def group_timeout_minutes() -> float:
    """How long, in minutes, a rank waits for the others in the process groups Megatron forms over
    the joined job (``gpt.initialize_model_parallel``): the job's own timeout, as in the groups
    ``join`` forms (--distributed-timeout-minutes), not Megatron's default of 30 minutes, during
    which a rank whose peer died or hung while it formed or used those groups would sit in C code,
    deaf to SIGTERM. Megatron's default outside a joined job."""
    return _job["timeout_s"] / 60.0 if _job else MEGATRON_GROUP_TIMEOUT_MINUTES


MEGATRON_GROUP_TIMEOUT_MINUTES = 30  # parallel_state.initialize_model_parallel's default


def leave() -> None:
    """Leave the joined job (tear down torch.distributed)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _job.clear()


class RegroupError(RuntimeError):
    """The job's process groups could not be formed again (``on_first_ranks``): the job's
    failure, never ``fn``'s, however a caller treats ``fn``'s errors."""


def _regroup(size: int, tag: str) -> None:
    try:
        _init_group(size, tag)
    except Exception as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise RegroupError(f"the job's first {size} ranks could not form their process group again "
                           f"({type(error).__name__}: {first})") from error


def on_first_ranks(size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on the job's first ``size`` ranks, torch.distributed's default group being
    just them; the other ranks wait and get None. Every rank of the job must call it (the
    groups are re-formed over the job's rendezvous store; ``RegroupError`` if they cannot be).
    An error in ``fn`` is raised on its ranks after the job is whole again."""
    launch = joined()
    world = launch.world_size
    if size > world:
        raise LaunchError(f"{size} ranks asked of a job of {world}")
    if size == world:
        return fn(*args)
    _job["generation"] += 1
    generation = _job["generation"]
    torch.distributed.destroy_process_group()
    value, error = None, None
    if launch.rank < size:
        _regroup(size, f"part/{generation}")
        try:
            value = fn(*args)
        except Exception as raised:  # re-raised once the job is whole: the others must not wait forever
            error = raised
        finally:
            torch.distributed.destroy_process_group()
    _regroup(world, f"world/{generation}")
    if error is not None:
        raise error
    return value


def gather_to_rank0(value: Any) -> Optional[List[Any]]:
    """Every rank's value on rank 0, in rank order (None elsewhere)."""
    world = torch.distributed.get_world_size()
    values = [None] * world if torch.distributed.get_rank() == 0 else None
    torch.distributed.gather_object(value, values, dst=0)
    return values


def shared_by_all_ranks(directory: str) -> bool:
    """Whether every rank of the joined job sees the same ``directory`` (a shared file system,
    or one node): rank 0 leaves a mark in it that every rank looks for. Every rank must call it;
    if rank 0 cannot write there, every rank raises that OSError."""
    import uuid

    written = [f".megatron-siamese-mark-{uuid.uuid4().hex}", None]  # rank 0's name for the mark
    torch.distributed.broadcast_object_list(written, src=0)
    mark = os.path.join(directory, written[0])  # in this rank's own directory: its own path, its own cwd
    if torch.distributed.get_rank() == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            open(mark, "w").close()
        except OSError as error:
            written[1] = f"cannot write in {directory}: {error.strerror or error}"
    torch.distributed.broadcast_object_list(written, src=0)
    if written[1] is not None:
        raise OSError(written[1])
    seen = torch.tensor([float(os.path.exists(mark))], device=device.current())
    torch.distributed.all_reduce(seen, op=torch.distributed.ReduceOp.MIN)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        os.remove(mark)
    return bool(seen.item())


# -- ranks spawned here ----------------------------------------------------------------


def _worker(launch, timeout_s, fn, args, results, stop_value, log_path, launcher_pid):
    os.setpgrp()  # a group of its own: the launcher can stop it with whatever it started (writer processes)
    # the launcher's death ends this rank's group, what it started too (no parent-death signal: it
    # would end the rank alone, orphaning its helpers; the fork server outlives a killed launcher)
    orphans.watch(launcher_pid)
    stop_signals.share(stop_value)
    stop_signals.handle_in_this_rank()
    _console["queue"] = results
    if log_path is not None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
    silence_known_notices()
    try:
        torch.set_num_threads(1)
        join(launch, timeout_s)
        values = gather_to_rank0(fn(*args))
        # Tensors travel as bytes: torch's shared-memory handles die with this process.
        buffer = io.BytesIO()
        torch.save(values, buffer)
        results.put((launch.rank, True, buffer.getvalue() if launch.rank == 0 else None))
    except KeyboardInterrupt:  # a second stop signal to this rank: stopped at once
        results.put((launch.rank, False, (INTERRUPTED, "", None)))
    except BaseException as error:  # report every failure, including SystemExit from asserts in fn
        summary = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
        problems = error.problems if isinstance(error, ConfigError) else None  # settings, not a crash
        results.put((launch.rank, False, (summary[:500], traceback.format_exc(), problems)))
    finally:
        leave()


# Imported once by the fork server, so that a rank starts in well under a second instead of
# importing torch and Megatron again (several seconds a rank, most of a CPU test's time).
_PRELOAD = ["megatron_siamese.runtime.forkserver_preload", "torch", "megatron.core", "megatron.core.distributed",
            "megatron.core.optimizer", "megatron.core.pipeline_parallel", "megatron_siamese.runtime.gpt",
            "megatron_siamese.models", "matplotlib.pyplot"]


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


CONSOLE = -1  # a message from rank 0 for the launcher to print, not a rank's report
INTERRUPTED = "interrupted"  # a rank's report: a second stop signal stopped it at once


def _next_result(results, procs, timeout_s: float, logs):
    """The next rank's report (printing rank 0's console lines as they come); fails at once
    when a rank died without one (a crash, a signal, a script without a ``__main__`` guard
    re-running itself)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            message = results.get(timeout=1.0)
            if message[0] != CONSOLE:
                return message
            print(message[2], flush=True)
        except queue.Empty:
            dead = _dead_rank(procs, logs)
            if dead is not None:
                raise dead from None
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


def _dead_rank(procs, logs) -> Optional[RankFailed]:
    """A rank that died without a report (killed by a signal, or exited non-zero: a crash), if
    one did. (A rank that reports its error still exits 0.)"""
    for rank, proc in enumerate(procs):
        if proc.exitcode is not None and proc.exitcode != 0:
            how = (f"was killed by {signal.Signals(-proc.exitcode).name}" if proc.exitcode < 0
                   else f"exited with code {proc.exitcode}")
            return RankFailed(f"rank {rank} {how} before reporting", _tail(logs[rank]))
    return None


# How a rank fails when a peer went away first: on the broken connection (gloo's "Connection
# closed by peer ... Check the logs of the remote worker", a reset, a refused connect, the
# rendezvous store's "Failed to recv, got 0 bytes. Connection was likely closed").
_PEER_GONE = re.compile(r"closed by peer|reset by peer|[Bb]roken pipe|[Cc]onnection refused|logs of the remote worker"
                        r"|[Cc]onnection was likely closed")
PEER_REPORT_WAIT_S = 10.0  # how long a failure on a broken connection waits for the peer's own report


def _cause(rank, report, results, procs, logs, pending: int, wait_s: Optional[float] = None,
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
    deadline = time.monotonic() + (wait_s if _PEER_GONE.search(report[0]) else 1.0)
    while time.monotonic() < deadline:
        dead = _dead_rank(procs, logs)
        if dead is not None:
            return dead
        if pending == 0 or not _PEER_GONE.search(report[0]):
            time.sleep(0.05)  # a crashed rank's exit status takes a moment to show
            continue
        try:
            other, ok, value = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if other == CONSOLE:
            print(value, flush=True)
            continue
        pending -= 1
        heard[other] = value if not ok else ("finished", "", None)
        if not ok and value[0] != INTERRUPTED and not _PEER_GONE.search(value[0]):
            rank, report = other, value
            deadline = min(deadline, time.monotonic() + 1.0)  # the cause: only a death would say more
    summary = f"rank {rank} of {world_size} failed: {report[0]}"
    if _PEER_GONE.search(report[0]):
        silent = sorted(set(range(world_size)) - set(heard))
        summary += (f" (no rank died or reported another error within {wait_s:.0f} s"
                    f"{'; still running: ranks ' + ', '.join(map(str, silent)) if silent else ''})")
    details = [f"(the job's rendezvous store: {rendezvous})\n" if rendezvous else "", report[1] + _tail(logs[rank])]
    for other in sorted(set(range(world_size)) - {rank}):
        said = f"reported: {heard[other][0]}\n{heard[other][1]}" if other in heard else "no report"
        details.append(f"-- rank {other}: {said}\n{_tail(logs[other])}")
    return RankFailed(summary, "\n".join(filter(None, details)))


def _start_helpers(ctx) -> None:
    from multiprocessing import forkserver, resource_tracker

    with stop_signals.ignored():
        resource_tracker.ensure_running()
        if ctx.get_start_method() == "forkserver":
            forkserver.ensure_running()


def start_rank_server() -> None:
    """Start the fork server that ``launch`` forks ranks from, now, if this process will spawn
    ranks (no launcher started it, and gloo: on NCCL ranks are spawned fresh). Its imports of
    torch and Megatron (several seconds) then run beside the caller's own, rather than after
    them when the first rank starts."""
    if joined() is None and launchers.detect() is None and device.backend() == "gloo":
        _start_helpers(_context("gloo"))


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
    """Spawn ``world_size`` ranks here, run ``fn(*args)`` on each; their values in rank order."""
    if (backend or device.backend()) != device.backend():
        raise ValueError(f"backend {backend} asked for, but this machine runs {device.backend()}")
    ctx = _context(device.backend())
    _start_helpers(ctx)
    results = ctx.Queue()
    stop_value = ctx.Value("i", 0, lock=False)  # the stop signal's number (one writer: the launcher)
    # The job's rendezvous store, served from here on a port bound here for the job's life: a
    # free port named to rank 0, which binds it later, can be taken in between (by any other
    # job's listener: rank 0 then fails with EADDRINUSE, and the others reach someone else's).
    store = torch.distributed.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=timeout_s))
    port = store.port
    quiet = set(quiet_ranks)
    log_dir = tempfile.mkdtemp(prefix="megatron-siamese-ranks-") if quiet else None  # quiet ranks' output
    logs = [os.path.join(log_dir, f"rank{rank}.log") if rank in quiet else None for rank in range(world_size)]
    procs = [
        ctx.Process(target=_worker, daemon=False,
                    args=(Launch("spawn", rank, world_size, rank, 0, 1, "127.0.0.1", port), timeout_s, fn, args,
                          results, stop_value, logs[rank], os.getpid()))
        for rank in range(world_size)
    ]
    values: Optional[List[Any]] = None
    reported = 0
    with stop_signals.handled_by_launcher(stop_value, graceful_stop, echo):
        for proc in procs:
            proc.start()
        try:
            for reported in range(1, world_size + 1):
                rank, ok, value = _next_result(results, procs, timeout_s, logs)
                if not ok:
                    summary, _, problems = value
                    if summary == INTERRUPTED:
                        raise KeyboardInterrupt
                    if problems is not None:
                        raise ConfigError(problems)
                    raise _cause(rank, value, results, procs, logs, pending=world_size - reported,
                                 rendezvous=f"127.0.0.1:{port}")
                if rank == 0:
                    values = torch.load(io.BytesIO(value), weights_only=False)
        finally:
            for proc in procs:
                proc.join(timeout=5 if reported == world_size else 0.1)
                _kill_group(proc)
            if log_dir is not None:  # what an error needed of the logs is in it by now
                shutil.rmtree(log_dir, ignore_errors=True)
    return values


def run_job(fn: Callable[..., Any], world_size: Optional[int], *args: Any, timeout_s: float = 600.0,
            needs: str = "", **launch_options) -> Any:
    """``fn(*args)`` on the job's ranks. Spawned here (``launch_options`` go to ``launch``) when no
    launcher started this process: rank 0's value. In a launched job: this rank's value, after
    joining the job (or reusing the one joined before). ``world_size`` None takes the launched
    job's size; otherwise it must match (``needs`` says what asks for it, for the error)."""
    job = joined()
    if job is None:
        job = launchers.detect()
        if job is None:
            if world_size is None:
                raise ValueError("run_job outside a launched job needs a world size")
            return launch(fn, world_size, *args, timeout_s=timeout_s, **launch_options)[0]
        if world_size is not None and world_size != job.world_size:
            raise LaunchError(_mismatch(job, world_size, needs))
        if job.launcher == "torchrun":  # its agent is this rank's parent: stop (and save) when it dies
            orphans.die_with_parent(signal.SIGTERM)
        stop_signals.handle_in_this_rank()  # before joining: a signal while the others come is not lost
        join(job, timeout_s)
    elif world_size is not None and world_size != job.world_size:
        raise LaunchError(_mismatch(job, world_size, needs))
    return fn(*args)


def _mismatch(launch: Launch, world_size: int, needs: str) -> str:
    """``needs``: the flags whose layout asks for ``world_size`` ranks, or a command that runs on
    that many (``upcycle``, ``analyze``: one), which only a launch of that size can change."""
    what = f"{needs} uses" if needs else "this run needs"
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
    layout = needs.startswith("--") or needs.startswith("layout")
    return (f"the {launch.launcher} job has {launch.world_size} ranks but {what} {ranks}: launch {ranks}"
            + (f", or change the layout to use {launch.world_size}" if layout else
               f" (torchrun --nproc-per-node {world_size}, srun --ntasks {world_size})"))


def job_world_size() -> Optional[int]:
    """The size of the launched job this process belongs to (joined or not), or None."""
    launch = joined() or launchers.detect()
    return None if launch is None else launch.world_size

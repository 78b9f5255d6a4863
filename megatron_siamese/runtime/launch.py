"""Run a function on the ranks of a job: spawned here, or this process joining a launched job.

``run_job(fn, world_size, *args)`` is the one way every command runs on ranks:

* no launcher started this process (``launchers.detect()`` is None): it spawns
  ``world_size`` ranks on this host (CPU processes with gloo, forked from a server that imported
  torch and Megatron once, or one per GPU with NCCL), each joins the job exactly as a torchrun
  rank would (``job.join``), runs ``fn(*args)``, and the ranks' values are gathered to rank 0
  with torch.distributed; ``run_job`` returns rank 0's value (``launch`` returns all of them,
  in rank order). A failing rank's error is re-raised here (``RankFailed``, read from the
  ranks' reports by ``failure_reports``) and the other ranks are stopped, so a broken run fails
  fast instead of hanging;
* under ``torchrun`` (single- or multi-node, c10d rendezvous), a SLURM step (``srun``) or
  another ``env://`` launcher, this process joins the job and returns its own value of
  ``fn(*args)``. The job's size must be the run's; a later ``run_job`` in the same process
  reuses the joined job.

Stop signals stop the job at once, whichever process gets them (``stop_signals``); a spawned rank
dies with the launcher (``orphans``).
``quiet_ranks`` send those ranks' output to a log file, shown only when they fail.
"""

from __future__ import annotations

import faulthandler
import io
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterable, List, Optional, Tuple

import torch
import torch.multiprocessing as mp

from megatron_siamese import device
from megatron_siamese.runtime import hangs, job, launchers, orphans, stop_signals
from megatron_siamese.runtime.failure_reports import INTERRUPTED, RankFailed, cause, next_result
from megatron_siamese.runtime.job import Failure, RankReport
from megatron_siamese.runtime.launchers import Launch, LaunchError
from megatron_siamese.runtime.registry import ConfigError
from megatron_siamese.runtime.quiet import silence_known_notices, warning_options

__all__ = ["RankFailed", "free_port", "launch", "run_job", "start_rank_server"]


def free_port() -> int:
    """A port free now, for a server another process binds later (torchrun's --rdzv-endpoint, a
    SLURM step's MASTER_PORT). Below the kernel's ephemeral range: a port bound to 0 in between (a
    gloo listener of another job on this machine) is never given one from there, and one was
    (torchrun's agents then reached that listener: "Connection reset by peer")."""
    low, _ = ephemeral_ports()
    candidates = range(max(1024, low - 10000), low)
    for port in random.sample(candidates, min(64, len(candidates))):
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


def _worker(launch, timeout_s, fn, args, results, log_path, launcher_pid):
    os.setpgrp()  # a group of its own: the launcher can stop it with whatever it started (writer processes)
    # the launcher's death ends this rank's group, what it started too (no parent-death signal: it
    # would end the rank alone, orphaning its helpers; the fork server outlives a killed launcher)
    orphans.watch(launcher_pid)
    stop_signals.default_in_this_rank()
    job.set_console_queue(results)
    if log_path is not None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
    faulthandler.enable()  # a crash (SIGSEGV, SIGABRT) leaves each thread's Python stack in the rank's output
    faulthandler.register(hangs.STACK_SIGNAL, all_threads=True)  # and a hung rank's, asked for (failure_reports)
    silence_known_notices()
    try:
        torch.set_num_threads(1)
        job.join(launch, timeout_s)
        values = job.gather_to_rank0(fn(*args))
        # Tensors travel as bytes: torch's shared-memory handles die with this process.
        buffer = io.BytesIO()
        torch.save(values, buffer)
        results.put(RankReport(launch.rank, True, buffer.getvalue() if launch.rank == 0 else None))
    except KeyboardInterrupt:  # Ctrl-C reached this rank: stopped
        results.put(RankReport(launch.rank, False, Failure(INTERRUPTED)))
    except BaseException as error:  # report every failure, including SystemExit from asserts in fn
        summary = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
        problems = error.problems if isinstance(error, ConfigError) else None  # settings, not a crash
        results.put(RankReport(launch.rank, False, Failure(summary[:500], traceback.format_exc(), problems)))
    finally:
        job.leave()


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
    if job.joined() is None and launchers.detect() is None and device.backend() == "gloo":
        _start_helpers(_context("gloo"))


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: Optional[str] = None,
    timeout_s: float = 600.0,
    quiet_ranks: Iterable[int] = (),
) -> List[Any]:
    """Spawn ``world_size`` ranks here, run ``fn(*args)`` on each; their values in rank order.
    ``timeout_s``: how long ranks wait for one another (to meet, in a collective), and the
    launcher for each of their reports."""
    if (backend or device.backend()) != device.backend():
        raise ValueError(f"backend {backend} asked for, but this machine runs {device.backend()}")
    ctx = _context(device.backend())
    _start_helpers(ctx)
    results = ctx.Queue()
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
                          results, logs[rank], os.getpid()))
        for rank in range(world_size)
    ]
    values: Optional[List[Any]] = None
    reported = 0
    with stop_signals.handled_by_launcher():
        for proc in procs:
            proc.start()
        try:
            for reported in range(1, world_size + 1):
                report = next_result(results, procs, timeout_s, logs)
                if not report.ok:
                    if report.value.summary == INTERRUPTED:
                        raise KeyboardInterrupt
                    if report.value.problems is not None:
                        raise ConfigError(report.value.problems)
                    raise cause(report.rank, report.value, results, procs, logs, pending=world_size - reported,
                                rendezvous=f"127.0.0.1:{port}")
                if report.rank == 0:
                    values = torch.load(io.BytesIO(report.value), weights_only=False)
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
               f" (torchrun --nproc-per-node {world_size}, srun --ntasks {world_size})"))

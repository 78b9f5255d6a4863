"""Launch a function on N ranks: CPU processes with gloo, or GPUs with NCCL when CUDA is present.

``launch(fn, world_size, *args)`` spawns ``world_size`` processes, initializes
``torch.distributed`` in each (on CPU it installs the CPU shim first), calls
``fn(*args)`` and returns the per-rank return values in rank order. A failing rank's
traceback is re-raised in the caller and the other ranks are terminated, so a broken
layout fails fast instead of hanging. ``run_on_ranks`` does the same, or, inside a
``torchrun`` job, runs ``fn`` as this rank.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.multiprocessing as mp

from megatron_siamese.runtime import cpu_shim


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


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


def _worker(rank, world_size, backend, port, timeout_s, fn, args, results):
    try:
        torch.set_num_threads(1)
        init_distributed(rank, world_size, backend, port, timeout_s)
        value = fn(*args)
        # Tensors travel as bytes: torch's shared-memory handles die with this process.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # report every failure, including SystemExit from asserts in fn
        results.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _next_result(results, procs, timeout_s: float):
    """The next rank's report; fails at once when a rank died without one (a crash, a
    signal, a script without a ``__main__`` guard re-running itself under spawn)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            dead = [(rank, proc.exitcode) for rank, proc in enumerate(procs)
                    if proc.exitcode not in (None, 0)]
            if dead:
                raise RankFailed(f"rank {dead[0][0]} exited with code {dead[0][1]} before reporting "
                                 "(see its stderr above)") from None
    raise RankFailed(f"no result from some rank within {timeout_s:.0f}s")


# Imported once by the fork server, so that a rank starts in well under a second instead of
# importing torch and Megatron again (several seconds a rank, most of a CPU test's time).
_PRELOAD = ["torch", "megatron.core", "megatron.core.distributed", "megatron.core.optimizer",
            "megatron.core.pipeline_parallel", "megatron_siamese.runtime.gpt", "megatron_siamese.models"]


def _context():
    """Fresh ranks forked from a server that imported torch and Megatron once, in a clean process
    (never from the caller, whose threads and state a fork would copy)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: Optional[str] = None,
    timeout_s: float = 600.0,
) -> List[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh ranks; return their results in rank order."""
    backend = backend or default_backend()
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, backend, port, timeout_s, fn, args, results),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: List[Any] = [None] * world_size
    try:
        for _ in range(world_size):
            rank, ok, value = _next_result(results, procs, timeout_s)
            if not ok:
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{value}")
            values[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for proc in procs:
            proc.join(timeout=5 if all(v is not None for v in values) else 0.1)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    return values


def in_torchrun() -> bool:
    """This process is one rank of a ``torchrun`` job (and has not joined it yet)."""
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ and not torch.distributed.is_initialized()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0) -> Any:
    """Rank 0's result of ``fn(*args)`` on ``world_size`` ranks: launched here, or, under
    ``torchrun``, this rank joining the job (then this rank's own result)."""
    if not in_torchrun():
        return launch(fn, world_size, *args, timeout_s=timeout_s)[0]
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} ranks; this run needs {world_size}")
    backend = default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        cpu_shim.install()
    torch.distributed.init_process_group(backend=backend)
    return fn(*args)

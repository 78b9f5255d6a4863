"""This process as one rank of a job: joining it, re-forming its process groups, and what every
rank may call inside it (``join``, ``on_first_ranks``: how ``check`` runs layouts of every size in one
job, ``console``, ``gather_to_rank0``).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch

from megatron_siamese import device
from megatron_siamese.runtime import cpu_shim, launchers
from megatron_siamese.runtime.launchers import JoinError, Launch, LaunchError

# the joined job: launch, backend, timeout, rendezvous store, times its groups were re-formed
_job: dict = {}
_console = {"queue": None}  # ranks started by ``launch.py``: the launcher prints what rank 0 puts there


def synchronize() -> None:
    """In a launched job, wait here for every rank (e.g. until rank 0 has written its report,
    before a rank's exit lets the launcher stop the others)."""
    if joined() is not None and torch.distributed.is_initialized():
        torch.distributed.barrier()


def joined() -> Optional[Launch]:
    """The job this process joined, if it did."""
    return _job.get("launch")


def console(line: str) -> None:
    """Print ``line`` for the job, on rank 0 only, through the launcher when ``launch.py`` started the
    ranks (their own output is the fork server's, or a quiet rank's log)."""
    launch = joined()
    if launch is not None and launch.rank != 0:
        return
    if _console["queue"] is None:
        print(line, flush=True)
    else:
        _console["queue"].put(line)


def set_console(queue) -> None:
    """``console`` lines go to ``queue``, which the launching process prints."""
    _console["queue"] = queue


def _init_group(size: int, tag: str) -> None:
    """torch.distributed over the job's first ``size`` ranks; returns once every one has formed it.
    torch returns when this rank's own connections are made, and a rank tearing the group down then
    would close connections a slower rank is still completing (gloo's "Connection closed by peer")."""
    store = torch.distributed.PrefixStore(tag, _job["store"])
    rank = _job["launch"].rank
    torch.distributed.init_process_group(backend=_job["backend"], store=store, rank=rank, world_size=size,
                                         timeout=timedelta(seconds=_job["timeout_s"]))
    store.set(f"formed/{rank}", b"1")
    store.wait([f"formed/{other}" for other in range(size)])


def restart_count() -> int:
    """How many times torchrun restarted this job's workers (0 elsewhere). The agent's store outlives a
    restart, so each attempt uses a prefix of its own: else new ranks read the dead ranks' gloo
    addresses ("Connection refused")."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def join(launch: Launch, timeout_s: float) -> None:
    """Join ``launch``'s job (every rank within ``timeout_s``), take this rank's GPU or the CPU shim,
    and form torch.distributed over the whole job."""
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
        store, _, _ = next(torch.distributed.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
        store = torch.distributed.PrefixStore(f"attempt/{restart_count()}", store)
    except (RuntimeError, OSError) as error:  # torch's DistStoreError is a RuntimeError
        raise JoinError(
            f"rank {launch.rank} of the {launch.describe()} did not meet the others within {timeout_s:.0f}s "
            f"({str(error).strip().splitlines()[0][:160]}): check that every node started and reaches "
            f"{launch.master_addr}:{launch.master_port}") from None
    _job.update(launch=launch, backend=backend, timeout_s=timeout_s, store=store, generation=0)
    _init_group(launch.world_size, "world/0")


def group_timeout_minutes() -> float:
    """Minutes a rank waits for the others in Megatron's process groups: the job's own timeout, not
    Megatron's 30, during which a rank whose peer died would sit in C code, deaf to SIGTERM."""
    return _job["timeout_s"] / 60.0 if _job else MEGATRON_GROUP_TIMEOUT_MINUTES


MEGATRON_GROUP_TIMEOUT_MINUTES = 30  # parallel_state.initialize_model_parallel's default


def store_of_these_groups(prefix: str):
    """The job's rendezvous store under ``prefix``, for the process groups formed now (each
    ``on_first_ranks`` forms new ones): it outlives them, and answers after they broke."""
    return torch.distributed.PrefixStore(f"{prefix}/{_job['generation']}", _job["store"])


def leave() -> None:
    """Leave the joined job (tear down torch.distributed)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _job.clear()


class GroupsBroken(RuntimeError):
    """The job's process groups are broken for good (``hangs.CollectiveTimeout``: a rank hangs)."""


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
    """``fn(*args)`` on the job's first ``size`` ranks as the whole default group; the others wait and
    get None. Every rank must call it. ``fn``'s error is raised once the job is whole again, except
    ``GroupsBroken`` (a rank hangs), raised at once."""
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
            if isinstance(raised, GroupsBroken):  # a rank hangs: the job cannot be whole again
                raise
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


def job_world_size() -> Optional[int]:
    """The size of the launched job this process belongs to (joined or not), or None."""
    launch = joined() or launchers.detect()
    return None if launch is None else launch.world_size

"""Who started this process: ``torchrun`` (on SLURM, one ``srun`` task per node, each a torchrun agent;
examples/slurm/), another ``env://`` launcher, or nobody (our commands then start their own ranks).

Plain environment reading, no torch import, as torch.distributed reads it: ``detect()`` returns a
``Launch`` or ``None``, or raises ``LaunchError`` when the variables contradict one another.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import List, Mapping, Optional

class LaunchError(RuntimeError):
    """The launcher's variables cannot describe one job; the message says which and what to change."""


class JoinError(LaunchError):
    """This rank could not meet the others: its own problem, which every rank reports itself
    (rank 0 may be the one missing)."""


@dataclass(frozen=True)
class Launch:
    """This process's place in a job some launcher started."""

    launcher: str  # "torchrun" or "env" (RANK/WORLD_SIZE set by another launcher)
    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    nnodes: int
    master_addr: str
    master_port: int

    def environment(self) -> dict:
        """The ``env://`` variables torch.distributed and Megatron read, for this rank."""
        return dict(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank),
                    MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port))

    def describe(self) -> str:
        return (f"{self.launcher} job of {self.world_size} ranks on {self.nnodes} node(s), rendezvous "
                f"{self.master_addr}:{self.master_port}")


def _int(env: Mapping[str, str], name: str, default: Optional[int] = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise LaunchError(f"{name} is not set")
        return default
    if not re.fullmatch(r"\s*\d+\s*", value):
        raise LaunchError(f"{name}={value!r} is not a count")
    return int(value)


def _env_launch(env: Mapping[str, str], launcher: str) -> Launch:
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in env]
    if missing:
        raise LaunchError(f"{', '.join(missing)} not set while {'RANK' if 'RANK' in env else 'WORLD_SIZE'} is: "
                          "an env:// launch needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torchrun sets them)")
    world = _int(env, "WORLD_SIZE")
    local_world = _int(env, "LOCAL_WORLD_SIZE", world)
    launch = Launch(launcher=launcher, rank=_int(env, "RANK"), world_size=world,
                    local_rank=_int(env, "LOCAL_RANK", _int(env, "RANK")),
                    node_rank=_int(env, "GROUP_RANK", 0), nnodes=max(1, world // max(local_world, 1)),
                    master_addr=env["MASTER_ADDR"], master_port=_int(env, "MASTER_PORT"))
    problems: List[str] = []
    if launch.world_size < 1:
        problems.append(f"WORLD_SIZE={launch.world_size} must be at least 1")
    elif not 0 <= launch.rank < launch.world_size:
        problems.append(f"RANK={launch.rank} is not below WORLD_SIZE={launch.world_size}")
    if launch.local_rank > launch.rank:
        problems.append(f"LOCAL_RANK={launch.local_rank} exceeds RANK={launch.rank}")
    if problems:
        raise LaunchError(f"the {launcher} variables contradict one another: {'; '.join(problems)}")
    return launch


def detect(env: Mapping[str, str] = os.environ) -> Optional[Launch]:
    """This process's place in a launched job, or None when no launcher started it."""
    if "TORCHELASTIC_RUN_ID" in env:
        return _env_launch(env, "torchrun")
    if "RANK" in env or "WORLD_SIZE" in env:
        return _env_launch(env, "env")
    if ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env) and env.get("SLURM_NTASKS", "1").strip() != "1":
        raise LaunchError(f"srun started this process as one of {env['SLURM_NTASKS']} tasks, each of which would start "
                          "ranks of its own: run one task per node, each a torchrun agent (srun --ntasks-per-node 1 "
                          "torchrun --nnodes $SLURM_NNODES --nproc-per-node GPUS --rdzv-backend c10d ...; "
                          "examples/slurm/)")
    return None


def reporter(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process speaks for the job: rank 0 of a launched job, or the process that
    spawns its ranks itself. (No checks: ``detect`` raises on a bad environment.)"""
    try:
        launch = detect(env)
    except LaunchError:
        return True  # the error itself must be shown
    return launch is None or launch.rank == 0

"""Who started this process: ``torchrun``, a SLURM step (``srun``), another ``env://``
launcher, or nobody (then our commands spawn their own ranks on this host).

Plain environment reading, no torch import: ``detect()`` returns this process's place in a
launched job (``Launch``) or ``None``, and raises ``LaunchError`` (one line saying what to
change) when the variables contradict one another. Read as Megatron-LM and torchtitan read
them: torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT``
win (torchrun inside ``srun`` is common, and there SLURM's variables describe the agents);
otherwise a SLURM step's ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID`` /
``SLURM_NODELIST``, with the first node of the step as the rendezvous host.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import List, Mapping, Optional

DEFAULT_PORT = 29500  # torchrun's default; a SLURM job without MASTER_PORT gets one from its job id


class LaunchError(RuntimeError):
    """The launcher's variables cannot describe one job; the message says which and what to change."""


class JoinError(LaunchError):
    """This rank could not meet the others: its own problem, which every rank reports itself
    (rank 0 may be the one missing)."""


@dataclass(frozen=True)
class Launch:
    """This process's place in a job some launcher started."""

    launcher: str  # "torchrun", "slurm" or "env" (RANK/WORLD_SIZE set by another launcher)
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


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (``node[003-010,12],gpu7`` -> ``node003``)."""
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):  # the first item: up to a comma outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    item = nodelist[:end].strip()
    # each bracketed range contributes its first value: "rack[2-3]-n[07,09]" -> "rack2-n07"
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], item)
    if not host or "[" in host or "]" in host:
        raise LaunchError(f"cannot read the first host of SLURM_NODELIST={nodelist!r}: set MASTER_ADDR")
    return host


def _torchrun(env: Mapping[str, str], launcher: str) -> Launch:
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
    _check(launch, dict(rank="RANK", world="WORLD_SIZE", local="LOCAL_RANK", node="GROUP_RANK"))
    return launch


def _slurm(env: Mapping[str, str]) -> Launch:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist and "MASTER_ADDR" not in env:
        raise LaunchError("SLURM_PROCID is set but no SLURM_NODELIST: set MASTER_ADDR to the first node's address")
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT + _int(env, "SLURM_JOB_ID", 0) % 10000
    launch = Launch(launcher="slurm", rank=_int(env, "SLURM_PROCID"), world_size=_int(env, "SLURM_NTASKS"),
                    local_rank=_int(env, "SLURM_LOCALID", 0), node_rank=_int(env, "SLURM_NODEID", 0),
                    nnodes=_int(env, "SLURM_NNODES", 1), master_addr=env.get("MASTER_ADDR") or first_host(nodelist),
                    master_port=port)
    _check(launch, dict(rank="SLURM_PROCID", world="SLURM_NTASKS", local="SLURM_LOCALID", node="SLURM_NODEID",
                        nnodes="SLURM_NNODES"))
    for ours, theirs in (("rank", "RANK"), ("world_size", "WORLD_SIZE")):  # a stale export from another launcher
        if theirs in env and _int(env, theirs) != getattr(launch, ours):
            raise LaunchError(f"SLURM says {ours.replace('_', ' ')} {getattr(launch, ours)} but {theirs}="
                              f"{env[theirs]}: unset {theirs}, or launch with torchrun instead of srun")
    return launch


def _check(launch: Launch, names: dict) -> None:
    problems: List[str] = []
    if launch.world_size < 1:
        problems.append(f"{names['world']}={launch.world_size} must be at least 1")
    elif not 0 <= launch.rank < launch.world_size:
        problems.append(f"{names['rank']}={launch.rank} is not below {names['world']}={launch.world_size}")
    if launch.local_rank > launch.rank:
        problems.append(f"{names['local']}={launch.local_rank} exceeds {names['rank']}={launch.rank}")
    if "nnodes" in names and not 0 <= launch.node_rank < launch.nnodes:
        problems.append(f"{names['node']}={launch.node_rank} is not below {names['nnodes']}={launch.nnodes}")
    if launch.nnodes > launch.world_size >= 1:
        problems.append(f"{launch.nnodes} nodes for {launch.world_size} ranks")
    if problems:
        raise LaunchError(f"the {launch.launcher} variables contradict one another: {'; '.join(problems)}")


def detect(env: Mapping[str, str] = os.environ) -> Optional[Launch]:
    """This process's place in a launched job, or None when no launcher started it."""
    if "TORCHELASTIC_RUN_ID" in env:
        return _torchrun(env, "torchrun")
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return _slurm(env)  # a task of an srun step (a batch script itself is no step: it spawns here)
    if "RANK" in env or "WORLD_SIZE" in env:
        return _torchrun(env, "env")
    return None


def reporter(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process speaks for the job: rank 0 of a launched job, or the process that
    spawns its ranks itself. (No checks: ``detect`` raises on a bad environment.)"""
    try:
        launch = detect(env)
    except LaunchError:
        return True  # the error itself must be shown
    return launch is None or launch.rank == 0

"""Distributed checkpoints with megatron.core.dist_checkpointing (torch_dist format).

A checkpoint holds every model chunk's ``sharded_state_dict`` (global layer indices, TP shards
described by offsets), the optimizer's state sharded against it (the distributed optimizer in
its fully reshardable form), the LR scheduler and the step. Loading builds the same sharded
description for the *current* layout and lets dist_checkpointing fetch the matching slices,
so a checkpoint saved at TP2 x PP2 loads at TP1 x PP1 and the reverse.

Layout on disk: ``<dir>/step_<N>/`` per checkpoint and ``<dir>/latest`` naming the newest.

The run is deterministic without RNG state (no dropout; the data is a function of the step),
so no RNG state is stored.

On CPU the torch_dist writer hangs when psutil is missing (its worker calls a memory probe
outside its try block, dies, and the parent waits forever); psutil is a dependency, and
``require_psutil`` turns its absence into an error instead of a hang.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

LATEST = "latest"


def require_psutil() -> None:
    try:
        import psutil  # noqa: F401
    except ImportError as error:
        raise RuntimeError(
            "megatron.core.dist_checkpointing's torch_dist writer hangs without psutil: "
            "pip install psutil"
        ) from error


def _metadata(trainer) -> dict:
    from megatron.core import parallel_state

    metadata = {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }
    if trainer.args.distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "fully_reshardable"
    return metadata


def _models(trainer):
    """(key, module) per chunk, inside the DDP wrapper as Megatron-LM checkpoints them."""
    return [("model" if len(trainer.model) == 1 else f"model{i}", chunk.module)
            for i, chunk in enumerate(trainer.model)]


def sharded_state_dict(trainer, is_loading: bool) -> dict:
    metadata = _metadata(trainer)
    state = {key: module.sharded_state_dict(metadata=metadata) for key, module in _models(trainer)}
    state["optimizer"] = trainer.optimizer.sharded_state_dict(
        state, is_loading=is_loading, metadata=metadata
    )
    state["scheduler"] = trainer.scheduler.state_dict()
    state["step"] = trainer.step
    return state


def save(trainer, directory: str) -> str:
    """Save the trainer's state under ``directory/step_<N>`` and point ``latest`` at it."""
    from megatron.core import dist_checkpointing

    require_psutil()
    path = os.path.join(directory, f"step_{trainer.step}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(sharded_state_dict(trainer, is_loading=False), path)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(directory, LATEST), "w") as out:
            out.write(f"step_{trainer.step}\n")
    torch.distributed.barrier()
    return path


def resolve(path: str) -> str:
    """A checkpoint directory: ``path`` itself, or the one ``path/latest`` names."""
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(path, f.read().strip())
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    raise FileNotFoundError(f"no checkpoint at {path} (neither a {LATEST} file nor metadata.json)")


def load(trainer, path: str) -> int:
    """Load into the trainer's current layout; returns the checkpoint's step."""
    from megatron.core import dist_checkpointing

    checkpoint = resolve(path)
    loaded = dist_checkpointing.load(sharded_state_dict(trainer, is_loading=True), checkpoint)
    for key, module in _models(trainer):
        module.load_state_dict(loaded[key])
    trainer.optimizer.load_state_dict(loaded["optimizer"])
    trainer.scheduler.load_state_dict(loaded["scheduler"])
    trainer.step = int(loaded["step"])
    return trainer.step


def latest_step(directory: str) -> Optional[int]:
    try:
        return int(os.path.basename(resolve(directory)).split("_")[-1])
    except (FileNotFoundError, ValueError):
        return None

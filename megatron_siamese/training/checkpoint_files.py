"""Checkpoint directories on disk: which steps are complete, what is wrong with a broken one.

Layout: Megatron-LM's, so that checkpoints move both ways between this trainer and
Megatron-LM's ``pretrain_gpt.py``: ``<dir>/iter_<N, 7 digits>/`` per checkpoint (Megatron's
torch_dist format: ``metadata.json``, torch's ``.metadata`` and ``*.distcp`` shards, and up to
megatron-core 0.18 ``common.pt``; from 0.19 the common state is a shard too) and
``<dir>/latest_checkpointed_iteration.txt`` holding the newest complete one's iteration. The
tracker is written only after every rank finished saving, and atomically (a rename), so it never
names a partial checkpoint.

Checkpoints of earlier releases (``<dir>/step_<N>/`` and ``<dir>/latest`` naming one) are still
read: ``resolve`` follows either tracker, and their common state is read in today's keys
(``in_megatron_keys``).

Everything here runs in the launching process before any rank starts (torch and Megatron's
checkpoint reader are imported only to read a checkpoint's metadata and common state), so a
checkpoint that cannot load is reported naming the file, what is wrong with it, and the
complete steps to load instead.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from argparse import Namespace
from typing import List, Optional, Tuple

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's: the newest complete iteration
ITER_DIR = re.compile(r"^iter_(\d{7,})$")  # Megatron-LM's get_checkpoint_name: iter_{:07d}
LATEST = "latest"  # earlier releases' tracker: the name of the newest complete step_<N>
STEP_DIR = re.compile(r"^step_(\d+)$")  # earlier releases' checkpoint directories
# torch's .metadata is written last, when every rank's shards are on disk
REQUIRED_FILES = ("metadata.json", ".metadata")
LEGACY_COMMON = "common.pt"  # megatron-core < 0.19 keeps the common state here


def iteration_dir(step: int) -> str:
    """The directory name Megatron-LM gives the checkpoint of iteration ``step``."""
    return f"iter_{step:07d}"


def _step_of(name: str) -> Optional[int]:
    match = ITER_DIR.match(name) or STEP_DIR.match(name)
    return int(match.group(1)) if match else None


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what to do instead."""


def step_dirs(directory: str) -> List[Tuple[int, str]]:
    """(step, path) of every checkpoint directory (``iter_<N>``, or an earlier release's
    ``step_<N>``), oldest first."""
    if not os.path.isdir(directory):
        return []
    found = [(step, os.path.join(directory, name))
             for name in os.listdir(directory) if (step := _step_of(name)) is not None]
    return sorted(found)


def missing_files(path: str) -> List[str]:
    return [name for name in REQUIRED_FILES if not os.path.isfile(os.path.join(path, name))]


def complete_steps(directory: str) -> List[int]:
    return [step for step, path in step_dirs(directory) if not missing_files(path)]


def write_latest(directory: str, step: int) -> None:
    """Record ``step`` as the newest complete checkpoint in Megatron-LM's tracker file: a new
    file renamed over the old, never half written."""
    tmp = os.path.join(directory, f".{TRACKER}.tmp")
    with open(tmp, "w") as out:
        out.write(str(step))
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, os.path.join(directory, TRACKER))


def trackers(directory: str) -> List[str]:
    """The tracker files in a checkpoints directory (today's and an earlier release's)."""
    return [path for name in (TRACKER, LATEST) if os.path.isfile(path := os.path.join(directory, name))]


def _instead(directory: str, exclude: Optional[str] = None) -> str:
    names = [os.path.basename(path) for _, path in step_dirs(directory)
             if not missing_files(path) and path != exclude]
    if not names:
        return f"there is no complete checkpoint in {directory}"
    return f"complete checkpoints in {directory}: {', '.join(names)} (pass one to --load)"


def _tracked(path: str) -> Optional[str]:
    """The checkpoint directory a tracker in ``path`` names (Megatron-LM's, else an earlier
    release's ``latest``); None without a tracker."""
    tracker, latest = os.path.join(path, TRACKER), os.path.join(path, LATEST)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        if text == "release":  # Megatron-LM's name for a converted, step-less checkpoint
            name = "release"
        elif text.isdigit():
            name = iteration_dir(int(text))
        else:
            raise CheckpointError(f"{tracker} holds {text!r}, not an iteration; {_instead(path)}")
        if not os.path.isdir(os.path.join(path, name)):
            raise CheckpointError(f"{tracker} names iteration {text}, but there is no {os.path.join(path, name)}; "
                                  f"{_instead(path)}")
        return os.path.join(path, name)
    if os.path.isfile(latest):
        with open(latest) as f:
            name = f.read().strip()
        target = os.path.join(path, name)
        if _step_of(name) is None or not os.path.isdir(target):
            raise CheckpointError(f"{latest} names {name!r}, which is not a checkpoint directory here; {_instead(path)}")
        return target
    return None


def resolve(path: str) -> str:
    """The checkpoint ``path`` names: itself, or the one its tracker file names."""
    if not os.path.exists(path):
        raise CheckpointError(f"--load {path}: no such file or directory")
    tracked = _tracked(path)
    if tracked:
        return tracked
    if os.path.isfile(os.path.join(path, "metadata.json")) or _step_of(os.path.basename(os.path.normpath(path))) is not None:
        return path
    raise CheckpointError(f"--load {path} is not a checkpoint: it has neither a `{TRACKER}` file nor metadata.json "
                          "(give a checkpoints directory or one iter_<N> inside it)")


def problems(checkpoint: str) -> List[str]:
    """What keeps ``checkpoint`` from loading (empty: it looks sound)."""
    missing = missing_files(checkpoint)
    if missing:
        return [f"{os.path.join(checkpoint, missing[0])} is missing: the save did not finish"]
    found = []
    meta = os.path.join(checkpoint, "metadata.json")
    try:
        with open(meta) as f:
            json.load(f)
    except (OSError, ValueError) as error:
        found.append(f"{meta} is not valid JSON ({error})")
    found += _shard_problems(checkpoint)
    common = os.path.join(checkpoint, LEGACY_COMMON)
    if os.path.exists(common):
        found += _common_problems(common)
    elif not found:  # megatron-core >= 0.19: the common state is one of the shards
        try:
            common_state(checkpoint)
        except Exception as error:
            found.append(f"{checkpoint}: its common state cannot be read ({type(error).__name__}: {error})")
    return found


def _common_problems(common: str) -> List[str]:
    import torch

    if os.path.getsize(common) == 0:
        return [f"{common} is empty"]
    try:
        torch.load(common, map_location="cpu", weights_only=False)
    except Exception as error:  # truncated zip, garbage: torch raises several kinds
        return [f"{common} cannot be read ({type(error).__name__}: {error})"]
    return []


def _shard_problems(checkpoint: str) -> List[str]:
    """torch's .metadata must unpickle, and every shard file must hold the bytes it lists."""
    from torch.distributed.checkpoint import FileSystemReader

    index = os.path.join(checkpoint, ".metadata")
    try:
        metadata = FileSystemReader(checkpoint).read_metadata()
    except Exception as error:
        return [f"{index} cannot be read ({type(error).__name__}: {error})"]
    needed = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    found = []
    for name, size in sorted(needed.items()):
        path = os.path.join(checkpoint, name)
        if not os.path.isfile(path):
            found.append(f"{path} is missing")
        elif os.path.getsize(path) < size:
            found.append(f"{path} is truncated ({os.path.getsize(path)} of {size} bytes)")
    return found


def checked(path: str) -> str:
    """The checkpoint ``path`` names, verified; CheckpointError naming the file and the
    complete steps to load instead (never a silent fall-back to another step)."""
    checkpoint = resolve(path)
    found = problems(checkpoint)
    if found:
        directory = os.path.dirname(os.path.normpath(checkpoint))
        raise CheckpointError(f"cannot load {checkpoint}: {found[0]}; {_instead(directory, exclude=checkpoint)}")
    return checkpoint


MODEL_CLASS = "model_class"  # common state: "gpt" (GPTModel) or "hybrid" (HybridModel); absent = "gpt"
# Megatron-LM's common state, which ``checkpoint.save`` writes: "args" (an argparse.Namespace
# with Megatron-LM's argument names), "checkpoint_version", "iteration", "opt_param_scheduler"
# (its step counts in samples, as Megatron-LM's training loop steps it), "optimizer",
# "num_floating_point_operations_so_far". Earlier releases wrote these instead:
LEGACY_STEP, LEGACY_SCHEDULER = "step", "scheduler"  # the scheduler's counts in optimizer steps
LEGACY_MODEL_ONLY = "model_only"  # today: args.no_save_optim, Megatron-LM's flag
_SCHEDULER_COUNTS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")


def iteration(common: dict) -> int:
    """The step a checkpoint with this common state was saved at."""
    return int(common.get("iteration", common.get(LEGACY_STEP, 0)))


def saved_args(common: dict) -> Namespace:
    """The checkpoint's run arguments (Megatron-LM's names; empty for an earlier release's)."""
    return common.get("args") or Namespace()


def model_only(common: dict) -> bool:
    """Whether the checkpoint holds no optimizer state (``--no-save-optim`` in Megatron-LM)."""
    return bool(getattr(saved_args(common), "no_save_optim", False) or common.get(LEGACY_MODEL_ONLY, False))


def scheduler_state(common: dict, global_batch_size: int) -> Optional[dict]:
    """The checkpoint's OptimizerParamScheduler state in Megatron-LM's units (samples), or None.

    An earlier release counted the scheduler in optimizer steps and did not record its batch
    size: its counts are taken as this run's ``global_batch_size`` samples per step, which keeps
    its learning rate at every step (the resumed run's batch size, as it was, or as now set)."""
    if "opt_param_scheduler" in common:
        return common["opt_param_scheduler"]
    legacy = common.get(LEGACY_SCHEDULER)
    if legacy is None:
        return None
    return {**legacy, **{key: legacy[key] * global_batch_size for key in _SCHEDULER_COUNTS if key in legacy}}


def brings_training_state(common: dict, model: str) -> bool:
    """Whether loading a checkpoint with this common state into a ``model`` run restores its
    optimizer and schedule (else only weights load: a model-only checkpoint, or a GPTModel's
    weights translated into a HybridModel)."""
    return not model_only(common) and common.get(MODEL_CLASS, "gpt") == model


def common_state(checkpoint: str) -> dict:
    """The checkpoint's non-sharded entries (args, iteration, scheduler, model class, ...), from
    either torch_dist format (Megatron's own reader)."""
    from megatron.core import dist_checkpointing

    with warnings.catch_warnings():  # reading it in one process, without torch.distributed, is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return dist_checkpointing.load_common_state_dict(checkpoint)

"""Checkpoint directories on disk: which steps are complete, what is wrong with a broken one.

Megatron-LM's layout (``<dir>/iter_0000010/``, ``<dir>/latest_checkpointed_iteration.txt``, written
atomically once every rank saved, so it never names a partial checkpoint); earlier releases'
``step_<N>/`` and ``latest`` are still read. Runs in the launching process before any rank starts, so
a checkpoint that cannot load is reported naming the file, what is wrong, and the steps to load instead.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from argparse import Namespace
from typing import List, Optional, Tuple

from megatron_siamese.versions import installed_megatron_core, release

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


def step_of(name: str) -> Optional[int]:
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
             for name in os.listdir(directory) if (step := step_of(name)) is not None]
    return sorted(found)


def missing_files(path: str) -> List[str]:
    return [name for name in REQUIRED_FILES if not os.path.isfile(os.path.join(path, name))]


def write_latest(directory: str, step: int) -> None:
    """Record ``step`` as the newest complete checkpoint in Megatron-LM's tracker file: a new
    file renamed over the old, never half written."""
    tmp = os.path.join(directory, f".{TRACKER}.tmp")
    with open(tmp, "w") as out:
        out.write(str(step))
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, os.path.join(directory, TRACKER))


def complete_dirs(directory: str, exclude: Optional[str] = None) -> List[str]:
    """The names of ``directory``'s complete checkpoints, oldest first."""
    return [os.path.basename(path) for _, path in step_dirs(directory) if not missing_files(path) and path != exclude]


def complete_in(directory: str, exclude: Optional[str] = None) -> str:
    names = complete_dirs(directory, exclude)
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
            raise CheckpointError(f"{tracker} holds {text!r}, not an iteration; {complete_in(path)}")
        if not os.path.isdir(os.path.join(path, name)):
            raise CheckpointError(f"{tracker} names iteration {text}, but there is no {os.path.join(path, name)}; "
                                  f"{complete_in(path)}")
        return os.path.join(path, name)
    if os.path.isfile(latest):
        with open(latest) as f:
            name = f.read().strip()
        target = os.path.join(path, name)
        if step_of(name) is None or not os.path.isdir(target):
            raise CheckpointError(f"{latest} names {name!r}, which is not a checkpoint directory here; {complete_in(path)}")
        return target
    return None


RUN_CHECKPOINTS = "checkpoints"  # where a run's directory (scripts/run.sh's runs/<time>) keeps its checkpoints


def resolve(path: str) -> str:
    """The checkpoint ``path`` names: itself, the one its tracker file names, or, for a run's
    directory (what ``--output-dir`` made), the one its checkpoints' tracker names."""
    if not os.path.exists(path):
        raise CheckpointError(f"--load {path}: no such file or directory")
    run_checkpoints = os.path.join(path, RUN_CHECKPOINTS)
    if not os.path.isfile(os.path.join(path, TRACKER)) and os.path.isdir(run_checkpoints):
        return resolve(run_checkpoints)
    tracked = _tracked(path)
    if tracked:
        return tracked
    if os.path.isfile(os.path.join(path, "metadata.json")) or step_of(os.path.basename(os.path.normpath(path))) is not None:
        return path
    saved = step_dirs(path)
    if saved:  # no save recorded: it never finished, or the job stopped before recording it
        incomplete = [os.path.basename(p) for _, p in saved if missing_files(p)]
        if len(incomplete) == len(saved):
            raise CheckpointError(f"--load {path} has no complete checkpoint ({', '.join(incomplete)}: a save that "
                                  f"did not finish) and no `{TRACKER}`; {complete_in(path)}: start without --load")
        raise CheckpointError(f"--load {path} records no checkpoint (no `{TRACKER}`: the job stopped before its "
                              f"last save was recorded); {complete_in(path)}")
    if os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(f"--load {path} is a Transformers model directory, not a checkpoint: `megatron-siamese "
                              f"import-hf --hf {path} --output-dir DIR` makes one of it (eval reads it as --hf)")
    raise CheckpointError(f"--load {path} is not a checkpoint: it has neither a `{TRACKER}` file nor metadata.json "
                          "(give a run's directory, its checkpoints directory or one iter_<N> inside it)")


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` names a checkpoint (a directory given where another kind was asked for: said so)."""
    try:
        resolve(path)
        return True
    except CheckpointError:
        return False


class ReleaseProblem(str):
    """A problem of the megatron-core reading a checkpoint, not of the checkpoint: the steps beside it are
    no way out."""


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
    shards, common_shard = _shard_problems(checkpoint)
    found += shards
    common = os.path.join(checkpoint, LEGACY_COMMON)
    if os.path.exists(common):
        found += _common_problems(common)
    elif not common_shard and not found:  # written by megatron-core < 0.19: the common state is common.pt
        found.append(f"{common} is missing")
    elif not found and release(installed_megatron_core()) < (0, 19):  # its args hold classes 0.19 added
        found.append(ReleaseProblem(
            f"{checkpoint} was written by megatron-core >= 0.19 (its common state is one of the shards), which "
            f"megatron-core {installed_megatron_core()} cannot read: run this command with 0.19 (bash "
            "scripts/setup.sh mcore019: .venv-mcore019/bin/megatron-siamese), or export the model there and "
            "import-hf it here"))
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


COMMON_SHARD = "common_state"  # megatron-core >= 0.19: the common state's key in torch's .metadata
# checkpoints up to this size have every byte checked before any rank starts (larger ones: only
# the sizes and headers; their items are checked when a load fails)
VERIFIED_BYTES = 2 * 2**30
ZIP_MAGIC = b"PK\x03\x04"  # every item of a shard file is a torch.save archive, a zip


def _read_metadata(checkpoint: str):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(checkpoint).read_metadata()


def _shard_problems(checkpoint: str) -> Tuple[List[str], bool]:
    """torch's .metadata must unpickle and every shard file hold the bytes it lists, each item starting
    as a torch.save archive does (a cheap look); also whether the common state is one of the shards."""
    index = os.path.join(checkpoint, ".metadata")
    try:
        metadata = _read_metadata(checkpoint)
    except Exception as error:
        return [f"{index} cannot be read ({type(error).__name__}: {error})"], False
    common_shard = any(str(key).startswith(COMMON_SHARD) for key in metadata.state_dict_metadata)
    items = {}
    for info in (metadata.storage_data or {}).values():
        items.setdefault(info.relative_path, []).append(info)
    found = []
    for name, infos in sorted(items.items()):
        path = os.path.join(checkpoint, name)
        size = max(info.offset + info.length for info in infos)
        if not os.path.isfile(path):
            found.append(f"{path} is missing")
        elif os.path.getsize(path) < size:
            found.append(f"{path} is truncated ({os.path.getsize(path)} of {size} bytes)")
        elif not _items_start_as_archives(path, infos):
            found.append(f"{path} is corrupt (its contents are not the tensors .metadata lists)")
    if not found and sum(info.length for info in (metadata.storage_data or {}).values()) <= VERIFIED_BYTES:
        found += [f"{path} is corrupt (an item in it fails its CRC-32)" for path in damaged_shards(checkpoint)[:1]]
    return found, common_shard


def _items_start_as_archives(path: str, infos) -> bool:
    with open(path, "rb") as shard:
        for info in infos:
            if info.transform_descriptors:  # compressed or otherwise transformed: not looked into
                continue
            shard.seek(info.offset)
            if shard.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
                return False
    return True


def damaged_shards(checkpoint: str) -> List[str]:
    """The shard files holding an item whose bytes fail its own CRC-32 (torch's loader does not check
    them: damage would load as wrong numbers). Reads every byte."""
    import io
    import zipfile

    metadata = _read_metadata(checkpoint)
    damaged = []
    for info in (metadata.storage_data or {}).values():
        path = os.path.join(checkpoint, info.relative_path)
        if path in damaged or info.transform_descriptors:
            continue
        try:
            with open(path, "rb") as shard:
                shard.seek(info.offset)
                with zipfile.ZipFile(io.BytesIO(shard.read(info.length))) as item:
                    bad = item.testzip()
        except (OSError, zipfile.BadZipFile, ValueError, EOFError):
            bad = True
        if bad:
            damaged.append(path)
    return sorted(damaged)


def instead(checkpoint: str) -> str:
    """What to load instead of the broken ``checkpoint``: the other complete steps beside it."""
    return complete_in(os.path.dirname(os.path.normpath(checkpoint)), exclude=checkpoint)


def holds_no_checkpoint(directory: str) -> bool:
    """Whether ``directory`` holds no complete checkpoint (it may not exist): a requeued job's first
    ``--load`` of its ``--save`` directory starts from step 0, as Megatron-LM's does."""
    if not os.path.isdir(directory):
        return True
    tracker = os.path.isfile(os.path.join(directory, TRACKER)) or os.path.isfile(os.path.join(directory, LATEST))
    return not tracker and all(missing_files(path) for _, path in step_dirs(directory))


def checked(path: str) -> str:
    """The checkpoint ``path`` names, verified; CheckpointError naming the file and the
    complete steps to load instead (never a silent fall-back to another step)."""
    checkpoint = resolve(path)
    found = problems(checkpoint)
    if found:
        way_out = "" if isinstance(found[0], ReleaseProblem) else f"; {instead(checkpoint)}"
        raise CheckpointError(f"cannot load {checkpoint}: {found[0]}{way_out}")
    return checkpoint


MODEL_CLASS = "model_class"  # common state: "gpt" (GPTModel) or "hybrid" (HybridModel); see model_class()
# Megatron-LM's common state has "args", "checkpoint_version", "iteration", "opt_param_scheduler", "optimizer", ...;
# earlier releases wrote the step under this key instead:
LEGACY_STEP = "step"


def iteration(common: dict) -> int:
    """The step a checkpoint with this common state was saved at."""
    return int(common.get("iteration", common.get(LEGACY_STEP, 0)))


def saved_args(common: dict) -> Namespace:
    """The checkpoint's run arguments (Megatron-LM's names; empty for an earlier release's)."""
    return common.get("args") or Namespace()


def model_class(common: dict) -> str:
    """"gpt" or "hybrid": what ``checkpoint.save_model`` recorded, else what Megatron-LM's loader reads
    (a layer pattern in the args; hybrid_override_pattern before megatron-core 0.19)."""
    if MODEL_CLASS in common:
        return common[MODEL_CLASS]
    args = saved_args(common)
    pattern = getattr(args, "hybrid_layer_pattern", None) or getattr(args, "hybrid_override_pattern", None)
    return "hybrid" if pattern else "gpt"


def common_state(checkpoint: str) -> dict:
    """The checkpoint's non-sharded entries (args, iteration, scheduler, model class, ...), from
    either torch_dist format (Megatron's own reader)."""
    from megatron.core import dist_checkpointing

    with warnings.catch_warnings():  # reading it in one process, without torch.distributed, is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return dist_checkpointing.load_common_state_dict(checkpoint)

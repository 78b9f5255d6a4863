"""The run's output directory, held and checked before the first rank starts, and cleaned after
a stop at once, by the process that speaks for the run (the launcher, or rank 0 of a launched job)."""

from __future__ import annotations

import os
import shutil
from typing import Optional

import torch

from megatron_siamese.runtime import job, job_lock
from megatron_siamese.training.args import ConfigError, TrainArgs


def checked_before_start(args: TrainArgs) -> Optional[job_lock.Lock]:
    """The output directory locked for this job and the preflight checks: by the process that
    speaks for the job (a spawned job's launcher, or rank 0 of a launched one, which then tells
    the others). Returns the lock (held by that process, for the whole run: release it at the
    end). --overwrite removes the old checkpoints at the first save (``checkpoint.save``), not
    here: a run that saves none keeps them."""
    from megatron_siamese.training.preflight import preflight

    in_job = job.joined() is not None
    speaks = not in_job or torch.distributed.get_rank() == 0
    lock, problems = None, []
    if speaks:
        try:
            lock = job_lock.hold(args.output_dir)
            problems = preflight(args)
        except job_lock.InUse as error:  # before the other checks: they would judge a run in progress
            problems = [str(error)]
    if in_job:
        shared = [problems]
        torch.distributed.broadcast_object_list(shared, src=0)
        problems = shared[0]
    if problems:
        if lock is not None:
            lock.abandon()  # a refused run leaves nothing behind, not even the directory it asked for
        raise ConfigError(problems)
    if in_job:
        torch.distributed.barrier()
    return lock


def unfinished_checkpoints_removed(directory: str, before: set) -> None:
    """After a stop at once: the checkpoints this run was writing are removed, those newer than
    the one the tracker file names (it moves to each only once it is complete; --async-save may
    have several in flight): a half-written checkpoint must not stand in the next run's way."""
    from megatron_siamese.training import checkpoint_files

    steps = checkpoint_files.step_dirs(directory)
    try:
        named = os.path.realpath(checkpoint_files.resolve(directory))
        tracked = next((step for step, path in steps if os.path.realpath(path) == named), None)
    except checkpoint_files.CheckpointError:
        tracked = None
    for step, path in steps:
        if path not in before and (tracked is None or step > tracked):
            shutil.rmtree(path, ignore_errors=True)


def existing_checkpoints(args: TrainArgs) -> set:
    from megatron_siamese.training import checkpoint_files
    from megatron_siamese.training.preflight import checkpoint_dir

    return {path for _, path in checkpoint_files.step_dirs(checkpoint_dir(args))}

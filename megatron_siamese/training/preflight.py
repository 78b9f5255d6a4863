"""What a run needs from this machine and its files, checked before any rank starts.

``TrainArgs`` already refused impossible settings (``args.py``). Here: Transformer Engine
when asked for, the checkpoint to resume from (complete and readable, its schedule the
run's unless one of the two scheduler flags says which wins), and the output directory (never
silently mixed with another run's checkpoints). Each problem is one line saying what to change.
"""

from __future__ import annotations

import os
import shutil
from typing import List

from megatron_siamese.training import checkpoint_files, scalar_loggers
from megatron_siamese.training.args import TrainArgs
from megatron_siamese.training.data_checks import data_problems

# what the schedule of a resumed run is compared on: checkpoint key, the run's value, its flag, and
# the key's unit in the run's (the scheduler counts samples, as Megatron-LM's does; flags count steps)
_SCHEDULE = (("max_lr", lambda a: a.lr, "--lr", lambda a: 1), ("min_lr", lambda a: a.min_lr, "--min-lr", lambda a: 1),
             ("lr_warmup_steps", lambda a: a.warmup, "--lr-warmup-iters", lambda a: a.global_batch_size),
             ("lr_decay_steps", lambda a: a.steps, "--train-iters", lambda a: a.global_batch_size),
             ("start_wd", lambda a: a.weight_decay, "--weight-decay", lambda a: 1))


def checkpoint_dir(args: TrainArgs) -> str:
    return os.path.join(args.output_dir, "checkpoints")


def _schedule_problems(args: TrainArgs, checkpoint: str) -> List[str]:
    common = checkpoint_files.common_state(checkpoint)
    scheduler = checkpoint_files.scheduler_state(common, args.global_batch_size)
    step = checkpoint_files.iteration(common)
    if scheduler is None or step >= args.steps:  # no schedule saved, or evaluating the checkpoint as saved
        return []
    if not checkpoint_files.brings_training_state(common, args.model):  # weights only: this run's schedule
        return []
    if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return []
    differ = [f"{flag} {value(args):g} (checkpoint: {scheduler[key] / unit(args):g})"
              for key, value, flag, unit in _SCHEDULE if key in scheduler
              and abs(float(scheduler[key]) - float(value(args) * unit(args))) > 1e-12 * max(1.0, abs(value(args) * unit(args)))]
    if not differ:
        return []
    return [f"resuming {checkpoint} with another schedule: {', '.join(differ)}; pass --override-opt_param-scheduler "
            "to train with these settings, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's"]


def _output_problems(args: TrainArgs) -> List[str]:
    directory = checkpoint_dir(args)
    existing = checkpoint_files.step_dirs(directory)
    if not existing or args.overwrite:
        return []
    if args.load:
        resumed = os.path.dirname(os.path.normpath(checkpoint_files.resolve(args.load)))
        if os.path.realpath(resumed) == os.path.realpath(directory):
            return []  # resuming: new checkpoints continue the same run
    steps = ", ".join(os.path.basename(path) for _, path in existing)
    return [f"--output-dir {args.output_dir} already holds another run's checkpoints ({steps}): resume it with "
            f"--load {directory}, choose another --output-dir, or pass --overwrite to replace them"]


def preflight(args: TrainArgs) -> List[str]:
    """Every problem that keeps ``args`` from running here (empty: none)."""
    found: List[str] = []
    if args.transformer_impl == "transformer_engine" or args.fp8:
        from megatron_siamese import te

        reason = te.unavailable_reason()
        if reason:
            found.append(f"--transformer-impl transformer_engine: {reason}; use --transformer-impl local")
    if args.load:
        try:
            checkpoint = checkpoint_files.checked(args.load)
            found += _schedule_problems(args, checkpoint)
        except checkpoint_files.CheckpointError as error:
            found.append(str(error))
    try:
        found += _output_problems(args)
    except checkpoint_files.CheckpointError:
        pass  # the --load problem is reported above
    found += data_problems(args)  # a user's --data-prefix: its files, size and token ids
    found += scalar_loggers.missing_packages(args)  # --tensorboard-dir, --wandb-project
    return found


def clear_for_overwrite(args: TrainArgs) -> List[str]:
    """With --overwrite: remove the output directory's old checkpoints (so none mixes with the
    new run's); returns what was removed."""
    directory = checkpoint_dir(args)
    removed = [path for _, path in checkpoint_files.step_dirs(directory)]
    if not args.overwrite or not removed:
        return []
    for path in removed:
        shutil.rmtree(path)
    for tracker in checkpoint_files.trackers(directory):
        os.remove(tracker)
    return removed

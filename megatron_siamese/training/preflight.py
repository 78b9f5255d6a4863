"""What a run needs from this machine and its files, checked before any rank starts.

``TrainArgs`` already refused impossible settings (``args.py``). Here: Transformer Engine
when asked for, the checkpoint to resume from (complete and readable, the same model, an
optimizer state that can follow the layout: ``checkpoint_settings.py``; its schedule the run's
unless one of the two scheduler flags says which wins), and the output directory (a run that
may save never mixes its checkpoints with another run's). Each problem is one line saying
what to change.
"""

from __future__ import annotations

import os
import shutil
from typing import List, Optional

from megatron_siamese.training import checkpoint_files, checkpoint_settings, scalar_loggers
from megatron_siamese.training.args import TrainArgs
from megatron_siamese.training.data_checks import data_problems

# what the schedule of a resumed run is compared on: checkpoint key, the run's value, its flag, and
# the key's unit in the run's (the scheduler counts samples, as Megatron-LM's does; flags count steps)
_SCHEDULE = (("max_lr", lambda a: a.lr, "--lr", lambda a: 1), ("min_lr", lambda a: a.min_lr, "--min-lr", lambda a: 1),
             ("lr_warmup_steps", lambda a: a.warmup, "--lr-warmup-iters", lambda a: a.global_batch_size),
             ("lr_decay_steps", lambda a: a.steps, "--train-iters", lambda a: a.global_batch_size),
             ("start_wd", lambda a: a.weight_decay, "--weight-decay", lambda a: 1))


def checkpoint_dir(args: TrainArgs) -> str:
    """Where the run saves: --save, else OUTPUT_DIR/checkpoints."""
    return args.save or os.path.join(args.output_dir, checkpoint_files.RUN_CHECKPOINTS)


def resume_hint(args: TrainArgs, load: Optional[str]) -> str:
    """After a lost rank: the newest complete checkpoint the run saved, and how to go on from it.
    ``load`` is the command's --load (the same command resumes where it loads what it saves:
    Megatron-LM's --save X --load X)."""
    directory = checkpoint_dir(args)
    steps = checkpoint_files.complete_steps(directory)
    if not steps:
        return ""
    same = load is not None and os.path.realpath(load) == os.path.realpath(directory)
    how = "the same command resumes from it" if same else f"add --load {directory} to resume from it"
    return f"; the newest complete checkpoint is step {max(steps)} in {directory}: {how}"


def loads_its_empty_save_directory(args: TrainArgs) -> bool:
    """``--load X --save X`` (a requeued job's flags) before the job's first save: X holds no
    checkpoint yet, so the run starts from step 0 (any other --load without a checkpoint is an error)."""
    return (args.load is not None and args.save is not None
            and os.path.realpath(args.load) == os.path.realpath(args.save)
            and checkpoint_files.holds_no_checkpoint(args.load))


def _resume_problems(args: TrainArgs, checkpoint: str) -> List[str]:
    """The checkpoint's model must be this run's (else nothing else matters); its optimizer state
    must follow the layout, its schedule be this run's (or a flag say which wins)."""
    common = checkpoint_files.common_state(checkpoint)
    refused = checkpoint_settings.model_problem(checkpoint, common, args)
    if refused:
        return [refused]
    found = [checkpoint_settings.optimizer_problem(checkpoint, common, args)]
    return [problem for problem in found if problem] + _schedule_problems(args, checkpoint, common)


def _schedule_problems(args: TrainArgs, checkpoint: str, common: dict) -> List[str]:
    scheduler = checkpoint_files.scheduler_state(common, args.global_batch_size)
    step = checkpoint_files.iteration(common)
    if scheduler is None or step >= args.steps:  # no schedule saved, or evaluating the checkpoint as saved
        return []
    if args.no_load_optim or not checkpoint_files.brings_training_state(common, args.model):
        return []  # weights only: this run's schedule
    if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return []
    differ = [f"{flag} {value(args):g} (checkpoint: {scheduler[key] / unit(args):g})"
              for key, value, flag, unit in _SCHEDULE if key in scheduler
              and abs(float(scheduler[key]) - float(value(args) * unit(args))) > 1e-12 * max(1.0, abs(value(args) * unit(args)))]
    if not differ:
        return []
    return [f"resuming {checkpoint} with another schedule: {', '.join(differ)}; pass --override-opt_param-scheduler "
            "to train with these settings, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's"]


def may_save(args: TrainArgs) -> bool:
    """Whether the run plans a checkpoint (a signal's stop checkpoint aside: ``foreign_checkpoints``):
    at its last step, and every --save-interval steps. --save alone is one at the end, as
    Megatron-LM saves at the end of training whenever --save is given."""
    return bool(args.save_interval or args.stop_step or args.save)


def foreign_checkpoints(args: TrainArgs) -> List[str]:
    """The complete checkpoints in the output directory that are another run's: none with
    --overwrite (they are replaced at this run's first save) or when this run resumes from that
    directory. Incomplete ones (a save that never finished) are nobody's: a save replaces them."""
    directory = checkpoint_dir(args)
    existing = [os.path.basename(path) for _, path in checkpoint_files.step_dirs(directory)
                if not checkpoint_files.missing_files(path)]
    if not existing or args.overwrite or _resumes_from(args, directory):
        return []  # resuming: new checkpoints continue the same run
    return existing


def _resumes_from(args: TrainArgs, directory: str) -> bool:
    if not args.load:
        return False
    try:
        resumed = os.path.dirname(os.path.normpath(checkpoint_files.resolve(args.load)))
    except checkpoint_files.CheckpointError:
        return False  # the --load problem is reported by itself
    return os.path.realpath(resumed) == os.path.realpath(directory)


def _output_problems(args: TrainArgs) -> List[str]:
    """A run that may save must not mix its checkpoints with another run's. One that plans none
    is not refused; if a signal stops it, it does not save there either (trainer.py)."""
    existing = foreign_checkpoints(args)
    if not existing or not may_save(args):
        return []
    where = f"--save {args.save}" if args.save else f"--output-dir {args.output_dir}"
    return [f"{where} already holds another run's checkpoints ({', '.join(existing)}): resume "
            f"it with --load {checkpoint_dir(args)}, choose another {where.split()[0]}, or pass --overwrite to replace "
            "them (at this run's first save)"]


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
            found += _resume_problems(args, checkpoint)
        except checkpoint_files.CheckpointError as error:
            found.append(str(error))
    found += _output_problems(args)
    found += data_problems(args)  # a user's --data-prefix: its files, size and token ids
    found += scalar_loggers.missing_packages(args)  # --tensorboard-dir, --wandb-project
    return found


def clear_for_overwrite(args: TrainArgs) -> List[str]:
    """With --overwrite, at the run's first save: remove the output directory's old checkpoints
    (so none mixes with the new run's) and its tracker file; returns what was removed. Not those of
    the run it resumes (they are this run's own)."""
    if not args.overwrite:
        return []
    directory = checkpoint_dir(args)
    if _resumes_from(args, directory):
        return []
    removed = [path for _, path in checkpoint_files.step_dirs(directory)]
    for path in removed:
        shutil.rmtree(path)
    for tracker in checkpoint_files.trackers(directory):
        os.remove(tracker)
    return removed

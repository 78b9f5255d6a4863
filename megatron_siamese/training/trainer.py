"""Pretraining with Megatron-Core's own machinery, SiameseNorm or a stock baseline.

Per rank: the model, DistributedDataParallel, (distributed) optimizer and schedule of
``runtime.gpt.MegatronGPT``, Megatron's ``OptimizerParamScheduler`` (linear warmup, cosine
decay), GPTDataset data, periodic validation, and distributed checkpoints
(``megatron_siamese.training.checkpoint``). ``train(args)`` launches the ranks (gloo on
CPU, NCCL on GPUs) or, under ``torchrun`` or ``srun``, runs this rank of the launched job.

Across nodes: the embedded corpus is tokenized once per node (by its first rank) into
``--cache-dir``, or once for all when every rank sees the same ``--cache-dir`` (a shared
path), where Megatron then also caches the dataset indices; ranks on node-local caches build
their indices in memory. Checkpoints need an ``--output-dir`` every rank sees: a run whose
ranks see different directories is refused before its first step.
"""

from __future__ import annotations

import math
import os
import resource
import signal
import time
from dataclasses import asdict
from functools import partial
from typing import Dict, Optional

import torch

from megatron_siamese import device
from megatron_siamese.runtime import hangs, job, launch, launchers, stop_signals
from megatron_siamese.runtime.gpt import MegatronGPT
from megatron_siamese.training import checkpoint, output_guard
from megatron_siamese.training.megatron_lm_args import ADAM_BETAS, LR_DECAY_STYLE
from megatron_siamese.training.args import ADDITION_TASKS, ConfigError, TrainArgs, padded_vocab_size
from megatron_siamese.data.corpus import ByteTokenizer, embedded_corpus
from megatron_siamese.training.run_log import RunLog
from megatron_siamese.training.summary import RunSummary, format_summary, shown  # noqa: F401  (format_summary re-exported)


SUMMARY_FILE = "summary.json"  # in the output directory: the run's losses, layout and speed


def _optimizer_schedule(args: TrainArgs) -> dict:
    """The optimizer's lr, min lr and weight decay: the run's, or those of the optimizer state it
    resumes (``checkpoint.saved_optimizer_schedule``)."""
    saved = checkpoint.saved_optimizer_schedule(args)
    if saved:
        return saved
    return dict(lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay)


def data_readers(args: TrainArgs, tokenizer):
    """This rank's (train, validation) MicrobatchReaders of the run's data (the embedded corpus
    or --data-prefix, or an addition task), as the trainer reads them: the same validation set
    for a run's settings wherever it is built (``research/analysis.py`` evaluates on it)."""
    from megatron.core import parallel_state

    from megatron_siamese.training.data import MicrobatchReader, build_gpt_datasets

    if args.task != "lm":
        from megatron_siamese.data.addition import addition_corpus

        corpus = partial(addition_corpus, reverse=ADDITION_TASKS[args.task], digits=args.addition_digits)
    else:
        corpus = embedded_corpus
    shared_cache = job.shared_by_all_ranks(args.cache_dir)
    if args.data_prefix is None:
        rank = job.joined()
        if (rank.rank if shared_cache else rank.local_rank) == 0:
            corpus(args.cache_dir)  # once for all on a shared path, else once per node
        torch.distributed.barrier()
    prefix = args.data_prefix or corpus(args.cache_dir)
    train, valid = build_gpt_datasets(
        prefix,
        tokenizer,
        args.seq_length,
        args.seed,
        train_samples=args.steps * args.global_batch_size,
        # one fixed validation set: losses compare across steps, runs and layouts
        valid_samples=args.eval_iters * args.global_batch_size,
        # Megatron writes index caches on global rank 0 only: elsewhere they must be in memory
        cache_dir=os.path.join(args.cache_dir, "indices") if shared_cache else "",
        **{name: getattr(args, name) for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")})
    dp_rank = parallel_state.get_data_parallel_rank()
    # every microbatch's ids are checked against the tokenizer's (the padded rows are no tokens)
    vocab = tokenizer.vocab_size
    return (MicrobatchReader(train, args.micro_batch_size, args.num_microbatches, dp_rank, args.dp, vocab, prefix,
                             "train"),
            MicrobatchReader(valid, args.micro_batch_size, args.num_microbatches, dp_rank, args.dp, vocab, prefix,
                             "validation"))


class Trainer:
    """One rank's view of a run."""

    def __init__(self, args: TrainArgs):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.args = args
        self.tokenizer = ByteTokenizer()
        self.vocab_size = padded_vocab_size(self.tokenizer.vocab_size)
        self.gpt = MegatronGPT(
            args,
            args.layout,
            self.vocab_size,
            dict(**_optimizer_schedule(args), **ADAM_BETAS, clip_grad=args.clip_grad),
            args.seed,
        )
        self.config, self.model, self.optimizer = self.gpt.config, self.gpt.model, self.gpt.optimizer
        samples = args.global_batch_size  # per step: the schedule counts samples, as Megatron-LM's does
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=args.lr,
            min_lr=args.min_lr,
            lr_warmup_steps=args.warmup * samples,
            lr_decay_steps=args.steps * samples,
            lr_decay_style=LR_DECAY_STYLE,
            start_wd=args.weight_decay,
            end_wd=args.weight_decay,
            wd_incr_steps=args.steps * samples,
            wd_incr_style="constant",
            # a resumed run whose schedule differs from the checkpoint's was refused before
            # launch unless one of these says which wins (as Megatron-LM's flags do)
            override_opt_param_scheduler=args.override_opt_param_scheduler,
            use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        )
        self.router_stats = None
        if args.num_moe_experts:
            from megatron_siamese.training.router_stats import RouterStatistics

            self.router_stats = RouterStatistics(self.gpt.chunks, self.config, args)
        self._build_data()
        self.step = 0
        self.saved_before = False  # --overwrite clears the old checkpoints at the first save (checkpoint.save)
        if args.load:
            checkpoint.load(self, args.load)

    def _build_data(self):
        self.train_data, self.valid_data = data_readers(self.args, self.tokenizer)

    # -- steps ---------------------------------------------------------------------------

    def _forward_backward(self, microbatches, forward_only: bool) -> float:
        return self._global_mean_loss(self.gpt.forward_backward(microbatches, forward_only))

    def _global_mean_loss(self, losses) -> float:
        """The mean microbatch loss of the global batch, on every rank."""
        from megatron.core import parallel_state

        local = sum(float(d["loss"]) for d in losses) if losses else 0.0
        total = torch.tensor([local, float(len(losses))], dtype=torch.float64, device=device.current())
        if parallel_state.get_tensor_model_parallel_rank() != 0:  # count each replica once
            total = torch.zeros_like(total)
        torch.distributed.all_reduce(total)  # every rank gets the sum (stages without a loss too)
        return float(total[0] / total[1])

    def train_step(self) -> Dict[str, float]:
        self.gpt.train()
        self.gpt.zero_grad()
        loss = self._forward_backward(self.train_data.step(self.step), forward_only=False)
        updated, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=self.args.global_batch_size)
        self.step += 1
        stats = dict(loss=loss, grad_norm=float(grad_norm or 0.0), lr=self.optimizer.param_groups[0]["lr"],
                     loss_scale=float(self.optimizer.get_loss_scale()), skipped=not updated)
        if self.router_stats is not None:  # the aux losses and the busiest expert's load (router_stats.py)
            stats["router"] = self.router_stats.step(self.step, self.args.num_microbatches)
        if self.args.mtp_num_layers:  # each MTP layer's loss (mtp_stats.py)
            from megatron_siamese.training import mtp_stats

            stats["mtp"] = mtp_stats.step_losses(self.args.mtp_num_layers, self.args.num_microbatches)
        return stats

    @torch.no_grad()
    def evaluate(self) -> float:
        self.gpt.train(False)
        losses = [
            self._forward_backward(self.valid_data.step(i), forward_only=True)
            for i in range(self.args.eval_iters)
        ]
        if self.router_stats is not None:
            from megatron_siamese.training.router_stats import clear_tracker

            clear_tracker()  # as Megatron-LM does after evaluating
        return sum(losses) / len(losses)

    def peak_memory_mb(self) -> float:
        if device.uses_cuda():
            local = torch.cuda.max_memory_allocated() / 2**20
        else:
            local = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        peak = torch.tensor([local], device=device.current())
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        return float(peak)


# -- the run -----------------------------------------------------------------------------


def _agreed_stop(args: TrainArgs, started: float) -> Optional[str]:
    """Why the ranks stop after this step, if they do: a stop signal any rank (or the launcher)
    got, or --exit-duration-in-mins passed on any rank. One all-reduce, so every rank gets the
    same answer and all of them stop after the same step (Megatron-LM's DistributedSignalHandler
    and exit-duration check, in one collective)."""
    minutes = (time.monotonic() - started) / 60.0
    flags = torch.tensor([float(stop_signals.stop_requested()), minutes], dtype=torch.float64, device=device.current())
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    signum, minutes = int(flags[0].item()), float(flags[1].item())
    if signum:
        return signal.Signals(signum).name
    if args.exit_duration_in_mins is not None and minutes >= args.exit_duration_in_mins:
        return f"--exit-duration-in-mins {args.exit_duration_in_mins:g}"
    return None


def train_rank(args: TrainArgs) -> Optional[RunSummary]:
    """One rank's whole run; rank 0 reports progress and returns the summary."""
    from megatron_siamese.training.preflight import checkpoint_dir, foreign_checkpoints, may_save

    started = time.monotonic()  # --exit-duration-in-mins counts setup too, as Megatron-LM's does
    try:
        shared = job.shared_by_all_ranks(args.output_dir)
    except OSError as error:  # found before the first step, not at the first save
        raise ConfigError([f"--output-dir {args.output_dir}: {error}; choose a directory this job can write"]) from None
    if not shared:
        raise ConfigError([f"--output-dir {args.output_dir} is not the same directory on every node: checkpoints "
                           "need a path all ranks see (a shared file system)"])
    # a run that plans no checkpoint may share a directory with another run's; then a signal's
    # stop does not save there either (preflight refuses a run that plans one)
    # and Megatron-FSDP runs save none (TrainArgs refuses what would save one)
    stop_saves = not foreign_checkpoints(args) and not args.use_megatron_fsdp
    trainer = Trainer(args)
    rank0 = torch.distributed.get_rank() == 0
    log = RunLog(args, resumed_at=trainer.step, speaks=rank0)  # the console, metrics.jsonl, settings.json, ...
    echo = log.echo
    summary = RunSummary(args=asdict(args), steps_done=0)
    last_step = args.stop_step or args.steps
    directory = checkpoint_dir(args)
    if args.load:
        summary.resumed_from = trainer.step
        echo(f"resumed from {args.load} at step {trainer.step}")
    if may_save(args):
        when = f"every {args.save_interval} steps and at step {last_step}" if args.save_interval else f"at step {last_step}"
        echo(f"checkpoints: {when}, in {directory}")
    elif args.use_megatron_fsdp:
        echo("checkpoints: none (this trainer does not checkpoint Megatron-FSDP; Ctrl-C stops without one)")
    else:
        echo("checkpoints: none (--save DIR, --save-interval N or --stop-step N saves them; Ctrl-C saves one and stops)")
    log.begin(trainer.step)
    tokens_per_step = args.global_batch_size * args.seq_length
    start = time.perf_counter()
    timed_steps, timed_seconds = 0, 0.0
    first_step = trainer.step

    def completed_saves(blocking: bool) -> None:
        for path in checkpoint.complete_async_saves(blocking):
            summary.checkpoints.append(path)
            log.saved(path)

    while trainer.step < last_step:
        with hangs.watched(f"step {trainer.step + 1}"):  # a hung rank named, not waited on forever
            t0 = time.perf_counter()
            stats = trainer.train_step()
            elapsed = time.perf_counter() - t0
            if trainer.step > first_step + 1:  # the first step includes one-time setup costs
                timed_steps, timed_seconds = timed_steps + 1, timed_seconds + elapsed
            completed_saves(blocking=False)  # --async-save's, written meanwhile
            summary.train_losses[trainer.step] = stats["loss"]
            if "router" in stats:
                summary.router_stats[trainer.step] = stats["router"]
            log.step(trainer.step, stats, elapsed)
            if not math.isfinite(stats["loss"]):
                summary.diverged = True
                break
            stop = _agreed_stop(args, started)
            if stop is None and args.exit_interval and trainer.step % args.exit_interval == 0:
                stop = f"--exit-interval {args.exit_interval}"  # the same step on every rank: no collective
            if trainer.step % args.eval_interval == 0 or trainer.step == last_step:
                summary.val_losses[trainer.step] = trainer.evaluate()
                log.evaluated(trainer.step, summary.val_losses[trainer.step])
            if (args.save_interval and trainer.step % args.save_interval == 0) or (
                (trainer.step == last_step and may_save(args)) or (stop and stop_saves)
            ):
                path = checkpoint.save(trainer, directory)
                if args.async_save:
                    echo(f"saving {path} in the background")
                else:
                    summary.checkpoints.append(path)
                    log.saved(path)
            if stop:
                summary.stopped, summary.stop_reason = True, stop
                break
    completed_saves(blocking=True)
    if trainer.step not in summary.val_losses and not summary.diverged and not summary.stopped:
        summary.val_losses[trainer.step] = trainer.evaluate()  # e.g. a loaded checkpoint as is
        log.evaluated(trainer.step, summary.val_losses[trainer.step])
    if args.task != "lm" and not summary.diverged and not summary.stopped:
        from megatron_siamese.data.addition import exact_match_accuracy

        trainer.gpt.train(False)
        summary.accuracy = exact_match_accuracy(trainer.gpt.chunks[0], reverse=ADDITION_TASKS[args.task],
                                                digits=args.addition_digits)
    summary.steps_done = trainer.step
    summary.seconds = time.perf_counter() - start
    summary.tokens_per_second = tokens_per_step * timed_steps / timed_seconds if timed_seconds else 0.0
    summary.peak_memory_mb = trainer.peak_memory_mb()
    trainer.gpt.close()
    log.close()
    if not rank0:
        return None
    summary.write(os.path.join(args.output_dir, SUMMARY_FILE))
    return summary


def _launched_train_rank(args: TrainArgs) -> Optional[RunSummary]:
    from megatron_siamese.training.preflight import checkpoint_dir

    lock = output_guard.checked_before_start(args)
    before = output_guard.existing_checkpoints(args) if torch.distributed.get_rank() == 0 else set()
    try:
        return train_rank(args)
    except KeyboardInterrupt:
        if torch.distributed.get_rank() == 0:
            output_guard.unfinished_checkpoints_removed(checkpoint_dir(args), before)
        raise
    finally:
        if lock is not None:
            lock.release()


def train(args: TrainArgs) -> Optional[RunSummary]:
    """Run ``args`` on its ranks: launched here (after the preflight checks; ranks other than 0
    keep their output to a log shown if they fail), or this rank of a torchrun/srun job (the
    summary on rank 0, None on the others). The output directory is locked against another job
    while it runs.

    Raises ConfigError listing what keeps the run from starting.
    """
    from megatron_siamese.training.preflight import checkpoint_dir

    needs = f"--tp {args.tp} x --pp {args.pp} x --dp {args.dp}"
    if job.joined() is None and launchers.detect() is None:
        lock = output_guard.checked_before_start(args)
        before = output_guard.existing_checkpoints(args)
        try:
            return launch.run_job(train_rank, args.world_size, args, timeout_s=60 * args.distributed_timeout_minutes,
                                  reports_within_s=math.inf, quiet_ranks=range(1, args.world_size),
                                  graceful_stop=True, needs=needs)
        except KeyboardInterrupt:  # the ranks were stopped at once
            output_guard.unfinished_checkpoints_removed(checkpoint_dir(args), before)
            raise
        finally:
            if lock is not None:
                lock.release()
    return launch.run_job(_launched_train_rank, args.world_size, args, timeout_s=60 * args.distributed_timeout_minutes,
                          needs=needs)

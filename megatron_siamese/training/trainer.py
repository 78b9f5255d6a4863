"""Pretraining with Megatron-Core's own machinery, SiameseNorm or a stock baseline.

Per rank: the model, DistributedDataParallel, (distributed) optimizer and schedule of
``runtime.gpt.MegatronGPT``, Megatron's ``OptimizerParamScheduler`` (linear warmup, cosine
decay), GPTDataset data, periodic validation, and distributed checkpoints
(``megatron_siamese.training.checkpoint``). ``train(args)`` launches the ranks (gloo on
CPU, NCCL on GPUs) or, under ``torchrun``, runs this rank.
"""

from __future__ import annotations

import math
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Dict, List, Optional

import torch

from megatron_siamese.runtime.gpt import MegatronGPT, ModelSettings
from megatron_siamese.runtime.launch import run_on_ranks
from megatron_siamese.runtime.layout import Layout
from megatron_siamese.training.corpus import ByteTokenizer, embedded_corpus


@dataclass(frozen=True)
class TrainArgs(ModelSettings):
    """Everything a run needs (the model: ModelSettings); the CLI maps its flags onto these fields."""

    tp: int = 2
    pp: int = 1
    vpp: Optional[int] = None
    dp: int = 1
    sp: bool = False
    distributed_optimizer: bool = False
    micro_batch_size: int = 8
    global_batch_size: int = 16
    steps: int = 300
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 30
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    seed: int = 1234
    eval_interval: int = 100
    eval_iters: int = 8
    save_interval: Optional[int] = None  # save a checkpoint every N steps (and at the end)
    load: Optional[str] = None  # a checkpoint directory, or a directory with a `latest` file
    stop_step: Optional[int] = None  # stop (saving a checkpoint) after this step, e.g. preemption
    output_dir: str = "runs/default"
    cache_dir: str = ".cache/megatron_siamese"
    data_prefix: Optional[str] = None  # an indexed dataset of byte tokens; default: embedded KJV
    recompute: str = "none"  # none | full | selective
    task: str = "lm"  # lm: the corpus; addition(-reversed): synthetic addition (research/arithmetic.py)
    addition_digits: int = 3  # operands of up to this many digits (task=addition*)
    progress: bool = True

    def __post_init__(self):
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be below steps={self.steps}")
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism (--sp) needs --tp > 1")
        if self.model == "hybrid" and self.norm != "siamese":
            raise ValueError(f"--model hybrid builds SiameseNorm layers only (--norm siamese), got --norm {self.norm}")
        if self.task not in ("lm", "addition", "addition-reversed"):
            raise ValueError(f"task must be lm, addition or addition-reversed, got {self.task!r}")
        if self.task != "lm" and (self.tp, self.pp) != (1, 1):
            raise ValueError("the addition task's greedy evaluation runs at tp=1, pp=1")
        if self.stop_step is not None and not 0 < self.stop_step <= self.steps:
            raise ValueError(f"stop_step={self.stop_step} must lie in (0, steps={self.steps}]")
        self.num_microbatches  # validates the batch sizes

    @property
    def layout(self) -> Layout:
        return Layout(tp=self.tp, pp=self.pp, vpp=self.vpp, dp=self.dp, sp=self.sp,
                      distributed_optimizer=self.distributed_optimizer, recompute=self.recompute)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_microbatches(self) -> int:
        per_step = self.micro_batch_size * self.dp
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} must be a multiple of "
                f"micro_batch_size * dp = {per_step}"
            )
        return self.global_batch_size // per_step


@dataclass
class RunSummary:
    args: dict
    steps_done: int
    train_losses: Dict[int, float] = field(default_factory=dict)  # step -> loss
    val_losses: Dict[int, float] = field(default_factory=dict)  # step -> loss
    checkpoints: List[str] = field(default_factory=list)
    diverged: bool = False  # a non-finite training loss stopped the run
    accuracy: Optional[float] = None  # exact match on held-out problems (task=addition)
    tokens_per_second: float = 0.0
    peak_memory_mb: float = 0.0
    seconds: float = 0.0

    @property
    def final_train_loss(self) -> float:
        return _last(self.train_losses)

    @property
    def final_val_loss(self) -> float:
        return _last(self.val_losses)


def _last(losses: Dict[int, float]) -> float:
    """The loss at the latest step; nan when there is none."""
    return losses[max(losses)] if losses else float("nan")


# -- setup -------------------------------------------------------------------------------


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 64) -> int:
    """The vocabulary padded to a multiple of 64, whatever the TP size.

    The padded rows are real logits in the softmax, so their number must not change with
    the layout: a checkpoint then loads at any TP size dividing it and computes the same
    losses (Megatron-LM pads to a multiple of 128 * TP, which ties checkpoints to TP).
    """
    padded = int(math.ceil(vocab_size / multiple) * multiple)
    if padded % tp:
        raise ValueError(f"tp={tp} must divide the padded vocabulary size {padded}")
    return padded


class Trainer:
    """One rank's view of a run."""

    def __init__(self, args: TrainArgs):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.args = args
        self.tokenizer = ByteTokenizer()
        self.gpt = MegatronGPT(
            args,
            args.layout,
            padded_vocab_size(self.tokenizer.vocab_size, args.tp),
            dict(lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, adam_beta1=0.9,
                 adam_beta2=0.95, clip_grad=args.clip_grad),
            args.seed,
        )
        self.config, self.model, self.optimizer = self.gpt.config, self.gpt.model, self.gpt.optimizer
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=args.lr,
            min_lr=args.min_lr,
            lr_warmup_steps=args.warmup_steps,
            lr_decay_steps=args.steps,
            lr_decay_style="cosine",
            start_wd=args.weight_decay,
            end_wd=args.weight_decay,
            wd_incr_steps=args.steps,
            wd_incr_style="constant",
        )
        self._build_data()
        self.step = 0
        if args.load:
            from megatron_siamese.training import checkpoint

            checkpoint.load(self, args.load)

    def _build_data(self):
        from megatron.core import parallel_state

        from megatron_siamese.training.data import MicrobatchReader, build_gpt_datasets

        args = self.args
        if args.task != "lm":
            from megatron_siamese.research.arithmetic import TASKS, addition_corpus

            corpus = partial(addition_corpus, reverse=TASKS[args.task], digits=args.addition_digits)
        else:
            corpus = embedded_corpus
        if torch.distributed.get_rank() == 0 and args.data_prefix is None:
            corpus(args.cache_dir)  # built once, by one rank
        torch.distributed.barrier()
        prefix = args.data_prefix or corpus(args.cache_dir)
        train, valid = build_gpt_datasets(
            prefix,
            self.tokenizer,
            args.seq_length,
            args.seed,
            train_samples=args.steps * args.global_batch_size,
            # one fixed validation set: losses compare across steps, runs and layouts
            valid_samples=args.eval_iters * args.global_batch_size,
            cache_dir=os.path.join(args.cache_dir, "indices"),
        )
        dp_rank = parallel_state.get_data_parallel_rank()
        self.train_data = MicrobatchReader(train, args.micro_batch_size, args.num_microbatches, dp_rank, args.dp)
        self.valid_data = MicrobatchReader(valid, args.micro_batch_size, args.num_microbatches, dp_rank, args.dp)

    # -- steps ---------------------------------------------------------------------------

    def _forward_backward(self, microbatches, forward_only: bool) -> float:
        return self._global_mean_loss(self.gpt.forward_backward(microbatches, forward_only))

    def _global_mean_loss(self, losses) -> float:
        """The mean microbatch loss of the global batch, on every rank."""
        from megatron.core import parallel_state

        local = sum(float(d["loss"]) for d in losses) if losses else 0.0
        total = torch.tensor([local, float(len(losses))], dtype=torch.float64)
        if torch.cuda.is_available():
            total = total.cuda()
        if parallel_state.get_tensor_model_parallel_rank() != 0:  # count each replica once
            total = torch.zeros_like(total)
        torch.distributed.all_reduce(total)  # every rank gets the sum (stages without a loss too)
        return float(total[0] / total[1])

    def train_step(self) -> Dict[str, float]:
        self.gpt.train()
        self.gpt.zero_grad()
        loss = self._forward_backward(self.train_data.step(self.step), forward_only=False)
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        self.step += 1
        return dict(loss=loss, grad_norm=float(grad_norm or 0.0), lr=self.optimizer.param_groups[0]["lr"])

    @torch.no_grad()
    def evaluate(self) -> float:
        self.gpt.train(False)
        losses = [
            self._forward_backward(self.valid_data.step(i), forward_only=True)
            for i in range(self.args.eval_iters)
        ]
        return sum(losses) / len(losses)

    def peak_memory_mb(self) -> float:
        if torch.cuda.is_available():
            local = torch.cuda.max_memory_allocated() / 2**20
        else:
            local = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        peak = torch.tensor([local])
        if torch.cuda.is_available():
            peak = peak.cuda()
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        return float(peak)


# -- the run -----------------------------------------------------------------------------


def train_rank(args: TrainArgs) -> Optional[RunSummary]:
    """One rank's whole run; rank 0 reports progress and returns the summary."""
    from megatron_siamese.training import checkpoint

    trainer = Trainer(args)
    rank0 = torch.distributed.get_rank() == 0
    summary = RunSummary(args=asdict(args), steps_done=0)
    last_step = args.stop_step or args.steps
    checkpoint_dir = os.path.join(args.output_dir, "checkpoints")
    bar = None
    if rank0 and args.progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=trainer.step, desc=args.norm, dynamic_ncols=True)
    tokens_per_step = args.global_batch_size * args.seq_length
    start = time.perf_counter()
    timed_steps, timed_seconds = 0, 0.0
    first_step = trainer.step
    while trainer.step < last_step:
        t0 = time.perf_counter()
        stats = trainer.train_step()
        elapsed = time.perf_counter() - t0
        if trainer.step > first_step + 1:  # the first step includes one-time setup costs
            timed_steps, timed_seconds = timed_steps + 1, timed_seconds + elapsed
        summary.train_losses[trainer.step] = stats["loss"]
        if not math.isfinite(stats["loss"]):
            summary.diverged = True
            break
        if trainer.step % args.eval_interval == 0 or trainer.step == last_step:
            summary.val_losses[trainer.step] = trainer.evaluate()
        if (args.save_interval and trainer.step % args.save_interval == 0) or (
            trainer.step == last_step and (args.save_interval or args.stop_step)
        ):
            summary.checkpoints.append(checkpoint.save(trainer, checkpoint_dir))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(
                loss=f"{stats['loss']:.3f}",
                lr=f"{stats['lr']:.2e}",
                gnorm=f"{stats['grad_norm']:.2f}",
                tok_s=f"{tokens_per_step / elapsed:.0f}",
                val=_shown(summary.val_losses, 3),
            )
    if bar is not None:
        bar.close()
    if trainer.step not in summary.val_losses and not summary.diverged:
        summary.val_losses[trainer.step] = trainer.evaluate()  # e.g. a loaded checkpoint as is
    if args.task != "lm" and not summary.diverged:
        from megatron_siamese.research.arithmetic import TASKS, exact_match_accuracy

        trainer.gpt.train(False)
        summary.accuracy = exact_match_accuracy(trainer.gpt.chunks[0], reverse=TASKS[args.task],
                                                digits=args.addition_digits)
    summary.steps_done = trainer.step
    summary.seconds = time.perf_counter() - start
    summary.tokens_per_second = tokens_per_step * timed_steps / timed_seconds if timed_seconds else 0.0
    summary.peak_memory_mb = trainer.peak_memory_mb()
    trainer.gpt.close()
    return summary if rank0 else None


def train(args: TrainArgs) -> RunSummary:
    """Run ``args`` on its ranks: launched here, or this rank of a torchrun job."""
    return run_on_ranks(train_rank, args.world_size, args, timeout_s=24 * 3600)


def _shown(losses: Dict[int, float], digits: int = 4) -> str:
    return f"{_last(losses):.{digits}f}" if losses else "-"


def format_summary(summary: RunSummary) -> str:
    lines = [
        f"norm={summary.args['norm']} steps={summary.steps_done} "
        f"layout=tp{summary.args['tp']} pp{summary.args['pp']} dp{summary.args['dp']}",
        f"final train loss {_shown(summary.train_losses)}  final val loss {_shown(summary.val_losses)}",
        f"{summary.tokens_per_second:.0f} tokens/s  peak memory {summary.peak_memory_mb:.0f} MB/rank  "
        f"wall {summary.seconds:.0f}s",
    ]
    if summary.diverged:
        lines.append(f"DIVERGED: non-finite training loss at step {max(summary.train_losses)}")
    if summary.accuracy is not None:
        lines.append(f"exact-match accuracy on held-out problems: {summary.accuracy:.3f}")
    return "\n".join(lines)

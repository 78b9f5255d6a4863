"""``megatron-siamese study``: a small, reproducible comparison of residual schemes, each run
Megatron-LM's own training loop (``megatron-siamese train``, one rank) with the same flags but the
arm's and the grid's. A run that blows up is a result (reported diverged, stuck or spiked), a run that
fails otherwise stops the study. Writes ``study.json``, the loss curves and ``results.md``, read and
interpreted by hand in docs/results.md. The arms, grid and criteria: docs/research.md, "The study".
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

# arm -> the flags of ``megatron-siamese train`` that make it (the rest is the plan's)
ARMS: Dict[str, Tuple[str, ...]] = {
    "pre": ("--norm", "pre"),
    "post": ("--norm", "post"),
    "siamese": ("--norm", "siamese"),
    "siamese-hybrid": ("--norm", "siamese-hybrid"),
    "hybridnorm": ("--norm", "hybridnorm"),
    "mixln": ("--norm", "mixln"),  # alpha 0.25: the first 2 of 8 layers Post-Norm
    # "coupling a HybridNorm stream with a Pre-Norm stream through the Siamese topology without the
    # normalized input and depth scaling": the hybrid variant without both
    "ablation": ("--norm", "siamese-hybrid", "--no-siamese-input-norm", "--no-siamese-depth-scale"),
}
SCHEMES = tuple(ARMS)

# every run's model, batch and optimizer (Megatron-LM's flags); the grid adds the rest (_flags)
MODEL_FLAGS = ("--num-layers", "8", "--hidden-size", "96", "--num-attention-heads", "4", "--seq-length", "128",
               "--max-position-embeddings", "128", "--normalization", "LayerNorm", "--swiglu", "--disable-bias-linear",
               "--position-embedding-type", "rope", "--micro-batch-size", "16", "--global-batch-size", "16",
               "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-beta2", "0.95",
               "--eval-iters", "4")
# a run that blows up is a result here, not an error: Megatron's loop goes on past a NaN loss
RUN_FLAGS = ("--no-check-for-nan-in-loss-and-grad", "--log-interval", "50", "--tensorboard-dir")

SPIKE_MARGIN = 1.0  # nats per token above the lowest training loss so far
STUCK_MARGIN = 0.1  # nats per token


@dataclasses.dataclass
class StudyPlan:
    output_dir: str = "runs/study"
    cache_dir: str = ".cache/megatron_siamese"
    schemes: Tuple[str, ...] = SCHEMES
    # from ordinary for this size to 64 times that; 2e-3 is the paper's rate
    learning_rates: Tuple[float, ...] = (1e-3, 2e-3, 4e-3, 1.6e-2, 6.4e-2)
    seeds: Tuple[int, ...] = (1, 2)
    steps: int = 200
    eval_interval: int = 50
    warmup_steps: int = 50  # a quarter of the run
    # the second panel: a short warmup, for these arms, rates and seeds (None: no panel)
    short_warmup_steps: Optional[int] = 10
    short_warmup_schemes: Tuple[str, ...] = ("pre", "post", "siamese", "hybridnorm", "mixln")
    short_warmup_learning_rates: Tuple[float, ...] = (1e-3, 4e-3)
    short_warmup_seeds: Tuple[int, ...] = (1,)
    arithmetic_schemes: Tuple[str, ...] = ("pre", "siamese")
    arithmetic_task: str = "addition-reversed"  # the sum written reversed (data/addition.py)
    arithmetic_digits: int = 2
    arithmetic_lr: float = 2e-3
    arithmetic_steps: int = 1500
    arithmetic_warmup_steps: int = 10
    arithmetic_seeds: Tuple[int, ...] = (1, 2, 3)
    workers: int = 2
    model_flags: Tuple[str, ...] = MODEL_FLAGS


@dataclasses.dataclass(frozen=True)
class Job:
    arm: str
    lr: float
    seed: int
    task: str  # "lm" or the arithmetic task
    warmup: int

    @property
    def key(self) -> str:
        return f"{self.task}|{self.arm}|{self.lr:g}|{self.seed}|{self.warmup}"

    @property
    def name(self) -> str:
        return f"{self.task}-{self.arm}-lr{self.lr:g}-seed{self.seed}-warmup{self.warmup}"

    @staticmethod
    def of(key: str) -> "Job":
        task, arm, lr, seed, warmup = key.split("|")
        return Job(arm, float(lr), int(seed), task, int(warmup))


@dataclasses.dataclass
class RunResult:
    """What the study keeps of a run: its losses by iteration (from its TensorBoard events) and,
    for the addition task, the exact-match accuracy of its saved model."""

    flags: List[str]
    train_losses: Dict[int, float]
    val_losses: Dict[int, float]
    accuracy: Optional[float] = None

    @property
    def final_val_loss(self) -> float:
        return self.val_losses[max(self.val_losses)] if self.val_losses else math.nan

    @staticmethod
    def of(record: dict) -> "RunResult":  # as study.json holds it (JSON keys are strings)
        return RunResult(record["flags"], {int(k): v for k, v in record["train_losses"].items()},
                         {int(k): v for k, v in record["val_losses"].items()}, record["accuracy"])


def _flags(plan: StudyPlan, job: Job, directory: str) -> List[str]:
    """The run's ``megatron-siamese train`` flags."""
    steps = plan.steps if job.task == "lm" else plan.arithmetic_steps
    flags = [*plan.model_flags, *ARMS[job.arm], "--train-iters", str(steps), "--lr", f"{job.lr:g}",
             "--min-lr", f"{job.lr / 10:g}", "--lr-warmup-iters", str(job.warmup), "--seed", str(job.seed),
             *RUN_FLAGS, os.path.join(directory, "tensorboard")]
    if job.task == "lm":
        return flags + ["--eval-interval", str(min(plan.eval_interval, steps))]
    from megatron_siamese.data.addition import addition_corpus
    from megatron_siamese.runtime.pretrain_flags import byte_data_flags

    prefix = addition_corpus(plan.cache_dir, reverse=job.task == "addition-reversed", digits=plan.arithmetic_digits)
    return flags + ["--seq-length", "64", "--eval-interval", str(max(1, steps // 3)), *byte_data_flags(prefix),
                    "--save", os.path.join(directory, "checkpoints"), "--save-interval", str(steps)]


def jobs_of(plan: StudyPlan) -> List[Job]:
    """Every run of the plan, the long addition runs first (the two workers then finish together)."""
    jobs = [Job(arm, plan.arithmetic_lr, seed, plan.arithmetic_task,
                min(plan.arithmetic_warmup_steps, plan.arithmetic_steps - 1))
            for arm in plan.arithmetic_schemes for seed in plan.arithmetic_seeds]
    jobs += [Job(arm, lr, seed, "lm", plan.warmup_steps)
             for arm in plan.schemes for lr in plan.learning_rates for seed in plan.seeds]
    if plan.short_warmup_steps not in (None, plan.warmup_steps):
        jobs += [Job(arm, lr, seed, "lm", plan.short_warmup_steps)
                 for arm in plan.short_warmup_schemes if arm in plan.schemes
                 for lr in plan.short_warmup_learning_rates for seed in plan.short_warmup_seeds]
    return jobs


def failed(run: RunResult) -> bool:
    """Diverged: a non-finite loss, or ending no better than a uniform guess over the model's
    vocabulary (the byte tokens, padded by Megatron-LM to a multiple of 128 at TP 1)."""
    from megatron_siamese.data.corpus import ByteTokenizer

    final, vocabulary = run.final_val_loss, -(-ByteTokenizer().vocab_size // 128) * 128
    return not all(map(math.isfinite, [*run.train_losses.values(), final])) or final > math.log(vocabulary)


def stuck(run: RunResult, unigram_entropy: float) -> bool:
    """Not diverged, yet ending above the unigram entropy less STUCK_MARGIN (Post-Norm's typical failure)."""
    return not failed(run) and run.final_val_loss > unigram_entropy - STUCK_MARGIN


def spikes(train_losses: Dict[int, float]) -> List[int]:
    """The steps where a loss spike starts: the training loss more than SPIKE_MARGIN above the
    lowest it has reached (a non-finite loss included), each spike counted once until the loss
    is back within the margin."""
    lowest, inside, found = math.inf, False, []
    for step in sorted(train_losses):
        loss = train_losses[step]
        above = not math.isfinite(loss) or loss > lowest + SPIKE_MARGIN
        if above and not inside:
            found.append(step)
        inside = above
        if math.isfinite(loss):
            lowest = min(lowest, loss)
    return found


class RunFailed(RuntimeError):
    """A run of the study that Megatron's loop did not finish: a bug or a broken setup, not a result."""


def train_run(plan: StudyPlan, job: Job) -> RunResult:
    """One run: ``megatron-siamese train`` on one rank, its output in ``train.log``; its losses,
    and for the addition task the accuracy of the model it saved."""
    from megatron_siamese.cli.train import start_ranks
    from megatron_siamese.runtime.loss_curve import read_losses
    from megatron_siamese.runtime.pretrain_flags import CACHE_VARIABLE

    directory = os.path.join(plan.output_dir, job.name)
    os.makedirs(directory, exist_ok=True)
    flags = _flags(plan, job, directory)
    log = os.path.join(directory, "train.log")
    open(log, "w").close()
    status = start_ranks(1, flags, log=log, environment={CACHE_VARIABLE: plan.cache_dir})
    if status:
        raise RunFailed(f"study run {job.name} exited with status {status}: see {log}")
    train, validation = read_losses(os.path.join(directory, "tensorboard"))
    result = RunResult(flags, train, validation)
    if job.task != "lm" and not failed(result):
        result.accuracy = addition_accuracy(os.path.join(directory, "checkpoints"), job.task == "addition-reversed",
                                            plan.arithmetic_digits)
    return result


def addition_accuracy(checkpoint: str, reverse: bool, digits: int) -> float:
    """Exact-match accuracy on the held-out problems of the model ``checkpoint`` holds (one rank)."""
    from megatron_siamese.runtime.launch import run_job

    return run_job(_accuracy_rank, 1, checkpoint, reverse, digits, needs="the addition accuracy")


def _accuracy_rank(checkpoint: str, reverse: bool, digits: int) -> float:
    from megatron_siamese.data.addition import exact_match_accuracy
    from megatron_siamese.inference.session import open_session

    session = open_session(checkpoint, with_mtp=False)
    try:
        return exact_match_accuracy(session.chunks[0], reverse=reverse, digits=digits)
    finally:
        session.close()


def _interrupt_running_ranks() -> None:
    """SIGINT to the running runs' ranks, as a terminal's Ctrl-C sends every process of its group (their agents, on
    the pool's threads, pass no signal on); they end with status 130, the fork server ignores it."""
    import psutil

    for process in psutil.Process().children(recursive=True):
        try:
            process.send_signal(signal.SIGINT)
        except psutil.Error:  # ended meanwhile
            pass


def run_study(plan: StudyPlan, echo=print) -> dict:
    from megatron_siamese.runtime import launch
    from megatron_siamese.runtime.registry import ConfigError
    from megatron_siamese.versions import training_loop_problem

    problem = training_loop_problem("megatron-siamese study")
    if problem:
        raise ConfigError([problem])
    unknown = sorted(set(plan.schemes + plan.arithmetic_schemes + plan.short_warmup_schemes) - set(SCHEMES))
    if unknown:
        raise ValueError(f"unknown schemes {unknown}: choose from {', '.join(SCHEMES)}")
    results: Dict[str, dict] = {}
    start = time.perf_counter()
    jobs, lm = jobs_of(plan), sum(job.task == "lm" for job in jobs_of(plan))
    echo(f"study: {len(jobs)} runs ({lm} language modelling, {len(jobs) - lm} addition), {plan.workers} at a time, one "
         f"rank each, in {plan.output_dir}/<run>/; as each ends: [seconds] task|scheme|peak lr|seed|warmup: final val loss")

    def run(job: Job):
        result = train_run(plan, job)
        results[job.key] = dataclasses.asdict(result)
        found = spikes(result.train_losses)
        echo(f"[{time.perf_counter() - start:6.0f}s] {job.key}: val {result.final_val_loss:.4f}"
             f"{' DIVERGED' if failed(result) else ''}{f' spikes at {found}' if found else ''}"
             f"{'' if result.accuracy is None else f' accuracy {result.accuracy:.3f}'}")

    from megatron_siamese.data.corpus import embedded_corpus, unigram_entropy

    entropy = unigram_entropy(embedded_corpus(plan.cache_dir))  # built once, before the runs share it
    with launch.ctrl_c_noted() as interrupted, ThreadPoolExecutor(max_workers=plan.workers) as pool:
        try:
            launch.all_results([pool.submit(run, job) for job in jobs], interrupted)
        except BaseException as stopped:
            pool.shutdown(wait=False, cancel_futures=True)  # no run starts after Ctrl-C or a failed run
            if not isinstance(stopped, KeyboardInterrupt):
                raise
            _interrupt_running_ranks()
            pool.shutdown(wait=True)
            echo(f"stopped: {len(results)} runs had finished (each in {plan.output_dir}/<run>/); the tables, "
                 "study.json and the plots come with a whole study")
            raise
    study = {"plan": dataclasses.asdict(plan), "runs": results, "unigram_entropy": entropy,
             "seconds": time.perf_counter() - start}
    os.makedirs(plan.output_dir, exist_ok=True)
    with open(os.path.join(plan.output_dir, "study.json"), "w") as out:
        json.dump(study, out, indent=1)
    plot(study, plan.output_dir)
    with open(os.path.join(plan.output_dir, "results.md"), "w") as out:
        out.write(tables(study))
    return study


def _runs(study: dict, task: str, arm: str, lr: Optional[float] = None, warmup: Optional[int] = None) -> List[dict]:
    """The runs of one cell, by seed."""
    found = []
    for key, run in study["runs"].items():
        job = Job.of(key)
        if (job.task, job.arm) == (task, arm) and lr in (None, job.lr) and warmup in (None, job.warmup):
            found.append((job.seed, run))
    return [run for _, run in sorted(found, key=lambda pair: pair[0])]


def _cell(summaries: List[RunResult], entropy: float) -> str:
    ok = [s.final_val_loss for s in summaries if not failed(s)]
    cell = f"{statistics.mean(ok):.3f}" + (f" ± {statistics.stdev(ok):.3f}" if len(ok) > 1 else "") if ok else "-"
    marks = [(len(summaries) - len(ok), "diverged"), (sum(stuck(s, entropy) for s in summaries), "stuck"),
             (sum(bool(spikes(s.train_losses)) for s in summaries), "spiked")]
    return cell + "".join(f" ({count} {what})" for count, what in marks if count)


def _panel(study: dict, warmup: int, arms: Tuple[str, ...], rates: Tuple[float, ...]) -> List[str]:
    entropy = study["unigram_entropy"]
    lines = ["| scheme | " + " | ".join(f"lr {lr:g}" for lr in rates) + " |", "| --- |" + " --- |" * len(rates)]
    seeds = ["| scheme | " + " | ".join(f"lr {lr:g}" for lr in rates) + " |", "| --- |" + " --- |" * len(rates)]
    for arm in arms:
        by_rate = [[RunResult.of(r) for r in _runs(study, "lm", arm, lr, warmup)] for lr in rates]
        lines.append(f"| {arm} | " + " | ".join(_cell(s, entropy) for s in by_rate) + " |")
        seeds.append(f"| {arm} | " + " | ".join(", ".join(
            ("diverged" if failed(s) else f"{s.final_val_loss:.3f}") + ("*" if spikes(s.train_losses) else "")
            for s in summaries) for summaries in by_rate) + " |")
    return lines + ["", "Per seed (* a loss spike):", ""] + seeds


def stability(study: dict, warmup: int, arms: Tuple[str, ...], rates: Tuple[float, ...]) -> List[str]:
    """Per arm: its best mean and where, and the learning rates at which it diverged, got stuck or spiked."""
    entropy = study["unigram_entropy"]
    lines = ["| scheme | best mean (lr) | lr where a run diverged | lr where a run got stuck | lr where a run spiked |",
             "| --- | --- | --- | --- | --- |"]
    for arm in arms:
        best, marks = None, {"diverged": [], "stuck": [], "spiked": []}
        for lr in rates:
            summaries = [RunResult.of(r) for r in _runs(study, "lm", arm, lr, warmup)]
            ok = [s.final_val_loss for s in summaries if not failed(s)]
            if ok and len(ok) == len(summaries) and (best is None or statistics.mean(ok) < best[0]):
                best = (statistics.mean(ok), lr)
            for what, test in (("diverged", failed), ("stuck", lambda s: stuck(s, entropy)),
                               ("spiked", lambda s: bool(spikes(s.train_losses)))):
                if any(test(s) for s in summaries):
                    marks[what].append(f"{lr:g}")
        shown = "-" if best is None else f"{best[0]:.3f} ({best[1]:g})"
        lines.append(f"| {arm} | {shown} | " + " | ".join(", ".join(v) or "-" for v in marks.values()) + " |")
    return lines


def tables(study: dict) -> str:
    plan, entropy = study["plan"], study["unigram_entropy"]
    lines = [f"Final validation loss (nats per byte), mean ± std over the seeds that did not diverge; in "
             f"brackets how many runs diverged (a non-finite loss, or worse than uniform), got stuck (ended "
             f"above the corpus's unigram entropy, {entropy:.3f}, less {STUCK_MARGIN}) or spiked (the training "
             f"loss rose more than {SPIKE_MARGIN} above its lowest so far).", ""]
    for warmup, arms, rates, seeds in _panels(plan):
        lines += [f"### Warmup {warmup} steps (seeds {', '.join(map(str, seeds))})", ""]
        lines += _panel(study, warmup, arms, rates) + [""] + stability(study, warmup, arms, rates) + [""]
    arithmetic = plan["arithmetic_schemes"]  # none: no addition runs
    lines += [f"{plan['arithmetic_task']} of up to {plan['arithmetic_digits']}-digit numbers (exact match "
              f"on 500 held-out problems, lr {plan['arithmetic_lr']:g}, {plan['arithmetic_steps']} steps):", "",
              "| scheme | accuracy per seed | mean | final val loss |", "| --- | --- | --- | --- |"] if arithmetic else []
    for arm in arithmetic:
        summaries = [RunResult.of(r) for r in _runs(study, plan["arithmetic_task"], arm)]
        accuracies = [s.accuracy for s in summaries if s.accuracy is not None]
        lines.append(f"| {arm} | {', '.join(f'{a:.3f}' for a in accuracies)} | "
                     f"{statistics.mean(accuracies) if accuracies else float('nan'):.3f} | "
                     f"{statistics.mean(s.final_val_loss for s in summaries):.3f} |")
    lines += [""] * bool(arithmetic) + [f"Wall time: {study['seconds'] / 60:.1f} min."]
    return "\n".join(lines) + "\n"


def _panels(plan: dict) -> List[tuple]:
    """(warmup, arms, rates, seeds) of each panel of a plan (as study.json holds it), the main one first."""
    panels = [(plan["warmup_steps"], tuple(plan["schemes"]), tuple(plan["learning_rates"]), tuple(plan["seeds"]))]
    if plan["short_warmup_steps"] not in (None, plan["warmup_steps"]):
        panels.append((plan["short_warmup_steps"], tuple(a for a in plan["short_warmup_schemes"] if a in plan["schemes"]),
                       tuple(plan["short_warmup_learning_rates"]), tuple(plan["short_warmup_seeds"])))
    return panels


def plot(study: dict, directory: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(study["plan"])
    columns = max(len(rates) for _, _, rates, _ in panels)
    figure, axes = plt.subplots(len(panels), columns, figsize=(4.2 * columns, 3.6 * len(panels)),
                                sharey=True, squeeze=False)
    colors = {arm: f"C{i}" for i, arm in enumerate(SCHEMES)}
    for row, (warmup, arms, rates, _) in zip(axes, panels):
        for axis in row[len(rates):]:
            axis.set_visible(False)
        for axis, lr in zip(row, rates):
            for arm in arms:
                for index, run in enumerate(_runs(study, "lm", arm, lr, warmup)):
                    losses = RunResult.of(run).train_losses
                    steps = sorted(losses)
                    axis.plot(steps, [losses[k] for k in steps], color=colors[arm], alpha=0.5, lw=1,
                              label=arm if index == 0 else None)
                    marked = spikes(losses)
                    axis.plot(marked, [min(losses[k], 7.8) if math.isfinite(losses[k]) else 7.8 for k in marked],
                              "x", color=colors[arm], ms=7, mew=2)
            axis.set_title(f"peak lr {lr:g}, warmup {warmup}")
            axis.set_xlabel("step")
            axis.set_ylim(1.0, 8.0)
            axis.grid(alpha=0.3)
        row[0].set_ylabel("training loss (nats per byte)")
    axes[0][0].legend(fontsize=8, loc="upper right")
    figure.tight_layout()
    figure.savefig(os.path.join(directory, "study_curves.png"), dpi=100)
    plt.close(figure)

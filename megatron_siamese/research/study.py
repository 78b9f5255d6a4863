"""``megatron-siamese study``: a small, reproducible comparison of residual schemes.

Language modelling on the embedded corpus, one arm per scheme the paper compares (``ARMS``):
Pre-Norm, Post-Norm, SiameseNorm and its hybrid variant, HybridNorm, Mix-LN, and the paper's
component-study ablation (the hybrid variant's two streams without InputNorm and depth
scaling), each at peak learning rates from ordinary to past where most schemes diverge, with a
warmup of a quarter of the run; a second panel repeats the grid with a 10-step warmup for the
single-stream schemes and SiameseNorm (does Post-Norm's plateau come from too short a warmup?);
then synthetic multi-digit addition (exact-match accuracy) for Pre-Norm vs SiameseNorm. Every
run uses the same model size, data order per seed, schedule and budget; runs go two at a time
(one CPU core each). Instability is reported as the paper marks it, per run: loss spikes (the
training loss rising ``SPIKE_MARGIN`` above the lowest it had reached), divergence (a
non-finite loss, or ending no better than a uniform guess) and, for this corpus, runs stuck at
the unigram plateau. Writes ``<output_dir>/study.json``, the loss curves (spikes marked) and
``<output_dir>/results.md`` (tables a person then reads and interprets in docs/results.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

from megatron_siamese.training.args import TrainArgs
from megatron_siamese.training.summary import RunSummary

# arm -> the model settings that make it (the rest is the plan's base)
ARMS: Dict[str, Dict[str, object]] = {
    "pre": dict(norm="pre"),
    "post": dict(norm="post"),
    "siamese": dict(norm="siamese"),
    "siamese-hybrid": dict(norm="siamese-hybrid"),
    "hybridnorm": dict(norm="hybridnorm"),
    "mixln": dict(norm="mixln"),  # alpha 0.25: the first 2 of 8 layers Post-Norm
    # "coupling a HybridNorm stream with a Pre-Norm stream through the Siamese topology without the
    # normalized input and depth scaling": the hybrid variant without both
    "ablation": dict(norm="siamese-hybrid", siamese_input_norm=False, siamese_depth_scale=False),
}
SCHEMES = tuple(ARMS)

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
    warmup_steps: int = 50  # a quarter of the run
    # the second panel: a short warmup, for these arms, rates and seeds (None: no panel)
    short_warmup_steps: Optional[int] = 10
    short_warmup_schemes: Tuple[str, ...] = ("pre", "post", "siamese", "hybridnorm", "mixln")
    short_warmup_learning_rates: Tuple[float, ...] = (1e-3, 4e-3)
    short_warmup_seeds: Tuple[int, ...] = (1,)
    arithmetic_schemes: Tuple[str, ...] = ("pre", "siamese")
    arithmetic_task: str = "addition-reversed"  # a trainer task (data/addition.py)
    arithmetic_digits: int = 2
    arithmetic_lr: float = 2e-3
    arithmetic_steps: int = 1500
    arithmetic_warmup_steps: int = 10
    arithmetic_seeds: Tuple[int, ...] = (1, 2, 3)
    workers: int = 2
    base: TrainArgs = dataclasses.field(default_factory=lambda: TrainArgs(
        tp=1, num_layers=8, hidden_size=96, num_attention_heads=4, seq_length=128,
        micro_batch_size=16, global_batch_size=16, steps=200, warmup_steps=10, eval_interval=50,
        eval_iters=4, progress=False, normalization="LayerNorm",
    ))


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

    @staticmethod
    def of(key: str) -> "Job":
        task, arm, lr, seed, warmup = key.split("|")
        return Job(arm, float(lr), int(seed), task, int(warmup))


def _args(plan: StudyPlan, job: Job) -> TrainArgs:
    name = f"{job.task}-{job.arm}-lr{job.lr:g}-seed{job.seed}-warmup{job.warmup}"
    changes = dict(ARMS[job.arm], lr=job.lr, min_lr=job.lr / 10, seed=job.seed, task=job.task, warmup_steps=job.warmup,
                   cache_dir=plan.cache_dir, output_dir=os.path.join(plan.output_dir, name))
    if job.task != "lm":
        changes.update(steps=plan.arithmetic_steps, seq_length=64, addition_digits=plan.arithmetic_digits,
                       eval_interval=max(1, plan.arithmetic_steps // 3))
    return dataclasses.replace(plan.base, **changes)


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


def failed(summary: RunSummary, vocabulary: int = 320) -> bool:
    """Diverged: a non-finite loss, or ending no better than a uniform guess."""
    final = summary.final_val_loss
    return summary.diverged or not math.isfinite(final) or final > math.log(vocabulary)


def stuck(summary: RunSummary, unigram_entropy: float) -> bool:
    """Trained but never got past token frequencies: within STUCK_MARGIN of the corpus's
    unigram entropy (Post-Norm's typical failure)."""
    return not failed(summary) and summary.final_val_loss > unigram_entropy - STUCK_MARGIN


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


def run_study(plan: StudyPlan, echo=print) -> dict:
    unknown = sorted(set(plan.schemes + plan.arithmetic_schemes + plan.short_warmup_schemes) - set(SCHEMES))
    if unknown:
        raise ValueError(f"unknown schemes {unknown}: choose from {', '.join(SCHEMES)}")
    results: Dict[str, dict] = {}
    start = time.perf_counter()

    from megatron_siamese.training.trainer import train

    def run(job: Job):
        summary = train(_args(plan, job))
        results[job.key] = dataclasses.asdict(summary)
        echo(f"[{time.perf_counter() - start:6.0f}s] {job.key}: val {summary.final_val_loss:.4f}"
             f"{' DIVERGED' if failed(summary) else ''}"
             f"{f' spikes at {spikes(summary.train_losses)}' if spikes(summary.train_losses) else ''}"
             f"{'' if summary.accuracy is None else f' accuracy {summary.accuracy:.3f}'}")

    from megatron_siamese.runtime.job import job_world_size

    # spawned here, runs go `workers` at a time; a launched job (one rank) runs them in turn
    with ThreadPoolExecutor(max_workers=plan.workers if job_world_size() is None else 1) as pool:
        list(pool.map(run, jobs_of(plan)))
    from megatron_siamese.data.corpus import embedded_corpus, unigram_entropy

    study = {"plan": {k: v for k, v in dataclasses.asdict(plan).items() if k != "base"},
             "base": dataclasses.asdict(plan.base), "runs": results,
             "unigram_entropy": unigram_entropy(embedded_corpus(plan.cache_dir)),
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


def _summary_from(d: dict) -> RunSummary:
    summary = RunSummary(args=d["args"], steps_done=d["steps_done"])
    summary.val_losses = {int(k): v for k, v in d["val_losses"].items()}
    summary.train_losses = {int(k): v for k, v in d["train_losses"].items()}
    summary.diverged, summary.accuracy = d["diverged"], d["accuracy"]
    return summary


def _cell(summaries: List[RunSummary], entropy: float) -> str:
    ok = [s.final_val_loss for s in summaries if not failed(s)]
    cell = f"{statistics.mean(ok):.3f} ± {statistics.stdev(ok) if len(ok) > 1 else 0:.3f}" if ok else "-"
    marks = [(len(summaries) - len(ok), "diverged"), (sum(stuck(s, entropy) for s in summaries), "stuck"),
             (sum(bool(spikes(s.train_losses)) for s in summaries), "spiked")]
    return cell + "".join(f" ({count} {what})" for count, what in marks if count)


def _panel(study: dict, warmup: int, arms: Tuple[str, ...], rates: Tuple[float, ...]) -> List[str]:
    entropy = study["unigram_entropy"]
    lines = ["| scheme | " + " | ".join(f"lr {lr:g}" for lr in rates) + " |", "| --- |" + " --- |" * len(rates)]
    seeds = ["| scheme | " + " | ".join(f"lr {lr:g}" for lr in rates) + " |", "| --- |" + " --- |" * len(rates)]
    for arm in arms:
        by_rate = [[_summary_from(r) for r in _runs(study, "lm", arm, lr, warmup)] for lr in rates]
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
            summaries = [_summary_from(r) for r in _runs(study, "lm", arm, lr, warmup)]
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
             f"within {STUCK_MARGIN} of the corpus's unigram entropy, {entropy:.3f}) or spiked (the training "
             f"loss rose more than {SPIKE_MARGIN} above its lowest so far).", ""]
    for warmup, arms, rates, seeds in _panels(plan):
        lines += [f"### Warmup {warmup} steps (seeds {', '.join(map(str, seeds))})", ""]
        lines += _panel(study, warmup, arms, rates) + [""] + stability(study, warmup, arms, rates) + [""]
    lines += [f"{plan['arithmetic_task']} of up to {plan['arithmetic_digits']}-digit numbers (exact match "
              f"on 500 held-out problems, lr {plan['arithmetic_lr']:g}, {plan['arithmetic_steps']} steps):", "",
              "| scheme | accuracy per seed | mean | final val loss |", "| --- | --- | --- | --- |"]
    for arm in plan["arithmetic_schemes"]:
        summaries = [_summary_from(r) for r in _runs(study, plan["arithmetic_task"], arm)]
        accuracies = [s.accuracy for s in summaries if s.accuracy is not None]
        lines.append(f"| {arm} | {', '.join(f'{a:.3f}' for a in accuracies)} | "
                     f"{statistics.mean(accuracies) if accuracies else float('nan'):.3f} | "
                     f"{statistics.mean(s.final_val_loss for s in summaries):.3f} |")
    lines += ["", f"Wall time: {study['seconds'] / 60:.1f} min."]
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
                    losses = _summary_from(run).train_losses
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

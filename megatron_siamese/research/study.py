"""``megatron-siamese study``: a small, reproducible comparison of residual schemes.

Language modelling on the embedded corpus: Pre-Norm, Post-Norm, SiameseNorm and its hybrid
variant, at three peak learning rates from ordinary to aggressive, three seeds each, with
little warmup; then synthetic multi-digit addition (exact-match accuracy) for Pre-Norm vs
SiameseNorm. Every run uses the same model size, data order per seed, schedule and budget;
runs go two at a time (one CPU core each). Writes ``<output_dir>/study.json``, the plots and
``<output_dir>/results.md`` (a table a person then reads and interprets in docs/results.md).
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

from megatron_siamese.model_names import SCHEME_NAMES
from megatron_siamese.training.args import TrainArgs
from megatron_siamese.training.summary import RunSummary

SCHEMES = SCHEME_NAMES  # any scheme the trainer builds may be studied; StudyPlan.schemes picks four


@dataclasses.dataclass
class StudyPlan:
    output_dir: str = "runs/study"
    cache_dir: str = ".cache/megatron_siamese"
    schemes: Tuple[str, ...] = ("pre", "post", "siamese", "siamese-hybrid")
    learning_rates: Tuple[float, ...] = (1e-3, 4e-3, 1.6e-2)
    seeds: Tuple[int, ...] = (1, 2, 3)
    arithmetic_schemes: Tuple[str, ...] = ("pre", "siamese")
    arithmetic_task: str = "addition-reversed"  # a trainer task (training/addition.py)
    arithmetic_digits: int = 2
    arithmetic_lr: float = 2e-3
    arithmetic_steps: int = 1500
    workers: int = 2
    base: TrainArgs = dataclasses.field(default_factory=lambda: TrainArgs(
        tp=1, num_layers=8, hidden_size=96, num_attention_heads=4, seq_length=128,
        micro_batch_size=16, global_batch_size=16, steps=200, warmup_steps=10, eval_interval=50,
        eval_iters=4, progress=False, normalization="LayerNorm",
    ))


def _args(plan: StudyPlan, scheme: str, lr: float, seed: int, task: str) -> TrainArgs:
    name = f"{task}-{scheme}-lr{lr:g}-seed{seed}"
    changes = dict(norm=scheme, lr=lr, min_lr=lr / 10, seed=seed, task=task,
                   cache_dir=plan.cache_dir, output_dir=os.path.join(plan.output_dir, name))
    if task != "lm":
        changes.update(steps=plan.arithmetic_steps, seq_length=64, addition_digits=plan.arithmetic_digits,
                       eval_interval=max(1, plan.arithmetic_steps // 3),
                       warmup_steps=min(plan.base.warmup_steps, plan.arithmetic_steps - 1))
    return dataclasses.replace(plan.base, **changes)


def failed(summary: RunSummary, vocabulary: int = 320) -> bool:
    """Diverged: a non-finite loss, or ending no better than a uniform guess."""
    final = summary.final_val_loss
    return summary.diverged or not math.isfinite(final) or final > math.log(vocabulary)


STUCK_MARGIN = 0.1  # nats per token


def stuck(summary: RunSummary, unigram_entropy: float) -> bool:
    """Trained but never got past token frequencies: within STUCK_MARGIN of the corpus's
    unigram entropy (Post-Norm's typical failure)."""
    return not failed(summary) and summary.final_val_loss > unigram_entropy - STUCK_MARGIN


def run_study(plan: StudyPlan, echo=print) -> dict:
    unknown = sorted(set(plan.schemes + plan.arithmetic_schemes) - set(SCHEMES))
    if unknown:
        raise ValueError(f"unknown schemes {unknown}: choose from {', '.join(SCHEMES)}")
    jobs = [(scheme, lr, seed, "lm") for scheme in plan.schemes for lr in plan.learning_rates
            for seed in plan.seeds]
    jobs += [(scheme, plan.arithmetic_lr, seed, plan.arithmetic_task) for scheme in plan.arithmetic_schemes
             for seed in plan.seeds]
    results: Dict[str, dict] = {}
    start = time.perf_counter()

    from megatron_siamese.training.trainer import train

    def run(job):
        scheme, lr, seed, task = job
        summary = train(_args(plan, scheme, lr, seed, task))
        key = f"{task}|{scheme}|{lr:g}|{seed}"
        results[key] = dataclasses.asdict(summary)
        echo(f"[{time.perf_counter() - start:6.0f}s] {key}: val {summary.final_val_loss:.4f}"
             f"{' DIVERGED' if failed(summary) else ''}"
             f"{'' if summary.accuracy is None else f' accuracy {summary.accuracy:.3f}'}")

    from megatron_siamese.runtime.job import job_world_size

    # spawned here, runs go `workers` at a time; a launched job (one rank) runs them in turn
    with ThreadPoolExecutor(max_workers=plan.workers if job_world_size() is None else 1) as pool:
        list(pool.map(run, jobs))
    from megatron_siamese.training.corpus import embedded_corpus, unigram_entropy

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


def _runs(study: dict, task: str, scheme: str, lr: Optional[float] = None) -> List[dict]:
    return [r for key, r in study["runs"].items()
            if key.split("|")[0] == task and key.split("|")[1] == scheme
            and (lr is None or float(key.split("|")[2]) == lr)]


def _summary_from(d: dict) -> RunSummary:
    summary = RunSummary(args=d["args"], steps_done=d["steps_done"])
    summary.val_losses = {int(k): v for k, v in d["val_losses"].items()}
    summary.train_losses = {int(k): v for k, v in d["train_losses"].items()}
    summary.diverged, summary.accuracy = d["diverged"], d["accuracy"]
    return summary


def tables(study: dict) -> str:
    plan = study["plan"]
    entropy = study["unigram_entropy"]
    lines = ["Final validation loss (nats per byte), mean ± std over seeds that did not diverge; "
             "diverged runs counted separately; stuck: ended within "
             f"{STUCK_MARGIN} of the corpus's unigram entropy ({entropy:.3f}).", "",
             "| scheme | " + " | ".join(f"lr {lr:g}" for lr in plan["learning_rates"]) + " |",
             "| --- |" + " --- |" * len(plan["learning_rates"])]
    for scheme in plan["schemes"]:
        cells = []
        for lr in plan["learning_rates"]:
            summaries = [_summary_from(r) for r in _runs(study, "lm", scheme, lr)]
            ok = [s.final_val_loss for s in summaries if not failed(s)]
            bad = len(summaries) - len(ok)
            cell = (f"{statistics.mean(ok):.3f} ± {statistics.stdev(ok) if len(ok) > 1 else 0:.3f}"
                    if ok else "-")
            stalled = sum(stuck(s, entropy) for s in summaries)
            cells.append(cell + (f" ({bad} diverged)" if bad else "") + (f" ({stalled} stuck)" if stalled else ""))
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    lines += ["", f"{plan['arithmetic_task']} of up to {plan['arithmetic_digits']}-digit numbers (exact match "
              f"on 500 held-out problems, lr {plan['arithmetic_lr']:g}, {plan['arithmetic_steps']} steps):", "",
              "| scheme | accuracy per seed | mean | final val loss |", "| --- | --- | --- | --- |"]
    for scheme in plan["arithmetic_schemes"]:
        summaries = [_summary_from(r) for r in _runs(study, plan["arithmetic_task"], scheme)]
        accuracies = [s.accuracy for s in summaries if s.accuracy is not None]
        lines.append(f"| {scheme} | {', '.join(f'{a:.3f}' for a in accuracies)} | "
                     f"{statistics.mean(accuracies) if accuracies else float('nan'):.3f} | "
                     f"{statistics.mean(s.final_val_loss for s in summaries):.3f} |")
    lines += ["", f"Wall time: {study['seconds'] / 60:.1f} min."]
    return "\n".join(lines) + "\n"


def plot(study: dict, directory: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan = study["plan"]
    figure, axes = plt.subplots(1, len(plan["learning_rates"]), figsize=(5 * len(plan["learning_rates"]), 4),
                                sharey=True, squeeze=False)
    axes = axes[0]
    for axis, lr in zip(axes, plan["learning_rates"]):
        for scheme in plan["schemes"]:
            color = None
            for run in _runs(study, "lm", scheme, lr):
                losses = _summary_from(run).train_losses
                steps = sorted(losses)
                line, = axis.plot(steps, [losses[k] for k in steps], color=color, alpha=0.5,
                                  label=None if color else scheme)
                color = line.get_color()
        axis.set_title(f"peak lr {lr:g}")
        axis.set_xlabel("step")
        axis.set_ylim(1.0, 6.5)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("training loss (nats per byte)")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(os.path.join(directory, "study_curves.png"), dpi=110)
    plt.close(figure)

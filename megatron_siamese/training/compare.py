"""``train --compare``: the same run under several residual schemes, side by side.

Every scheme gets identical data, seed, model size, schedule and layout; only ``norm``
differs. Prints a table (final train and validation loss, tokens/s, peak memory) and writes
the loss curves to ``<output_dir>/compare.png`` and the summaries to ``compare.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, List, Optional

from megatron_siamese.training.args import TrainArgs
from megatron_siamese.training.summary import RunSummary


def run_comparison(args: TrainArgs, norms: List[str]) -> Dict[str, RunSummary]:
    from megatron_siamese.training.trainer import train

    summaries = {}
    for norm in norms:
        summaries[norm] = train(
            dataclasses.replace(args, norm=norm, output_dir=os.path.join(args.output_dir, norm))
        )
    return summaries


def format_table(summaries: Dict[str, RunSummary]) -> str:
    lines = [f"{'norm':<14} {'train loss':>10} {'val loss':>9} {'tokens/s':>9} {'peak MB/rank':>12}"]
    for norm, s in summaries.items():
        lines.append(f"{norm:<14} {s.final_train_loss:>10.4f} {s.final_val_loss:>9.4f} {s.tokens_per_second:>9.0f} "
                     f"{s.peak_memory_mb:>12.0f}")
    return "\n".join(lines)


def plot(summaries: Dict[str, RunSummary], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for norm, s in summaries.items():
        steps = sorted(s.train_losses)
        line, = axis.plot(steps, [s.train_losses[k] for k in steps], alpha=0.6, label=f"{norm} train")
        val_steps = sorted(s.val_losses)
        axis.plot(val_steps, [s.val_losses[k] for k in val_steps], "o-", color=line.get_color(),
                  label=f"{norm} validation")
    axis.set_xlabel("step")
    axis.set_ylabel("loss (nats per byte)")
    axis.set_title("Identical data, seed and budget")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def compare(args: TrainArgs, norms: List[str]) -> Optional[str]:
    """The table (and the plot and JSON written); None on the ranks of a launched job but rank 0."""
    summaries = run_comparison(args, norms)
    if any(summary is None for summary in summaries.values()):
        return None
    os.makedirs(args.output_dir, exist_ok=True)
    plot(summaries, os.path.join(args.output_dir, "compare.png"))
    with open(os.path.join(args.output_dir, "compare.json"), "w") as out:
        json.dump({k: dataclasses.asdict(v) for k, v in summaries.items()}, out, indent=1)
    return format_table(summaries) + f"\nloss curves: {os.path.join(args.output_dir, 'compare.png')}"

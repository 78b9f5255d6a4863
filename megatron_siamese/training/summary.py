"""What a run reports: losses by step, checkpoints, throughput (plain data, for the trainer,
``--compare``, the study and the command line)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

BUSIEST = "busiest_expert_load"  # a router statistic: the busiest expert's tokens / the mean (router_stats.py)


@dataclass
class RunSummary:
    args: dict
    steps_done: int
    train_losses: Dict[int, float] = field(default_factory=dict)  # step -> loss
    val_losses: Dict[int, float] = field(default_factory=dict)  # step -> loss
    checkpoints: List[str] = field(default_factory=list)
    # mixture of experts: step -> its router statistics (training/router_stats.py: Megatron's aux
    # losses by their names, busiest_expert_load)
    router_stats: Dict[int, Dict[str, float]] = field(default_factory=dict)
    diverged: bool = False  # a non-finite training loss stopped the run
    stopped: bool = False  # a stop signal, --exit-interval or --exit-duration-in-mins stopped it (after saving)
    stop_reason: Optional[str] = None  # what stopped it: "SIGTERM", "--exit-interval 10", ...
    resumed_from: Optional[int] = None  # the step of the checkpoint it started from
    accuracy: Optional[float] = None  # exact match on held-out problems (task=addition)
    tokens_per_second: float = 0.0
    peak_memory_mb: float = 0.0
    seconds: float = 0.0

    def write(self, path: str) -> None:
        """As JSON (steps as keys), replacing any summary an earlier run left there."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path + ".tmp", "w") as out:
            json.dump(asdict(self), out, indent=1)
        os.replace(path + ".tmp", path)

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


def shown(losses: Dict[int, float], digits: int = 4) -> str:
    return f"{_last(losses):.{digits}f}" if losses else "-"


def format_summary(summary: RunSummary) -> str:
    if not summary.train_losses and not summary.diverged:  # a loaded checkpoint, evaluated as it is
        return (f"norm={summary.args['norm']}: evaluated the checkpoint at step {summary.steps_done} (no steps "
                f"left to train): val loss {shown(summary.val_losses)}")
    lines = [
        f"norm={summary.args['norm']} steps={summary.steps_done} "
        f"layout=tp{summary.args['tp']} pp{summary.args['pp']}"
        + (f" cp{summary.args['cp']}" if summary.args.get("cp", 1) > 1 else "") + f" dp{summary.args['dp']}"
        + (f" ep{summary.args['ep']}" if summary.args.get("ep", 1) > 1 else "")
        + (" sp" if summary.args.get("sp") else "")
        + (" torch-fsdp2" if summary.args.get("use_torch_fsdp2") else "")
        + (f" megatron-fsdp {summary.args.get('data_parallel_sharding_strategy')}"
           if summary.args.get("use_megatron_fsdp") else ""),
        f"final train loss {shown(summary.train_losses)}  final val loss {shown(summary.val_losses)}",
        f"{summary.tokens_per_second:.0f} tokens/s  peak memory {summary.peak_memory_mb:.0f} MB/rank  "
        f"wall {summary.seconds:.0f}s",
    ]
    if summary.router_stats:
        lines.append(router_line(summary.router_stats))
    if summary.diverged:
        lines.append(f"DIVERGED: non-finite training loss at step {max(summary.train_losses)}")
    if summary.accuracy is not None:
        lines.append(f"exact-match accuracy on held-out problems: {summary.accuracy:.3f}")
    return "\n".join(lines)


def router_line(stats: Dict[int, Dict[str, float]]) -> str:
    """The routers at the last step, and the highest busiest-expert load of the run."""
    last = max(stats)
    shown_stats = ", ".join(f"{name} {value:.4f}" for name, value in stats[last].items() if name.endswith("loss"))
    line = f"router at step {last}: {shown_stats or 'no auxiliary loss'}"
    loads = {step: values[BUSIEST] for step, values in stats.items() if BUSIEST in values}
    if loads:
        peak = max(loads, key=loads.get)
        line += (f"; busiest expert {stats[last].get(BUSIEST, float('nan')):.2f}x the mean load "
                 f"(highest {loads[peak]:.2f}x at step {peak})")
    return line

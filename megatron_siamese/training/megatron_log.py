"""Megatron-LM's log lines, in its own format (``training_log`` and
``evaluate_and_print_results`` in megatron/training/training.py), so that the tools and habits
built around Megatron-LM's logs read ours:

     [2026-12-01 16:20:03.123456] iteration      100/     300 | consumed samples:         1600 | ...
    -----------------------------------------------------------------------------------------
     validation loss at iteration 100 | lm loss value: 2.178021E+00 | lm loss PPL: 8.828690E+00 |
    -----------------------------------------------------------------------------------------

One addition: ``throughput (tokens/s)`` after the time per iteration (where Megatron-LM puts
its optional TFLOP/s), the number our CPU and GPU measurements quote. A mixture-of-experts run's
router statistics follow the lm loss, averaged like it: Megatron-LM's tracked losses
(``load_balancing_loss: 1.000213E+00 |``, ``z_loss``) and the busiest expert's load relative to
the mean (``busiest_expert_load: 1.23 |``, in megatron-core 0.19's format for MoE scalars that
are not losses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Dict, List, Mapping, Optional

PPL_CAP = 20.0  # Megatron-LM caps the exponent: exp(20) for any loss above it


@dataclass
class Interval:
    """The steps since the last iteration line: Megatron-LM averages the loss over the steps
    that updated the weights, and counts those it skipped (fp16 overflow) or found non-finite."""

    iterations: int = 0
    advanced: int = 0
    skipped: int = 0
    nan: int = 0
    loss_sum: float = 0.0
    seconds: float = 0.0
    router_sums: Dict[str, float] = field(default_factory=dict)  # MoE: router statistic -> sum

    def add(self, loss: float, seconds: float, skipped: bool, router: Optional[Mapping[str, float]] = None) -> None:
        self.iterations += 1
        self.seconds += seconds
        self.skipped += int(skipped)
        self.nan += int(not math.isfinite(loss))  # the run stops on one that updated the weights
        if not skipped and math.isfinite(loss):
            self.advanced += 1
            self.loss_sum += loss
            for name, value in (router or {}).items():
                self.router_sums[name] = self.router_sums.get(name, 0.0) + value


def iteration_line(step: int, steps: int, consumed_samples: int, interval: Interval, lr: float,
                   global_batch_size: int, tokens_per_step: int, loss_scale: float, grad_norm: Optional[float],
                   now: Optional[datetime] = None) -> str:
    per_iteration = interval.seconds / max(interval.iterations, 1)
    line = f" [{(now or datetime.now()).strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    line += f" iteration {step:8d}/{steps:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {per_iteration * 1000.0:.1f} |"
    line += f" throughput (tokens/s): {tokens_per_step / per_iteration if per_iteration else 0.0:.0f} |"
    line += f" learning rate: {lr:.6E} |"
    line += f" global batch size: {global_batch_size:5d} |"
    if interval.advanced:
        line += f" lm loss: {interval.loss_sum / interval.advanced:.6E} |"
        for name, total in interval.router_sums.items():
            average = total / interval.advanced
            line += f" {name}: {average:.6E} |" if name.endswith("loss") else f" {name}: {average:.2f} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += f" number of skipped iterations: {interval.skipped:3d} |"
    line += f" number of nan iterations: {interval.nan:3d} |"
    return line


def perplexity(loss: float) -> float:
    return math.exp(min(PPL_CAP, loss))


def validation_lines(step: int, loss: float) -> List[str]:
    """The validation result between two rules, as Megatron-LM prints it."""
    text = f" validation loss at iteration {step} | lm loss value: {loss:.6E} | lm loss PPL: {perplexity(loss):.6E} | "
    rule = "-" * (len(text) + 1)
    return [rule, text, rule]

"""What a run tells while it trains, from rank 0: the training loop calls one ``RunLog`` per
step, evaluation and save.

On the console, either the progress bar or Megatron-LM's log lines (``megatron_log.py``):

- no flag: the bar when stdout is a terminal; otherwise (a batch job's log file, a pipe) the
  lines every min(100, steps/10) steps (Megatron-LM's 100, and at least ten lines in a
  shorter run);
- ``--log-interval N`` alone: the lines every N steps, on a terminal too;
- ``--progress``: the bar, also in a file (with ``--log-interval N``, the lines above it);
- ``--no-progress``: no bar; the lines only with ``--log-interval N``, else quiet (the
  summary alone: what the study's runs use).

Lines mode also prints a validation line per evaluation and a line per checkpoint saved; the
status lines (where checkpoints go, a resume) come with either. Whatever the console shows,
rank 0 writes OUTPUT_DIR/settings.json before the first step, OUTPUT_DIR/metrics.jsonl every
step (``metrics.py``), TensorBoard and wandb scalars when asked (``scalar_loggers.py``), and
OUTPUT_DIR/loss.png at the end (``loss_plot.py``).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

from megatron_siamese.training import loss_plot, megatron_log, metrics, run_settings, scalar_loggers
from megatron_siamese.training.args import TrainArgs
from megatron_siamese.training.summary import BUSIEST

MEGATRON_LOG_INTERVAL = 100  # Megatron-LM's --log-interval default


def default_log_interval(steps: int) -> int:
    """Megatron-LM's 100 steps, and at least ten lines in a shorter run."""
    return max(1, min(MEGATRON_LOG_INTERVAL, steps // 10))


@dataclass(frozen=True)
class Console:
    bar: bool
    log_interval: Optional[int]  # None: no log lines

    @property
    def status_lines(self) -> bool:
        """Whether the status lines are printed (anything but --no-progress alone)."""
        return self.bar or self.log_interval is not None


def console(args: TrainArgs, stdout_is_terminal: bool) -> Console:
    """The table above."""
    bar = args.progress is True or (args.progress is None and stdout_is_terminal and args.log_interval is None)
    if args.log_interval:
        return Console(bar, args.log_interval)
    return Console(bar, default_log_interval(args.steps) if args.progress is None and not bar else None)


def _stdout_is_terminal() -> bool:
    try:
        return os.isatty(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # a replaced stdout (pytest's capture, a StringIO)
        return False


class RunLog:
    """The run's logs; on ranks other than the one that speaks for the job, every call does nothing."""

    def __init__(self, args: TrainArgs, resumed_at: int, speaks: bool):
        self.args, self.speaks = args, speaks
        self.console = console(args, _stdout_is_terminal())
        self.tokens_per_step = args.global_batch_size * args.seq_length
        self.interval = megatron_log.Interval()
        self.last_val: Optional[float] = None
        self.bar = None
        self.metrics: Optional[metrics.MetricsFile] = None
        self.sinks: List = []
        if not speaks:
            return
        run_settings.write(args, os.path.join(args.output_dir, run_settings.SETTINGS_FILE))
        self.metrics = metrics.MetricsFile(os.path.join(args.output_dir, metrics.METRICS_FILE), resumed_at)
        if args.tensorboard_dir:
            self.sinks.append(scalar_loggers.TensorBoard(args.tensorboard_dir, resumed_at))
        if args.wandb_project:
            self.sinks.append(scalar_loggers.Wandb(args, asdict(args)))
        atexit.register(self._close_files)  # a run that ends in an exception still leaves its files whole

    # -- the console ---------------------------------------------------------------------

    def echo(self, line: str) -> None:
        """A status line (where checkpoints go, a resume): above the bar when there is one."""
        if self.speaks and self.console.status_lines:
            self._print(line)

    def begin(self, step: int) -> None:
        """Training starts at ``step``: the bar appears."""
        if self.speaks and self.console.bar:
            from tqdm import tqdm

            self.bar = tqdm(total=self.args.steps, initial=step, desc=self.args.norm, dynamic_ncols=True)

    # -- what the loop reports -----------------------------------------------------------

    def step(self, step: int, stats: Dict[str, float], seconds: float) -> None:
        """Step ``step`` took ``seconds``: ``stats`` holds its loss, lr, grad_norm, and
        loss_scale, skipped and (MoE) router and (MTP) mtp where the trainer reports them."""
        if not self.speaks:
            return
        loss, lr, grad_norm = stats["loss"], stats["lr"], stats["grad_norm"]
        loss_scale, skipped = float(stats.get("loss_scale", 1.0)), bool(stats.get("skipped", False))
        router = {name: value for name, value in stats.get("router", {}).items() if metrics.finite(value) is not None}
        # Megatron-LM's other tracked losses: multi-token prediction's, beside the routers'
        tracked = {**router, **{name: value for name, value in stats.get("mtp", {}).items()
                                if metrics.finite(value) is not None}}
        consumed = step * self.args.global_batch_size
        self.metrics.write(dict(step=step, consumed_samples=consumed, loss=metrics.finite(loss), lr=lr,
                                grad_norm=metrics.finite(grad_norm), loss_scale=loss_scale, skipped=skipped,
                                seconds=seconds, tokens_per_second=self.tokens_per_step / seconds if seconds else 0.0,
                                **tracked, time=time.time()))
        scalars = {"learning-rate": lr, "batch-size": self.args.global_batch_size, "loss-scale": loss_scale,
                   "iteration-time": seconds}
        if metrics.finite(loss) is not None:
            scalars["lm loss"] = loss
        if metrics.finite(grad_norm) is not None:
            scalars["grad-norm"] = grad_norm
        scalars.update(tracked)  # Megatron-LM's names: load_balancing_loss, z_loss, mtp_1 loss, ...
        for sink in self.sinks:
            sink.log(scalars, step, consumed)
        self.interval.add(loss, seconds, skipped, tracked)
        every = self.console.log_interval
        if every and (step % every == 0 or metrics.finite(loss) is None):
            self._print(megatron_log.iteration_line(step, self.args.steps, consumed, self.interval, lr,
                                                    self.args.global_batch_size, self.tokens_per_step, loss_scale,
                                                    grad_norm))
            self.interval = megatron_log.Interval()
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", gnorm=f"{grad_norm:.2f}",
                                 tok_s=f"{self.tokens_per_step / seconds if seconds else 0.0:.0f}",
                                 val="-" if self.last_val is None else f"{self.last_val:.3f}",
                                 **router_postfix(router),
                                 refresh=False)  # update() redraws it, once per step at most
            self.bar.update(1)

    def evaluated(self, step: int, loss: float) -> None:
        if not self.speaks:
            return
        self.last_val = loss
        consumed = step * self.args.global_batch_size
        self.metrics.write_validation(dict(step=step, consumed_samples=consumed, val_loss=metrics.finite(loss),
                                           val_ppl=metrics.finite(megatron_log.perplexity(loss)), time=time.time()))
        if metrics.finite(loss) is not None:
            for sink in self.sinks:
                sink.log({"lm loss validation": loss}, step, consumed)
        if self.console.log_interval:
            for line in megatron_log.validation_lines(step, loss):
                self._print(line)

    def saved(self, path: str) -> None:
        if self.bar is None:
            self.echo(f"saved {path}")

    def close(self) -> None:
        """The end of the run: the bar closes, the files are complete and loss.png is drawn."""
        if not self.speaks:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._close_files()
        loss_plot.plot(os.path.join(self.args.output_dir, metrics.METRICS_FILE),
                       os.path.join(self.args.output_dir, loss_plot.PLOT_FILE),
                       f"{self.args.norm}: {self.args.output_dir}")

    def _print(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:  # through the launcher that spawned the ranks (its stdout), or ours in a launched job
            from megatron_siamese.runtime.job import console

            console(line)

    def _close_files(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        atexit.unregister(self._close_files)



# the progress bar's short names for the router statistics (training/router_stats.py)
ROUTER_POSTFIX = {"load_balancing_loss": "aux", "seq_load_balancing_loss": "seq_aux",
                  "global_load_balancing_loss": "global_aux", "z_loss": "z", BUSIEST: "max_load"}


def router_postfix(router: Dict[str, float]) -> Dict[str, str]:
    """A step's router statistics on the progress bar: aux=1.002 max_load=1.31x."""
    return {ROUTER_POSTFIX.get(name, name): f"{value:.3f}" if name.endswith("loss") else f"{value:.2f}x"
            for name, value in router.items()}


def results_line(args: TrainArgs, summary) -> str:
    """Where the run left its results (the command line's last line)."""
    files = [run_settings.SETTINGS_FILE, metrics.METRICS_FILE, loss_plot.PLOT_FILE, "summary.json"]
    if summary.checkpoints:
        files.append(f"checkpoints/ (last: {os.path.basename(summary.checkpoints[-1])})")
    line = f"results in {args.output_dir}: {', '.join(files)}"
    if args.tensorboard_dir:
        line += f"; TensorBoard: {args.tensorboard_dir}"
    return line

"""OUTPUT_DIR/loss.png: the training loss of every step and the validation losses, drawn from
the run's metrics file (so a resumed run's plot shows the whole run)."""

from __future__ import annotations

from megatron_siamese.runtime.loss_curve import draw
from megatron_siamese.training import metrics

PLOT_FILE = "loss.png"


def plot(metrics_path: str, path: str, title: str) -> None:
    entries = metrics.read(metrics_path)
    train = [(e["step"], e["loss"]) for e in entries if e.get("loss") is not None]
    valid = [(e["step"], e["val_loss"]) for e in entries if e.get("val_loss") is not None]
    draw({"": (train, valid)}, path, title)

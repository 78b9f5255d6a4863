"""OUTPUT_DIR/loss.png: the training loss of every step and the validation losses, drawn from
the run's metrics file (so a resumed run's plot shows the whole run)."""

from __future__ import annotations

import os

from megatron_siamese.training import metrics

PLOT_FILE = "loss.png"


def plot(metrics_path: str, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = metrics.read(metrics_path)
    train = [(e["step"], e["loss"]) for e in entries if e.get("loss") is not None]
    valid = [(e["step"], e["val_loss"]) for e in entries if e.get("val_loss") is not None]
    figure, axis = plt.subplots(figsize=(7, 4.5))
    if train:
        axis.plot(*zip(*train), alpha=0.7, label="train")
    if valid:
        axis.plot(*zip(*valid), "o-", label="validation")
    axis.set_xlabel("step")
    axis.set_ylabel("loss (nats per token)")
    axis.set_title(title)
    if train or valid:
        axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path + ".tmp", dpi=120, format="png")  # a reader never sees half a file
    plt.close(figure)
    os.replace(path + ".tmp", path)

"""The end-of-run loss curve of Megatron's loop, drawn from the TensorBoard events under
``--tensorboard-dir``; every event file read in order, so a resumed run's curve is the whole run's.
"""

from __future__ import annotations

import glob
import os
from typing import Dict, Sequence, Tuple

PLOT_FILE = "loss.png"
TRAIN_TAG, VALIDATION_TAG = "lm loss", "lm loss validation"


def read_losses(directory: str) -> Tuple[Dict[int, float], Dict[int, float]]:
    """(train, validation) losses by iteration (``read_scalars``)."""
    curves = read_scalars(directory, TRAIN_TAG, VALIDATION_TAG)
    return curves[TRAIN_TAG], curves[VALIDATION_TAG]


def read_scalars(directory: str, *tags: str) -> Dict[str, Dict[int, float]]:
    """Each tag's values by iteration over the event files in order: a later (resumed) file replaces every
    point from the first iteration it trains at (the first tag's); one that only evaluated (a requeue with
    nothing left to train) adds the points not there yet (its evaluation after training is another one than
    the loop's at that iteration). Within a file the first value of an iteration is kept: Megatron logs the
    validation and then the test set under the validation tag."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util.tensor_util import make_ndarray

    curves: Dict[str, Dict[int, float]] = {tag: {} for tag in tags}
    # event file names hold their creation time: in name order, a resumed run's come last
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        found: Dict[str, Dict[int, float]] = {tag: {} for tag in tags}
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                if value.tag in found:  # the loader gives scalars as tensors
                    found[value.tag].setdefault(event.step, float(make_ndarray(value.tensor)))
        start = min(found[tags[0]], default=None)
        for tag in curves:
            if start is None:
                curves[tag] = found[tag] | curves[tag]
            else:
                curves[tag] = {step: value for step, value in curves[tag].items() if step < start} | found[tag]
    return curves


Curve = Sequence[Tuple[int, float]]  # (step, loss) in step order


def last_logged(train: Dict[int, float], log_interval: int) -> Tuple[str, float]:
    """The training loss Megatron's last log line gives, and the iterations it averaged ("11-20", or "25"
    for one): the mean since the line before (it logs every --log-interval iterations; TensorBoard holds
    each iteration's own), or over those there are where none was logged."""
    last = max(train)
    logged = last - last % log_interval or last
    window = [step for step in train if logged - log_interval < step <= logged]
    iterations = f"{min(window)}-{logged}" if len(window) > 1 else str(logged)
    return iterations, sum(train[step] for step in window) / len(window)


def draw(curves: Dict[str, Tuple[Curve, Curve]], path: str, title: str) -> None:
    """Each run's (train, validation) losses by step, one colour a run (named in the legend where
    there are several), as a PNG written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, (train, validation) in curves.items():
        prefix = f"{name} " if name else ""
        colour = None
        if train:
            (line,) = axis.plot(*zip(*train), alpha=0.7, label=prefix + "train")
            colour = line.get_color()
        if validation:
            axis.plot(*zip(*validation), "o-", color=colour, label=prefix + "validation")
    axis.set_xlabel("step")
    axis.set_ylabel("loss (nats per token)")
    axis.set_title(title)
    if any(train or validation for train, validation in curves.values()):
        axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path + ".tmp", dpi=120, format="png")  # a reader never sees half a file
    plt.close(figure)
    os.replace(path + ".tmp", path)


def plot_run(directory: str, title: str) -> Tuple[str, Dict[int, float], Dict[int, float]]:
    """``directory/loss.png`` from the run's events: (its path, the train and validation losses drawn)."""
    train, validation = read_losses(directory)
    path = os.path.join(directory, PLOT_FILE)
    draw({"": (sorted(train.items()), sorted(validation.items()))}, path, title)
    return path, train, validation

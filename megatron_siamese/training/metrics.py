"""OUTPUT_DIR/metrics.jsonl: one JSON object per line, written by rank 0 as the run goes and
flushed line by line (a job killed at any moment keeps every step it logged).

A training step: ``{"step", "consumed_samples", "loss", "lr", "grad_norm", "loss_scale",
"skipped", "seconds", "tokens_per_second", "time"}``, and a mixture-of-experts run's router
statistics (``load_balancing_loss``, ``z_loss``, ``busiest_expert_load``: router_stats.py)
before ``time``; an evaluation: ``{"step",
"consumed_samples", "val_loss", "val_ppl", "time"}`` (``time``: Unix seconds; a non-finite
loss is ``null``). A resumed run appends to the file after dropping what the interrupted run
logged past the checkpoint it resumes (those steps are run again), so every step appears once.
"""

from __future__ import annotations

import json
import math
import os
from typing import Dict, Iterator, List, Optional

METRICS_FILE = "metrics.jsonl"


def read(path: str) -> List[dict]:
    """The entries of a metrics file, in order; a line cut short by a kill is left out."""
    return list(_entries(path))


def _entries(path: str) -> Iterator[dict]:
    if not os.path.exists(path):
        return
    with open(path) as lines:
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and isinstance(entry.get("step"), int):
                yield entry


def finite(value: Optional[float]) -> Optional[float]:
    return value if value is not None and math.isfinite(value) else None


class MetricsFile:
    """The run's metrics file, opened for appending after the steps up to ``resumed_at`` (0: a
    new run, which starts it anew)."""

    def __init__(self, path: str, resumed_at: int):
        kept = [entry for entry in read(path) if entry["step"] <= resumed_at]
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path + ".tmp", "w") as out:
            out.writelines(json.dumps(entry) + "\n" for entry in kept)
        os.replace(path + ".tmp", path)
        self.path = path
        self.validated = {entry["step"] for entry in kept if "val_loss" in entry}
        self._out = open(path, "a")

    def write(self, entry: Dict) -> None:
        self._out.write(json.dumps(entry) + "\n")
        self._out.flush()

    def write_validation(self, entry: Dict) -> None:
        """An evaluation, unless the checkpoint's step was already evaluated before the resume."""
        if entry["step"] in self.validated:
            return
        self.validated.add(entry["step"])
        self.write(entry)

    def close(self) -> None:
        self._out.close()

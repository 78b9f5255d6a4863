"""OUTPUT_DIR/settings.json: every TrainArgs field of the run, written by rank 0 before its
first step, beside the checkpoints (what Megatron-LM keeps as its args); ``read`` gives the
TrainArgs back."""

from __future__ import annotations

import dataclasses
import json
import os

from megatron_siamese.training.args import TrainArgs

SETTINGS_FILE = "settings.json"


def write(args: TrainArgs, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as out:
        json.dump(dataclasses.asdict(args), out, indent=1)
        out.write("\n")
    os.replace(path + ".tmp", path)


def read(path: str) -> TrainArgs:
    """The TrainArgs a settings file holds (JSON lists back to the tuples the fields hold)."""
    with open(path) as source:
        values = json.load(source)
    return TrainArgs(**{key: tuple(value) if isinstance(value, list) else value for key, value in values.items()})

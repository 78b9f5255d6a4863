"""``megatron-siamese train --compare pre,siamese``: one Megatron-LM run per residual scheme, with the
same flags but ``--norm``, then a table of each run's last losses and their curves in one plot.
Each run's events (and checkpoints, with ``--save DIR``) go to ``DIR/<scheme>``.
"""

from __future__ import annotations

import os
import time
from typing import Callable, List, Optional

from megatron_siamese.runtime.pretrain_flags import flag_value

PLOT_FILE = "compare.png"
PER_RUN_FLAGS = ("--tensorboard-dir", "--save", "--load")  # each scheme's own directory below the given one


def without(flags: List[str], names) -> List[str]:
    """``flags`` without ``names`` and their values (``--flag value`` and ``--flag=value``)."""
    kept, skip = [], False
    for word in flags:
        if skip:
            skip = False
        elif word in names:
            skip = True
        elif word.split("=", 1)[0] not in names:
            kept.append(word)
    return kept


def problems(norms: List[str], flags: List[str]) -> List[str]:
    from megatron_siamese.model_names import SCHEME_NAMES

    found = [f"--compare {norm}: not a scheme ({', '.join(SCHEME_NAMES)})" for norm in norms if norm not in SCHEME_NAMES]
    if len(set(norms)) < 2:
        found.append(f"--compare {','.join(norms)}: name two schemes or more, e.g. pre,siamese")
    if flag_value(flags, "--norm") is not None:
        found.append("--compare sets --norm for each run: drop --norm")
    return found


def compare_schemes(norms: List[str], flags: List[str], start: Callable[[List[str]], int]) -> int:
    """Runs ``start(flags)`` once per scheme, then prints the table; the first failing run's status."""
    board = flag_value(flags, "--tensorboard-dir") or time.strftime("runs/compare-%Y%m%d-%H%M%S")
    directories = {flag: flag_value(flags, flag) for flag in PER_RUN_FLAGS}
    directories["--tensorboard-dir"] = board
    common = without(flags, PER_RUN_FLAGS)
    for norm in norms:
        own = [word for flag, directory in directories.items() if directory
               for word in (flag, os.path.join(directory, norm))]
        print(f"megatron-siamese train --compare: --norm {norm} ({' '.join(own)})", flush=True)
        status = start([*common, "--norm", norm, *own])
        if status:
            return status
    print(table(board, norms, int(flag_value(flags, "--log-interval") or LOG_INTERVAL)), flush=True)
    return 0


LOG_INTERVAL = 100  # Megatron-LM's --log-interval default


def table(board: str, norms: List[str], log_interval: int) -> str:
    """Each run's training loss as its last log line gave it (the mean since the line before), its last
    validation loss; the curves in one plot."""
    from megatron_siamese.runtime.loss_curve import draw, last_logged, read_losses

    curves = {norm: read_losses(os.path.join(board, norm)) for norm in norms}
    draw({norm: (sorted(train.items()), sorted(validation.items())) for norm, (train, validation) in curves.items()},
         os.path.join(board, PLOT_FILE), "Identical flags, data and seed")
    lines = [f"{'scheme':<14} {'iterations':>10} {'train loss':>10} {'validation':>10}"]
    for norm, (train, validation) in curves.items():
        iterations, mean = last_logged(train, log_interval) if train else ("-", None)
        lines.append(f"{norm:<14} {iterations:>10} {_loss(mean):>10} "
                     f"{_loss(validation[max(validation)] if validation else None):>10}")
    return "\n".join(lines + [f"loss curves: {os.path.join(board, PLOT_FILE)}"])


def _loss(value: Optional[float]) -> str:
    return f"{value:.4f}" if value is not None else "-"


def parse(text: str) -> List[str]:
    return [norm.strip() for norm in text.split(",") if norm.strip()]


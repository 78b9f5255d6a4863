"""What the GPU kit's measurement steps share: their command line, one rank of Megatron, timing.

Every step is a function ``step(rehearse: bool) -> dict`` in one of the step modules
(kernels.py, layers.py, training.py, te_parity.py), run by the driver as its own process:

    python bench/gpu/<module>.py <step> --result FILE [--rehearse]

so that a crash, a hang or a CUDA error in one step leaves the others running. The returned
dict (JSON-serializable) is the step's record. ``--rehearse`` is the CPU rehearsal: the same
code at tiny shapes on CPU where it can run there, and up to the first call that needs a GPU
where it cannot; its numbers are not measurements and the driver marks them so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the package under test is the working tree's
    sys.path.insert(0, str(ROOT))


RANK_TIMEOUT_S = 600.0  # the driver's per-step timeout ends a step sooner


class NeedsGPU(RuntimeError):
    """Raised in a rehearsal at the first call that needs a GPU: how far the step got."""


def require_gpu(rehearse: bool, what: str) -> None:
    """On a GPU machine: nothing. In a rehearsal: stop here, saying what would run next.
    Outside a rehearsal without a GPU: an error (a measurement must not run on CPU)."""
    import torch

    if torch.cuda.is_available():
        return
    if rehearse:
        raise NeedsGPU(what)
    raise RuntimeError(f"{what} needs a GPU and torch.cuda.is_available() is False")


def time_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median wall time of ``fn`` in milliseconds: CUDA events on a GPU, perf_counter on CPU."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - begin))
    return statistics.median(times)


def one_rank(fn: Callable, *args):
    """``fn(*args)`` on one fresh rank with Megatron's process groups at TP=PP=1 (NCCL on a
    GPU, gloo and the CPU shim on CPU: megatron_siamese.runtime.launch)."""
    from megatron_siamese.runtime.launch import RankFailed, launch

    try:
        return launch(_with_model_parallel, 1, fn, args, timeout_s=RANK_TIMEOUT_S)[0]
    except RankFailed as failure:
        if f"{NeedsGPU.__name__}: " in str(failure):  # a rehearsal stopping inside the rank
            raise NeedsGPU(str(failure).rsplit(f"{NeedsGPU.__name__}: ", 1)[1].strip()) from None
        raise


def _with_model_parallel(fn: Callable, args: tuple):
    from megatron_siamese.runtime.gpt import initialize_model_parallel
    from megatron_siamese.runtime.layout import Layout

    initialize_model_parallel(Layout(), seed=1234)
    try:
        return fn(*args)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()


def step_main(steps: Dict[str, Callable[[bool], dict]]) -> int:
    """The command line of a step module: run one step, write its record as JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("step", choices=sorted(steps))
    parser.add_argument("--result", required=True, type=Path)
    parser.add_argument("--rehearse", action="store_true")
    args = parser.parse_args()
    try:
        record = steps[args.step](args.rehearse)
    except NeedsGPU as stop:
        record = {"stopped_at_gpu": str(stop)}
    args.result.write_text(json.dumps(record, indent=1, sort_keys=True, default=str))
    return 0

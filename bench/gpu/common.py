"""What the GPU kit's measurement steps share: their command line, one rank of Megatron, timing.

Every step is a function ``step(rehearse: bool) -> dict`` in one of the step modules
(kernel_bench.py, layers.py, model_bench.py, training.py, te_parity.py), run by the driver as its
own process:

    python bench/gpu/<module>.py <step> --result FILE [--rehearse]

so that a crash, a hang or a CUDA error in one step leaves the others running. The returned
dict (JSON-serializable) is the step's record. ``--rehearse`` is the CPU rehearsal: the same
code at tiny shapes on CPU where it can run there, and up to the first call that needs a GPU
where it cannot; its numbers are not measurements and the driver marks them so.

The driver passes each step its deadline (``seconds_left``): a step that measures in a loop
stops starting new work before it, so what it measured is written instead of being killed
with the step. The fused ops come in two CUDA kernel generations (``GENERATIONS``), chosen by
an environment variable the C++ op reads on every call (``cuda_kernels``), so one process
measures both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the package under test is the working tree's
    sys.path.insert(0, str(ROOT))


RANK_TIMEOUT_S = 600.0  # the driver's per-step timeout ends a step sooner
DEADLINE_ENV = "GPU_KIT_STEP_DEADLINE"  # set by driver.py: the step's end, in time.time() seconds

# The CUDA kernel generations of the fused ops: "verified" (the default, run on a GPU before),
# "tiled" (chosen explicitly until the kit has passed every CUDA test with it; docs/kernels.md)
KERNELS_ENV = "MEGATRON_SIAMESE_CUDA_KERNELS"
GENERATIONS = ("verified", "tiled")

# Precisions as ModelSettings fields (FP8 needs transformer_impl="transformer_engine")
PRECISIONS = {
    "bf16": {},
    "fp8-delayed": dict(fp8="hybrid", fp8_recipe="delayed"),
    "fp8-tensorwise": dict(fp8="hybrid", fp8_recipe="tensorwise"),  # current scaling, per tensor
}


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


def seconds_left() -> float:
    """Seconds until this step's deadline (the driver's timeout for it); infinite without one."""
    deadline = os.environ.get(DEADLINE_ENV)
    return float(deadline) - time.time() if deadline else math.inf


@contextlib.contextmanager
def cuda_kernels(generation: Optional[str]):
    """Run the fused ops' CUDA kernels of ``generation`` inside the block (None: leave the choice
    as it is). The C++ op reads the variable on every call; CPU kernels do not depend on it."""
    previous = os.environ.get(KERNELS_ENV)
    if generation is not None:
        os.environ[KERNELS_ENV] = generation
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(KERNELS_ENV, None)
        else:
            os.environ[KERNELS_ENV] = previous


def time_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median time of ``fn`` in milliseconds over ``iters`` calls after ``warmup``.

    On a GPU: a CUDA event pair around each call, the calls queued back to back and one
    synchronization at the end, so each pair measures the device's time for one call with the
    launch queue full (as in training; the host's launch overhead stays hidden where the
    device is busy). On CPU: perf_counter around each call."""
    import torch

    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            begin = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - begin))
        return statistics.median(times)
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    from bench_dual_norm import cuda_timed  # one CUDA-event timer for every bench

    return 1e3 * cuda_timed(fn, iters, warmup=0)  # warmed up above


def repeated(ms: Sequence[float], stock: Optional[Sequence[float]] = None) -> dict:
    """The record of one variant measured once per repeat: ``ms`` (their mean), ``ms_repeats``,
    and against the stock layer's times of the same repeats ``ratios`` and ``ratio_to_stock``,
    the larger (worse) of them, which the report judges."""
    record = {"ms": round(statistics.fmean(ms), 3), "ms_repeats": [round(t, 3) for t in ms]}
    if stock and len(stock) == len(ms):
        ratios: List[float] = [round(t / s, 4) for t, s in zip(ms, stock)]
        record.update(ratios=ratios, ratio_to_stock=max(ratios))
    return record


def one_rank(fn: Callable, *args, model_parallel: bool = True):
    """``fn(*args)`` on one fresh rank with Megatron's process groups at TP=PP=1 (NCCL on a
    GPU, gloo and the CPU shim on CPU: megatron_siamese.runtime.launch). ``model_parallel=False``
    leaves the groups to ``fn`` (runtime.gpt.MegatronGPT creates its own)."""
    from megatron_siamese.runtime.launch import RankFailed, launch

    try:
        return launch(_with_model_parallel, 1, fn, args, model_parallel, timeout_s=RANK_TIMEOUT_S)[0]
    except RankFailed as failure:
        if f"{NeedsGPU.__name__}: " in str(failure):  # a rehearsal stopping inside the rank
            raise NeedsGPU(str(failure).rsplit(f"{NeedsGPU.__name__}: ", 1)[1].strip()) from None
        raise


def _with_model_parallel(fn: Callable, args: tuple, model_parallel: bool = True):
    from megatron_siamese.runtime.gpt import initialize_model_parallel
    from megatron_siamese.runtime.layout import Layout

    if not model_parallel:
        return fn(*args)
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

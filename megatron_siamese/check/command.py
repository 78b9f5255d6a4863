"""``megatron-siamese check``: prove on your own machines that every parallel layout computes
what one device computes.

One job runs every layout, each on the job's first ranks while the others wait
(``runtime.job.on_first_ranks``): the same GPT from global-name-seeded weights, one training step of
the same global batch through Megatron's schedules and optimizer, compared by rank 0 against the
single-rank run (losses, every gradient, every parameter after the step). One row per layout; every
rank exits non-zero if any fails. Layout names: ``runtime/layout.py``; docs/parallelism.md.
"""

from __future__ import annotations

import dataclasses
import time
from typing import List, Optional, Sequence, Tuple

from megatron_siamese import device
from megatron_siamese.check import DEFAULT_LAYOUTS, SPECS  # noqa: F401  (re-exported)
from megatron_siamese.check.case import ModelCase
from megatron_siamese.check.compare import TOLERANCES, Comparison, compare
from megatron_siamese.check.step import layout_step
from megatron_siamese.runtime.layout import Layout, parse_layout


def unavailable_reason(layout: Layout, spec: str, world_size: int, biases: bool = True) -> Optional[str]:
    """Why a layout cannot run here at all (reported as SKIP, never as PASS)."""
    if spec == "stock" and biases and layout.recompute.recomputes("mlp"):
        return ("stock Megatron's selective 'mlp' recompute with biases recurses forever: its checkpoint returns the "
                "bias Parameter, which becomes its own grad_fn (docs/design.md)")
    if layout.world_size > world_size:  # spawned on a GPU host: one rank per visible GPU
        return f"needs {layout.world_size} GPUs, {world_size} visible (launch it with torchrun across nodes)"
    return None


@dataclasses.dataclass
class Row:
    layout: str
    ranks: int
    status: str  # PASS, FAIL, SKIP, ERROR
    loss_error: Optional[float] = None
    grad_error: Optional[float] = None
    param_error: Optional[float] = None
    seconds: float = 0.0
    memory_mb: Optional[float] = None  # the largest rank's (CPU: resident set; GPU: peak allocated)
    detail: str = ""


def _row(name: str, layout: Layout, comparison: Comparison, seconds: float, memory_mb: Optional[float]) -> Row:
    failures = [f"{q}: {f}" for q in ("losses", "grads", "params")
                for f in getattr(comparison, q).failures]
    return Row(
        layout=name, ranks=layout.world_size,
        status="PASS" if comparison.passed else "FAIL",
        loss_error=comparison.losses.worst_error,
        grad_error=comparison.grads.worst_error,
        param_error=comparison.params.worst_error,
        seconds=seconds,
        memory_mb=memory_mb,
        detail="; ".join(failures[:3]),
    )


def tolerance_of(case: ModelCase):
    """The tolerance a case is judged by: its FP8 recipe's, else its dtype's."""
    return TOLERANCES["fp8" if case.fp8 else case.dtype]


def _single_rank_runs(case: ModelCase, tolerance, cache: Optional[dict] = None):
    """(reference, the same dtype's single-rank run or None) for ``case``, each run once per job
    (``cache``: a case checked again, faulty this time, reuses its sound runs)."""
    from megatron_siamese.runtime.job import on_first_ranks

    key = dataclasses.replace(case, fault=None)
    if cache is not None and key in cache:
        return cache[key]
    if tolerance.noise_factor is None:
        runs = on_first_ranks(1, layout_step, key, Layout()), None
    else:  # judged against fp32, within a multiple of this dtype's own single-rank error
        runs = (on_first_ranks(1, layout_step, dataclasses.replace(key, dtype="fp32", fp8=None), Layout()),
                on_first_ranks(1, layout_step, key, Layout()))
    if cache is not None:
        cache[key] = runs
    return runs


def check_job(case: ModelCase, layouts: Sequence[Tuple[str, Layout]], spec: str, fault: Optional[str],
              single_rank_cache: Optional[dict] = None) -> List[Row]:
    """Every rank of the job: the single-rank reference once, then each layout on the job's
    first ranks; rank 0 judges and prints each row. Every rank returns all rows."""
    import torch

    from megatron_siamese.runtime.hangs import CollectiveTimeout
    from megatron_siamese.runtime.job import RegroupError, console, gather_to_rank0, on_first_ranks

    world = torch.distributed.get_world_size()
    rank0 = torch.distributed.get_rank() == 0
    tolerance = tolerance_of(case)
    reference, same_dtype_single = _single_rank_runs(case, tolerance, single_rank_cache)
    faulty = dataclasses.replace(case, fault=fault)
    rows = []
    for name, layout in layouts:
        reason = unavailable_reason(layout, spec, world, case.add_bias_linear)
        start = time.perf_counter()
        result, error = None, None
        if not reason:
            try:
                result = on_first_ranks(layout.world_size, _watched_layout_step, name, faulty, layout)
            except (RegroupError, CollectiveTimeout):  # the job's own failure, not the layout's: it ends the check
                raise
            except Exception as raised:  # a crashed layout is a failed layout, with its reason
                error = (str(raised).strip().splitlines() or [type(raised).__name__])[-1][:200]
        errors = gather_to_rank0(error)  # over the whole job: any rank's error fails the layout
        if rank0:
            seconds = time.perf_counter() - start
            failed = [e for e in errors if e]
            if reason:
                row = Row(name, layout.world_size, "SKIP", detail=reason)
            elif failed:
                row = Row(name, layout.world_size, "ERROR", seconds=seconds, detail=failed[0])
            else:
                row = _row(name, layout, compare(result, reference, tolerance, same_dtype_single), seconds,
                           result.memory_mb)
            rows.append(row)
            console(format_row(row))
    shared = [rows]
    torch.distributed.broadcast_object_list(shared, src=0)
    return shared[0]


def _watched_layout_step(name: str, case: ModelCase, layout: Layout):
    """``layout_step`` on the layout's ranks; a rank that hangs in it ends the check, named with the layout."""
    from megatron_siamese.runtime.hangs import watched

    with watched(f"layout {name}"):
        return layout_step(case, layout)


def job_size(layouts: Sequence[Layout]) -> int:
    """How many ranks a spawned check starts: the largest layout's (one per GPU at most)."""
    largest = max([layout.world_size for layout in layouts] + [1])
    return min(largest, device.gpu_count()) if device.uses_cuda() else largest


def run_check(case: ModelCase, layouts: List[str], spec: str, fault: Optional[str] = None,
              timeout_s: float = 600.0) -> List[Row]:
    """Compare every layout against one rank, in one job (spawned here unless launched); returns
    one Row per layout and prints each as it is judged."""
    from megatron_siamese.runtime.job import job_world_size
    from megatron_siamese.runtime.launch import run_job

    parsed = [(name, parse_layout(name)) for name in layouts]  # bad names fail before any run
    world = job_world_size() or job_size([layout for _, layout in parsed])
    return run_job(check_job, world, case, parsed, spec, fault, timeout_s=timeout_s, quiet_ranks=range(world))


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2e}"


HEADER = (f"{'layout':<20} {'ranks':>5} {'loss err':>9} {'grad err':>9} {'param err':>9} {'time':>6} "
          f"{'MB/rank':>7}  result")


def _memory(megabytes: Optional[float]) -> str:
    return "-" if megabytes is None else f"{megabytes:.0f}"


def format_row(row: Row) -> str:
    line = (f"{row.layout:<20} {row.ranks:>5} {_fmt(row.loss_error):>9} {_fmt(row.grad_error):>9} "
            f"{_fmt(row.param_error):>9} {row.seconds:>5.1f}s {_memory(row.memory_mb):>7}  {row.status}")
    return f"{line}  ({row.detail})" if row.detail else line

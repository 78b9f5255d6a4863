"""``megatron-siamese check``: prove on your own machines that every parallel layout computes
what one device computes.

For each layout it launches the ranks itself (gloo on CPU, NCCL when CUDA is present), builds
the same tiny GPT from global-name-seeded weights, runs one training step of the same global
batch through Megatron's schedules, ``finalize_model_grads`` and optimizer, and compares
against a single-rank run: every per-microbatch loss, every parameter gradient (gathered
over TP, stitched from the distributed optimizer's shards) and every parameter after the
optimizer step. It prints one row per layout with the worst relative error of each
quantity and PASS/FAIL, and exits non-zero if any layout fails.

Layout names: parallel sizes ``tpN``, ``ppN``, ``vppN`` (virtual stages per pipeline
rank), ``cpN``, ``dpN`` and flags ``sp`` (sequence parallel), ``do`` (distributed
optimizer), ``full`` / ``sel`` (full / selective recompute), joined by ``-``;
``single`` is one rank. Example: ``tp2-pp2-sp``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import List, Optional

import torch

from megatron_siamese.check import DEFAULT_LAYOUTS, SPECS  # noqa: F401  (re-exported)
from megatron_siamese.check.case import ModelCase
from megatron_siamese.check.compare import TOLERANCES, Comparison, compare
from megatron_siamese.check.step import run_layout
from megatron_siamese.runtime.layout import Layout, parse_layout




def unavailable_reason(layout: Layout, spec: str) -> Optional[str]:
    """Why a layout cannot run here at all (reported as SKIP, never as PASS)."""
    if layout.cp > 1:
        return ("context parallelism needs Transformer Engine's attention "
                "(megatron-core's local DotProductAttention refuses CP)")
    if spec == "stock" and layout.recompute == "selective":
        return ("stock megatron-core 0.16.1 selective recompute cannot run here: 'layernorm' "
                "needs Transformer Engine (CheckpointWithoutOutput(fp8=False) enables FP8 "
                "bookkeeping) and 'mlp' with biases recurses forever (docs/design.md)")
    if torch.cuda.is_available() and layout.world_size > torch.cuda.device_count():
        return f"needs {layout.world_size} GPUs, {torch.cuda.device_count()} visible"
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
    detail: str = ""


def _row(name: str, layout: Layout, comparison: Comparison, seconds: float) -> Row:
    failures = [f"{q}: {f}" for q in ("losses", "grads", "params")
                for f in getattr(comparison, q).failures]
    return Row(
        layout=name, ranks=layout.world_size,
        status="PASS" if comparison.passed else "FAIL",
        loss_error=comparison.losses.worst_error,
        grad_error=comparison.grads.worst_error,
        param_error=comparison.params.worst_error,
        seconds=seconds,
        detail="; ".join(failures[:3]),
    )


def run_check(case: ModelCase, layouts: List[str], spec: str, backend: Optional[str] = None,
              fault: Optional[str] = None, echo=print) -> List[Row]:
    """Compare every layout against one rank; returns one Row per layout."""
    parsed = [(name, parse_layout(name)) for name in layouts]  # bad names fail before any run
    tolerance = TOLERANCES[case.dtype]
    same_dtype_single = None
    if tolerance.noise_factor is None:
        reference = run_layout(case, Layout(), backend=backend)
    else:  # judged against fp32, within a multiple of this dtype's own single-rank error
        reference = run_layout(dataclasses.replace(case, dtype="fp32"), Layout(), backend=backend)
        same_dtype_single = run_layout(case, Layout(), backend=backend)
    faulty = dataclasses.replace(case, fault=fault)
    rows = []
    for name, layout in parsed:
        reason = unavailable_reason(layout, spec)
        if reason:
            rows.append(Row(name, layout.world_size, "SKIP", detail=reason))
        else:
            start = time.perf_counter()
            try:
                result = run_layout(faulty, layout, backend=backend)
                comparison = compare(result, reference, tolerance, same_dtype_single)
                rows.append(_row(name, layout, comparison, time.perf_counter() - start))
            except Exception as error:  # a crashed layout is a failed layout, with its reason
                rows.append(Row(name, layout.world_size, "ERROR", seconds=time.perf_counter() - start,
                                detail=str(error).strip().splitlines()[-1][:200]))
        echo(format_row(rows[-1]))
    return rows


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2e}"


HEADER = f"{'layout':<20} {'ranks':>5} {'loss err':>9} {'grad err':>9} {'param err':>9} {'time':>6}  result"


def format_row(row: Row) -> str:
    line = (f"{row.layout:<20} {row.ranks:>5} {_fmt(row.loss_error):>9} {_fmt(row.grad_error):>9} "
            f"{_fmt(row.param_error):>9} {row.seconds:>5.1f}s  {row.status}")
    return f"{line}  ({row.detail})" if row.detail else line


def main(argv: Optional[List[str]] = None) -> int:
    """``megatron-siamese check`` with these arguments (the command line parses and validates them)."""
    from megatron_siamese.cli import main as cli_main

    return cli_main(["check", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())

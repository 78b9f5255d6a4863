"""The host's share of one layer's cost: SiameseNorm beside stock, measured side by side in one run.

    python bench/host_cost.py                      # h 64, seq 8, batch 1, one thread (~2 minutes)
    python bench/host_cost.py --repeats 400 --json host_cost.json

At a tiny shape the arithmetic is negligible, so one layer's forward + backward measures what the
host pays per op: the dispatcher, allocations, autograd nodes (Python's above all), casts. One layer
(global layer 2 of 4, built as bench/sublayer_bytes.py builds it, so SiameseNorm gets packed
[s, b, 2h] streams), per spec (local; the TE spec's op structure with TE's modules stood in by
Megatron's local ones, bench/te_stand_ins.py), dtype (fp32, bf16) and variant:

  stock           Megatron's Pre-Norm layer
  siamese-torch   SiameseNorm on torch's norms (the PyTorch path)
  siamese-apart   the fused ops, a dual_norm and a dual_residual per sublayer
  siamese-joined  the boundary ops joining the two sublayers (the default)

For each it prints:
  host time  median of --repeats forward + backward passes; the variants are interleaved (each
             repeat runs every variant once, in turn), so load on the machine hits all alike; the
             ratio is to stock's median of the same run
  ops        operators the dispatcher ran (torch.profiler: aten and ours, nested ones included,
             e.g. a cast's copy): forward + backward
  nodes      autograd nodes of the layer's graph, AccumulateGrad (one per parameter) left out,
             and how many of them are Python's (a torch.autograd.Function's, or a torch.library
             register_autograd's)

Targets (issue 50, docs/kernels.md "The host's share"): host time <= 1.05x stock, Python nodes no
more than stock's, ops <= 1.10x stock's. tests/test_host_cost.py holds the op and node counts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sublayer_bytes import VARIANTS, build_layer, run_layer, setup_single_rank  # noqa: E402


def graph_nodes(output: torch.Tensor):
    """(nodes, Python nodes) of the autograd graph behind ``output``, AccumulateGrad left out."""
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    counted = [node for node in seen if type(node).__name__ != "AccumulateGrad"]
    python = [node for node in counted if isinstance(node, torch.autograd.function.BackwardCFunction)]
    return len(counted), len(python)


@contextlib.contextmanager
def profiler_unheard():
    """The profiler's start and stop lines (Kineto writes them to the process's stderr) silenced."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def dispatched_ops(layer, config, inputs, grad) -> int:
    """Operators the dispatcher runs in one forward + backward (nested ones included)."""
    with profiler_unheard(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        _, backward = run_layer(layer, config, inputs, grad)
        backward()
    return sum(1 for event in profile.events() if event.name.startswith(("aten::", "megatron_siamese::")))


class Case:
    """One variant's layer and inputs, ready to run forward + backward again and again."""

    def __init__(self, variant, spec_kind: str, dtype: str, hidden: int, seq: int, batch: int,
                 device: str = "cpu"):
        self.variant, self.device = variant, torch.device(device)
        layer, self.config = build_layer(variant, spec_kind, hidden, seq, dtype)
        self.layer = layer.to(self.device)
        width = hidden if variant.norm == "pre" else 2 * hidden
        dtype = self.config.params_dtype
        self.inputs = torch.randn(seq, batch, width, dtype=dtype, device=self.device, requires_grad=True)
        self.grad = torch.randn(seq, batch, width, dtype=dtype, device=self.device)

    def step(self) -> float:
        start = time.perf_counter()
        _, backward = run_layer(self.layer, self.config, self.inputs, self.grad)
        backward()
        if self.device.type == "cuda":  # at this shape the kernels finish behind their launches
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def counts(self):
        output, backward = run_layer(self.layer, self.config, self.inputs, self.grad)
        nodes = graph_nodes(output)
        backward()
        return dispatched_ops(self.layer, self.config, self.inputs, self.grad), nodes


def measure(spec_kind: str, dtype: str, hidden: int = 64, seq: int = 8, batch: int = 1, repeats: int = 200,
            device: str = "cpu") -> dict:
    """One spec and dtype: {variant: ms, ops, nodes, python_nodes and their ratios to stock}. On
    "cuda" (the GPU kit's host-cost step) the same layers run there, each pass synchronized."""
    from te_stand_ins import stood_in

    with (stood_in() if spec_kind == "te" else contextlib.nullcontext()):
        cases = [Case(v, spec_kind, dtype, hidden, seq, batch, device) for v in VARIANTS]
        for case in cases:  # warm-up: first calls build caches, load kernels
            for _ in range(5):
                case.step()
        times = {case.variant.name: [] for case in cases}
        for _ in range(repeats):
            for case in cases:
                times[case.variant.name].append(case.step())
        rows = {}
        for case in cases:
            ops, (nodes, python) = case.counts()
            rows[case.variant.name] = dict(ms=1e3 * statistics.median(times[case.variant.name]), ops=ops, nodes=nodes,
                                           python_nodes=python)
    stock = rows["stock"]
    for row in rows.values():
        row.update(time_ratio=row["ms"] / stock["ms"], ops_ratio=row["ops"] / stock["ops"])
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--seq", type=int, default=8, help="sequence length (default 8)")
    parser.add_argument("--batch", type=int, default=1, help="micro-batch size (default 1)")
    parser.add_argument("--repeats", type=int, default=200, help="timed forward + backward passes a variant (default 200)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    setup_single_rank()
    torch.manual_seed(0)
    results = {}
    print(f"One layer forward + backward, h {args.hidden}, seq {args.seq}, batch {args.batch}, {args.threads} thread(s), "
          f"median of {args.repeats} interleaved repeats")
    for spec_kind in ("local", "te"):
        for dtype in ("fp32", "bf16"):
            rows = results[f"{spec_kind}/{dtype}"] = measure(spec_kind, dtype, args.hidden, args.seq, args.batch,
                                                             args.repeats)
            title = "local spec" if spec_kind == "local" else "TE spec's op structure (TE stood in)"
            print(f"\n{title}, {dtype}")
            print(f"{'variant':<16} {'host ms':>8} {'vs stock':>9} {'ops':>5} {'vs stock':>9} {'nodes':>6} {'Python':>7}")
            for name, row in rows.items():
                print(f"{name:<16} {row['ms']:>8.3f} {row['time_ratio']:>8.3f}x {row['ops']:>5} {row['ops_ratio']:>8.3f}x "
                      f"{row['nodes']:>6} {row['python_nodes']:>7}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(settings=vars(args), results=results), indent=1))


if __name__ == "__main__":
    main()

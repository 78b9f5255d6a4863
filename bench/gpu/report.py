"""The GPU kit's results as markdown, every figure against its target (for docs/gpu.md).

    python bench/gpu/report.py OUT1/gpu-results.json [OUT2/gpu-results.json ...]

Several files (e.g. the tier 1 and the tier 2 call) are read in order; a later file's step
replaces an earlier one of the same name. A rehearsal's figures are labelled as such: they
come from tiny CPU shapes and say nothing about a GPU. Files of earlier runs (one kernel
generation, one repeat) render too: their figures count as the verified kernels' repeat 1.
A figure measured twice is met only when both repeats meet the target.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import List, Optional

TARGETS = {  # issue 16's targets
    "fwd_share": 0.85,  # fused pair forward, share of the copy bandwidth measured in the same process
    "fwd_bwd_share": 0.75,  # ... forward + backward
    "compile_over_fused": 1.0,  # torch.compile's time / the fused pair's: above 1, the fused pair is faster
    "te_layer_ratio": {2048: 1.03, 4096: 1.02},  # SiameseNorm TE layer / stock TE layer, by hidden size
    "local_layer_ratio": 1.05,
    "model_step_ratio": 1.03,
    "plan_peak_share": 0.05,  # issue 40: the plan's per-GPU total within 5% of torch.cuda.max_memory_allocated
    "host_time_ratio": 1.05,  # issue 50: a layer's host time / stock's at h 64 (bench/host_cost.py)
    "host_ops_ratio": 1.10,  # ... operators dispatched / stock's
}


def merged(records: List[dict]) -> dict:
    steps, header = {}, dict(records[0]) if records else {}
    for record in records:
        steps.update(record.get("steps", {}))
        header["rehearsal"] = header.get("rehearsal") or record.get("rehearsal")
    header["steps"] = steps
    header["provenance"] = [(r.get("started", "?"), r.get("commit"), r.get("source_hash")) for r in records]
    return header


def result(steps: dict, name: str) -> dict:
    step = steps.get(name, {})
    return step.get("result", {}) if step.get("status") in ("ok", "rehearsed") else {}


def commit_text(commit: Optional[dict]) -> str:
    if not commit:
        return "not recorded"
    if commit.get("head"):
        return commit["head"][:12] + (" + uncommitted changes" if commit.get("dirty") else "")
    kit = commit.get("kit")
    return f"unknown ({commit.get('why', 'no git')}){'; the kit was built at ' + kit[:12] if kit else ''}"


def header_lines(run: dict) -> List[str]:
    machine = result(run["steps"], "machine")
    kit = result(run["steps"], "install-kit").get("versions", {})
    te = result(run["steps"], "te-extension").get("versions", {})
    abi = machine.get("abi", {})
    lines = [f"- date: {run.get('started', '?')}" + ("  **(CPU rehearsal: no figure below is a GPU measurement)**"
                                                      if run.get("rehearsal") else "")]
    lines.append(f"- device: {machine.get('device', 'no GPU')} ({machine.get('nvidia-smi') or 'no nvidia-smi'}), "
                 f"{machine.get('cpus', '?')} CPUs")
    lines.append(f"- software: Python {machine.get('python', '?')}, torch {abi.get('torch', '?')}, "
                 f"megatron-core {kit.get('megatron-core', '?')}, Transformer Engine "
                 f"{te.get('transformer_engine') or 'not installed'}, nvcc: {machine.get('nvcc') or 'none'}")
    for started, commit, source_hash in run.get("provenance", []):
        lines.append(f"- run of {started}: commit {commit_text(commit)}, extension sources {source_hash or '?'}")
    return lines


def step_table(steps: dict) -> List[str]:
    lines = ["| step | status | seconds | note |", "| --- | --- | --- | --- |"]
    for name, step in steps.items():
        note = step.get("reason", "")
        r = step.get("result", {})
        if name in ("extension", "te-extension") and r.get("how"):
            note = (note + "; " if note else "") + r["how"]
        if r.get("cut_for_time"):
            note = (note + "; " if note else "") + "cut for time: " + ", ".join(r["cut_for_time"])
        lines.append(f"| {name} | {step.get('status')} | {step.get('seconds', '')} | {note} |")
    return lines


def slash(values, fmt="{}") -> str:
    return " / ".join(fmt.format(v) for v in values)


class Figures:
    """The figures table, row by row."""

    def __init__(self, rehearsal: bool):
        self.rehearsal = rehearsal
        self.lines = ["| check | figure | target | verdict |", "| --- | --- | --- | --- |"]

    def verdict(self, ok) -> str:
        if self.rehearsal:
            return "rehearsal"
        return "-" if ok is None else ("met" if ok else "**missed**")

    def add(self, check: str, figure: str, target: str, ok) -> None:
        self.lines.append(f"| {check} | {figure} | {target} | {self.verdict(ok)} |")

    def failed(self, check: str, error: str) -> None:
        self.lines.append(f"| {check} | {error[:200]} | | **failed** |")


def kernel_tests(figures: Figures, tests: dict) -> None:
    def counted(c):
        return f"{c['passed']} passed, {c['failed'] + c['error']} failed, {c['skipped']} skipped"

    generations = tests.get("generations") or {"verified": tests}
    for generation, run in generations.items():
        if "all" not in run:
            figures.add(f"kernel tests, {generation} kernels", run.get("summary", "not run"), "all pass", False)
            continue
        failing = f"; failing: {', '.join(run['not_passed'][:5])}" if run.get("not_passed") else ""
        figures.add(f"kernel tests, {generation} kernels: all / with the cuda parameter",
                    f"{counted(run['all'])} / {counted(run['cuda'])}{failing}", "all pass, cuda tests present",
                    run.get("passed"))


def sanitizer(figures: Figures, record: dict) -> None:
    if not record.get("ran"):
        figures.add(f"compute-sanitizer, {record.get('kernels')} kernels", f"**not run**: {record.get('why')}",
                    "no errors", None if record.get("passed") is None else False)
        return
    for tool, run in record["tools"].items():
        tests = run.get("tests", {})
        text = (f"{tests.get('passed', 0)} tests passed, {tests.get('failed', 0) + tests.get('error', 0)} failed; "
                f"{'; '.join(run.get('summary', [])) or run.get('why', 'no summary')}")
        if run.get("errors"):
            text += f"; first: {run['errors'][0]}"
        figures.add(f"compute-sanitizer {tool}, {record['kernels']} kernels", text, "no errors, tests pass",
                    run.get("passed"))


def kernel_bench(figures: Figures, bench: dict) -> List[str]:
    """Figure rows per (shape, dtype, pass, generation), both repeats in one; returns the
    per-kernel table's lines."""
    groups, errors, profiles = defaultdict(list), [], []
    for row in bench.get("rows", []):
        kernels = row.get("kernels", "verified")
        if "error" in row:
            errors.append((f"fused pair {row['shape']} {row['dtype']} {kernels} (repeat {row.get('repeat', 1)})",
                           row["error"]))
            continue
        groups[(row["shape"], row["dtype"], row["pass"], kernels)].append(row)
        if row.get("profile"):
            profiles.append((row, kernels))
    copies = bench.get("copy_gb_s_repeats") or [bench.get("copy_gb_s")]
    for (shape, dtype, label, kernels), rows in groups.items():
        target = TARGETS["fwd_share"] if label == "fwd" else TARGETS["fwd_bwd_share"]
        shares = [r["fused_share_of_copy"] for r in rows]
        over = [r["compile_over_fused"] for r in rows]
        figure = (f"{slash([100 * s for s in shares], '{:.0f}%')} of copy ({slash(copies)} GB/s); fused "
                  f"{slash([r['ms']['fused'] for r in rows])} ms, compile/fused {slash(over)}, eager/fused "
                  f"{slash([r['eager_over_fused'] for r in rows])}")
        failed_columns = {k: v for r in rows for k, v in r.get("column_errors", {}).items()}
        if failed_columns:
            figure += "; failed: " + "; ".join(f"{k}: {v[:120]}" for k, v in failed_columns.items())
        # a compile column that failed (None) proves nothing: not met
        ok = all(s >= target for s in shares) and all(o is not None and o > TARGETS["compile_over_fused"] for o in over)
        figures.add(f"fused pair {shape} {dtype} {label}, {kernels}", figure,
                    f">= {100 * target:.0f}% of copy, faster than compile", ok)
    for check, error in errors:
        figures.failed(check, error)
    if not profiles:
        return []
    lines = ["| fused pair, per kernel (torch.profiler, repeat 1) | kernel: device time per call |", "| --- | --- |"]
    for row, kernels in profiles:
        top = "; ".join(f"{short_kernel_name(k['name'])}: {k['us']} us" for k in row["profile"][:4])
        lines.append(f"| {row['shape']} {row['dtype']} {row['pass']} {kernels} | {top} |")
    return lines


def short_kernel_name(name: str) -> str:
    """A CUDA kernel's name without its parameter list and return type, at most 60 characters."""
    name = name.split("(")[0].removeprefix("void ")
    return name if len(name) <= 60 else name[:57] + "..."


def layer_target(row: dict) -> float:
    if row.get("impl") == "transformer_engine":
        return TARGETS["te_layer_ratio"][4096 if row["hidden"] >= 4096 else 2048]
    return TARGETS["local_layer_ratio"]


def measured_variants(figures: Figures, row: dict, check: str):
    """(key, timing, stock, check name) of each SiameseNorm variant of ``row`` that has a ratio
    to stock; the others are recorded as failed with their error."""
    stock = row["stock"]
    for key in sorted(k for k in row if k.startswith("siamese_")):
        timing = row[key]
        if "ratio_to_stock" not in timing:
            figures.failed(f"{check} {key}", timing.get("error") or stock.get("error", ""))
            continue
        yield key, timing, stock, f"{check} {key}"


def layer_bench(figures: Figures, rows: List[dict]) -> None:
    for row in rows:
        prefix = f"layer {row['impl']} {row['precision']} h={row['hidden']} seq={row['seq']}"
        for key, timing, stock, check in measured_variants(figures, row, prefix):
            ratios = timing.get("ratios") or [timing["ratio_to_stock"]]
            target = layer_target(row)
            kernels = timing.get("kernels") or ("PyTorch path" if "unfused" in key else "verified")
            figures.add(f"{check} ({kernels})",
                        f"{slash(timing.get('ms_repeats') or [timing['ms']])} ms vs stock "
                        f"{slash(stock.get('ms_repeats') or [stock['ms']])} ms = {slash(ratios, '{:.3f}x')} "
                        f"({timing.get('stream_arithmetic', '')})",
                        f"<= {target}x", all(r <= target for r in ratios))


def model_bench(figures: Figures, bench: dict) -> None:
    model = bench.get("rehearsal_model") or bench.get("model", {})
    size = f"{model.get('num_layers')}x{model.get('hidden_size')}, seq {model.get('seq_length')}"
    for row in bench.get("rows", []):
        prefix = f"model {size} {row['impl']} {row['precision']} recompute={row['recompute']}"
        for _, timing, stock, check in measured_variants(figures, row, prefix):
            memory = (f"peak {timing['peak_mib'] / 1024:.1f} vs {stock['peak_mib'] / 1024:.1f} GiB = "
                      f"{timing['memory_ratio_to_stock']:.3f}x" if timing.get("memory_ratio_to_stock") else
                      "peak memory not measured")
            figures.add(f"{check} ({timing.get('kernels')})",
                        f"step {slash(timing['ms_repeats'])} ms vs stock {slash(stock['ms_repeats'])} ms = "
                        f"{slash(timing['ratios'], '{:.3f}x')}; {memory}",
                        f"step <= {TARGETS['model_step_ratio']}x; memory reported",
                        all(r <= TARGETS["model_step_ratio"] for r in timing["ratios"]))
        plan_peaks(figures, row, prefix)


def plan_peaks(figures: Figures, row: dict, prefix: str) -> None:
    """``megatron-siamese plan``'s per-GPU total beside each variant's measured peak (bf16 rows)."""
    plan = row.get("plan", {})
    if "error" in plan:
        figures.add(f"{prefix} plan", f"plan failed: {plan['error'][-200:]}", "plan runs", False)
        return
    for label, timing in row.items():
        if not isinstance(timing, dict) or "peak_over_plan" not in timing:
            continue
        variant = plan[timing["plan_variant"]]
        terms = ", ".join(f"{term} {variant[term] / 1024:.2f}" for term in ("weights", "grads", "optimizer",
                                                                           "activations"))
        figures.add(f"{prefix} {label}: plan's peak",
                    f"measured {timing['peak_mib'] / 1024:.2f} GiB vs plan {variant['memory'] / 1024:.2f} GiB "
                    f"({terms}) = {timing['peak_over_plan']:.3f}x",
                    f"within {TARGETS['plan_peak_share']:.0%}",
                    abs(timing["peak_over_plan"] - 1) <= TARGETS["plan_peak_share"])


def host_cost(figures: Figures, rows: dict) -> None:
    """bench/host_cost.py's rows on the GPU: each SiameseNorm variant's host time and operators
    against stock's, and its Python autograd nodes against stock's."""
    for case, variants in rows.items():
        stock = variants["stock"]
        for name, row in variants.items():
            if name in ("stock", "siamese-torch"):
                continue
            figures.add(f"host cost {case} {name}",
                        f"{row['ms']:.3f} vs stock {stock['ms']:.3f} ms = {row['time_ratio']:.3f}x; ops "
                        f"{row['ops']} vs {stock['ops']} = {row['ops_ratio']:.3f}x; Python nodes "
                        f"{row['python_nodes']} vs {stock['python_nodes']}",
                        f"<= {TARGETS['host_time_ratio']}x time, <= {TARGETS['host_ops_ratio']}x ops, Python "
                        f"nodes <= stock's",
                        row["time_ratio"] <= TARGETS["host_time_ratio"] and row["ops_ratio"] <= TARGETS["host_ops_ratio"]
                        and row["python_nodes"] <= stock["python_nodes"])


def figures(steps: dict, rehearsal: bool) -> List[str]:
    table = Figures(rehearsal)
    tests = result(steps, "kernel-tests")
    if tests:
        kernel_tests(table, tests)
    checked = result(steps, "compute-sanitizer")
    if checked:
        sanitizer(table, checked)
    per_kernel = kernel_bench(table, result(steps, "kernel-bench"))
    for step in ("layer-bench", "te-layer-bench"):
        layer_bench(table, result(steps, step).get("rows", []))
    model_bench(table, result(steps, "model-bench"))
    host_cost(table, result(steps, "host-cost").get("rows", {}))
    train = result(steps, "train-bf16")
    if "final_val_loss" in train:
        size = f", ~{train['estimated_parameters'] / 1e6:.0f}M params" if "estimated_parameters" in train else ""
        table.add(f"bf16 training{size}, {train['steps']} steps",
                  f"train loss {train['first_train_loss']:.3f} -> {train['final_train_loss']:.3f}, val "
                  f"{train['final_val_loss']:.3f}, {_speed(train)}, {train['seconds']}s",
                  f"loss goes down, val below unigram entropy {train['unigram_entropy']}", train.get("passed"))
    parity = result(steps, "te-vs-local")
    if "logits_error" in parity:
        over = parity.get("over_tolerance") or {}
        beyond = "; ".join(f"{k}: te/fp32 {v['te_vs_fp32']}, local/fp32 {v['local_vs_fp32']}"
                           for k, v in over.items()) if isinstance(over, dict) else ""
        table.add("TE vs local, bf16",
                  f"logits {parity['logits_error']}, max gradient {parity['max_grad_error']} of "
                  f"{parity.get('compared', '?')} tensors (worst: {parity['worst']})"
                  f"{'; over ' + str(parity['tolerance']) + ': ' + beyond if beyond else ''}",
                  f"<= {parity['tolerance']}, or TE's error vs fp32 <= 2x local's", parity.get("passed"))
        hybrid = parity.get("hybrid") or {}
        if "logits_error" in hybrid:
            table.add("TE vs local, bf16, hybrid variant",
                      f"logits {hybrid['logits_error']}, max gradient {hybrid['max_grad_error']} of "
                      f"{hybrid.get('compared', '?')} tensors (worst: {hybrid['worst']})",
                      f"<= {hybrid['tolerance']}, or TE's error vs fp32 <= 2x local's", hybrid.get("passed"))
    fp8 = result(steps, "fp8-training")
    for label, run in fp8.get("runs", {}).items():
        table.add(f"{label} training", f"val loss {run['final_val_loss']:.4f} ({100 * run['final_val_loss_gap']:.1f}% "
                  f"from bf16), train {run['final_train_loss']:.4f}, {_speed(run)}",
                  f"within {100 * fp8['tolerance']:.0f}% of bf16", run["within_tolerance"])
    moe = result(steps, "moe-training")
    for label, run in moe.get("runs", {}).items():
        table.add(f"MoE {label} training (8 experts, top-2, TEGroupedMLP, alltoall)",
                  f"train loss {run['first_train_loss']:.3f} -> {run['final_train_loss']:.3f}, {_balance(run)}, "
                  f"{_speed(run)}", f"loss goes down, {_balance_target(run, moe['balance_limit'])}", run["passed"])
    return table.lines + ([""] + per_kernel if per_kernel else [])


def _speed(run: dict) -> str:
    """A training run's speed: Megatron-LM's time per iteration (our old loop's records: tokens/s)."""
    if run.get("ms_per_iteration") is not None:
        return f"{run['ms_per_iteration']} ms/iteration"
    return f"{run.get('tokens_per_second', '?')} tokens/s"


def _balance(run: dict) -> str:
    """The routers' balance at the end: Megatron's load-balancing loss over its coefficient (1.0 a
    uniform load), or, in our old loop's records, the busiest expert's load over the mean."""
    if "router_balance" in run:
        balance = run["router_balance"]
        last = balance[max(balance, key=int)] if balance else None
        return f"load-balancing loss / coefficient {'?' if last is None else f'{last:.2f}'} at the end (1.0 uniform)"
    load = run.get("router_at_end", {}).get("busiest_expert_load")
    return f"busiest expert {'?' if load is None else f'{load:.2f}'}x the mean load at the end"


def _balance_target(run: dict, limit: float) -> str:
    return (f"load-balancing loss / coefficient <= {limit}" if "router_balance" in run
            else f"busiest expert <= {limit}x the mean")


def render(records: List[dict]) -> str:
    run = merged(records)
    return "\n".join(header_lines(run) + [""] + step_table(run["steps"]) + [""]
                     + figures(run["steps"], bool(run.get("rehearsal"))))


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    records = []
    for path in paths:
        with open(path) as f:
            records.append(json.load(f))
    print(render(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU kit's results as markdown, every figure against its target (for docs/gpu.md).

    python bench/gpu/report.py OUT1/gpu-results.json [OUT2/gpu-results.json ...]

Several files (e.g. the tier 1 and the tier 2 call) are read in order; a later file's step
replaces an earlier one of the same name. A rehearsal's figures are labelled as such: they
come from tiny CPU shapes and say nothing about a GPU.
"""

from __future__ import annotations

import json
import sys
from typing import List

TARGETS = {
    "bandwidth": 0.80,  # fused op, share of the measured copy bandwidth
    "layer_ratio": 1.05,  # SiameseNorm layer / stock layer, forward + backward
}


def merged(records: List[dict]) -> dict:
    steps, header = {}, dict(records[0]) if records else {}
    for record in records:
        steps.update(record.get("steps", {}))
        header["rehearsal"] = header.get("rehearsal") or record.get("rehearsal")
    header["steps"] = steps
    return header


def result(steps: dict, name: str) -> dict:
    step = steps.get(name, {})
    return step.get("result", {}) if step.get("status") in ("ok", "rehearsed") else {}


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
    return lines


def step_table(steps: dict) -> List[str]:
    lines = ["| step | status | seconds | note |", "| --- | --- | --- | --- |"]
    for name, step in steps.items():
        note = step.get("reason", "")
        r = step.get("result", {})
        if name in ("extension", "te-extension") and r.get("how"):
            note = (note + "; " if note else "") + r["how"]
        lines.append(f"| {name} | {step.get('status')} | {step.get('seconds', '')} | {note} |")
    return lines


def figures(steps: dict, rehearsal: bool) -> List[str]:
    lines = ["| check | figure | target | verdict |", "| --- | --- | --- | --- |"]

    def verdict(ok) -> str:
        if rehearsal:
            return "rehearsal"
        return "-" if ok is None else ("met" if ok else "**missed**")

    tests = result(steps, "kernel-tests")
    if tests:
        def counted(c):
            return f"{c['passed']} passed, {c['failed'] + c['error']} failed, {c['skipped']} skipped"

        lines.append(f"| kernel tests: all / with the cuda parameter | {counted(tests['all'])} / {counted(tests['cuda'])}"
                     f" | all pass, cuda tests present | {verdict(tests.get('passed'))} |")
    bench = result(steps, "kernel-bench")
    for row in bench.get("rows", []):
        share = row["fused_share_of_copy"]
        if "error" in row:
            lines.append(f"| fused op {row['shape']} {row['dtype']} | {row['error'][:200]} | | **failed** |")
            continue
        lines.append(
            f"| fused op {row['shape']} {row['dtype']} {row['pass']} | {row['fused_gb_s']} GB/s = {100 * share:.0f}% "
            f"of copy ({bench['copy_gb_s']} GB/s); eager/fused {row['eager_over_fused']}, compile/fused "
            f"{row['compile_over_fused']} (ms {row['ms']}) | >= {100 * TARGETS['bandwidth']:.0f}% of copy | "
            f"{verdict(share >= TARGETS['bandwidth'])} |")
    for step in ("layer-bench", "te-layer-bench"):
        for row in result(steps, step).get("rows", []):
            stock = row["stock"].get("ms")
            for key in sorted(k for k in row if k.startswith("siamese_")):
                timing = row[key]
                if "ratio_to_stock" not in timing:
                    error = timing.get("error") or row["stock"].get("error", "")
                    lines.append(f"| layer {row['impl']} {row['precision']} h={row['hidden']} {key} | "
                                 f"{error[:200]} | | **failed** |")
                    continue
                lines.append(
                    f"| layer {row['impl']} {row['precision']} h={row['hidden']} seq={row['seq']} {key} | "
                    f"{timing['ms']} ms vs stock {stock} ms = {timing['ratio_to_stock']}x "
                    f"({timing.get('stream_arithmetic', '')}) | <= {TARGETS['layer_ratio']}x | "
                    f"{verdict(timing['ratio_to_stock'] <= TARGETS['layer_ratio'])} |")
    train = result(steps, "train-bf16")
    if "final_val_loss" in train:
        lines.append(
            f"| bf16 training, ~{train['estimated_parameters'] / 1e6:.0f}M params, {train['steps']} steps | train loss "
            f"{train['first_train_loss']:.3f} -> {train['final_train_loss']:.3f}, val {train['final_val_loss']:.3f}, "
            f"{train['tokens_per_second']} tokens/s, {train['seconds']}s | loss goes down, val below unigram entropy "
            f"{train['unigram_entropy']} | {verdict(train.get('passed'))} |")
    parity = result(steps, "te-vs-local")
    if "logits_error" in parity:
        over = parity.get("over_tolerance") or {}
        beyond = "; ".join(f"{k}: te/fp32 {v['te_vs_fp32']}, local/fp32 {v['local_vs_fp32']}"
                           for k, v in over.items()) if isinstance(over, dict) else ""
        lines.append(f"| TE vs local, bf16 | logits {parity['logits_error']}, max gradient {parity['max_grad_error']} "
                     f"(worst: {parity['worst']}){'; over ' + str(parity['tolerance']) + ': ' + beyond if beyond else ''}"
                     f" | <= {parity['tolerance']}, or TE's error vs fp32 <= 2x local's | "
                     f"{verdict(parity.get('passed'))} |")
    fp8 = result(steps, "fp8-training")
    for label, run in fp8.get("runs", {}).items():
        lines.append(f"| {label} training | val loss {run['final_val_loss']:.4f} ({100 * run['final_val_loss_gap']:.1f}% "
                     f"from bf16), train {run['final_train_loss']:.4f}, {run['tokens_per_second']} tokens/s | within "
                     f"{100 * fp8['tolerance']:.0f}% of bf16 | {verdict(run['within_tolerance'])} |")
    return lines


def render(records: List[dict]) -> str:
    run = merged(records)
    return "\n".join(header_lines(run) + [""] + step_table(run["steps"]) + [""] + figures(run["steps"], bool(run.get("rehearsal"))))


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

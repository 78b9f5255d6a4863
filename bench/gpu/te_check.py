"""Tier 2: ``megatron-siamese check`` on the Transformer Engine spec, bf16 and FP8, on one GPU.

    te-check   the check's single-GPU layouts (full and selective recompute) against the
               single-rank reference, with Transformer Engine's modules in bf16 and with FP8
               (hybrid format, delayed scaling): the check's own TE and FP8 path (seeding TE's
               parameter names, the bf16 and FP8 tolerances of docs/parallelism.md), then the
               hybrid variant on TE in bf16 (its first GPU run) if the step has the time left
               (else recorded as skipped). Passed when every layout that ran passes. Multi-GPU layouts need more than the one lent GPU: run
               `check --layouts all --transformer-impl transformer_engine` on a node.

    python bench/gpu/te_check.py te-check --result out.json [--rehearse]

A rehearsal (CPU) runs the same layouts on the local modules in fp32, then stops at the GPU.
"""

from __future__ import annotations

import dataclasses
import sys

from common import require_gpu, seconds_left, step_main

LAYOUTS = ["full", "sel"]
HYBRID_MIN_S = 30  # one more small check job (~15 s on the H200 by the others' times)


def judged(case, spec: str = "siamese") -> dict:
    from megatron_siamese.check.command import run_check

    rows = run_check(case, LAYOUTS, spec)
    return {row.layout: dataclasses.asdict(row) for row in rows}


def te_check(rehearse: bool) -> dict:
    from megatron_siamese.check.case import ModelCase

    record = {"local-fp32": judged(ModelCase())}
    if rehearse:  # the hybrid variant's check path, as far as a CPU goes
        record["local-fp32-hybrid"] = judged(ModelCase(norm="siamese-hybrid"), "siamese-hybrid")
    require_gpu(rehearse, "the check on Transformer Engine's modules")
    te = ModelCase(transformer_impl="transformer_engine", dtype="bf16", hidden_size=256, num_attention_heads=4,
                   num_query_groups=2, ffn_hidden_size=1024, seq_length=128, vocab_size=1024)
    record["te-bf16"] = judged(te)
    record["te-fp8"] = judged(dataclasses.replace(te, fp8="hybrid", fp8_recipe="delayed"))
    checks = ["local-fp32", "te-bf16", "te-fp8"]
    if seconds_left() > HYBRID_MIN_S:
        record["te-bf16-hybrid"] = judged(dataclasses.replace(te, norm="siamese-hybrid"), "siamese-hybrid")
        checks.append("te-bf16-hybrid")
    else:
        record["te-bf16-hybrid-skipped"] = f"{seconds_left():.0f} s left of the step's time"
    record["passed"] = all(row["status"] == "PASS" for key in checks for row in record[key].values())
    return record


STEPS = {"te-check": te_check}

if __name__ == "__main__":
    sys.exit(step_main(STEPS))

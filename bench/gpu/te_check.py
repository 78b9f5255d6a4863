"""Tier 2: ``megatron-siamese check`` on the Transformer Engine spec, bf16 and FP8, on one GPU.

    te-check   the check's single-GPU layouts (full and selective recompute) against the
               single-rank reference, with Transformer Engine's modules in bf16 and with FP8
               (hybrid format, delayed scaling): the check's own TE and FP8 path (seeding TE's
               parameter names, the bf16 and FP8 tolerances of docs/parallelism.md). Passed when
               every layout passes. Multi-GPU layouts need more than the one lent GPU: run
               `check --layouts all --transformer-impl transformer_engine` on a node.

    python bench/gpu/te_check.py te-check --result out.json [--rehearse]

A rehearsal (CPU) runs the same layouts on the local modules in fp32, then stops at the GPU.
"""

from __future__ import annotations

import dataclasses
import sys

from common import require_gpu, step_main

LAYOUTS = ["full", "sel"]


def judged(case) -> dict:
    from megatron_siamese.check.command import run_check

    rows = run_check(case, LAYOUTS, "siamese")
    return {row.layout: dataclasses.asdict(row) for row in rows}


def te_check(rehearse: bool) -> dict:
    from megatron_siamese.check.case import ModelCase

    record = {"local-fp32": judged(ModelCase())}
    require_gpu(rehearse, "the check on Transformer Engine's modules")
    te = ModelCase(transformer_impl="transformer_engine", dtype="bf16", hidden_size=256, num_attention_heads=4,
                   num_query_groups=2, ffn_hidden_size=1024, seq_length=128, vocab_size=1024)
    record["te-bf16"] = judged(te)
    record["te-fp8"] = judged(dataclasses.replace(te, fp8="hybrid", fp8_recipe="delayed"))
    record["passed"] = all(row["status"] == "PASS" for key in ("local-fp32", "te-bf16", "te-fp8")
                           for row in record[key].values())
    return record


STEPS = {"te-check": te_check}

if __name__ == "__main__":
    sys.exit(step_main(STEPS))

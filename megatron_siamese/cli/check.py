"""``megatron-siamese check``: every parallel layout against one rank (check/command.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import List

from megatron_siamese.check import DEFAULT_LAYOUTS, SPECS
from megatron_siamese.check.case import ModelCase
from megatron_siamese.check.faults import FAULTS
from megatron_siamese.cli.flags import HelpFormatter
from megatron_siamese.runtime.divisibility import layout_part, shape_problems, split_problems
from megatron_siamese.runtime.layout import parse_layout
from megatron_siamese.runtime.settings import MODEL_CLASSES
from megatron_siamese.training.args import ConfigError

DESCRIPTION = """\
Prove on your own machines that every parallel layout computes what one device computes.

For each layout it launches the ranks itself (gloo on CPU, NCCL when CUDA is present), builds
the same tiny GPT from global-name-seeded weights, runs one training step of the same global
batch through Megatron's schedules, finalize_model_grads and optimizer, and compares against
a single-rank run: every per-microbatch loss, every gradient and every parameter after the
step. One row per layout; the exit status is 1 if any layout fails.

Layout names: sizes tpN, ppN, vppN (virtual stages per pipeline rank), cpN, dpN and flags sp
(sequence parallel), do (distributed optimizer), full / sel (full / selective recompute),
joined by '-'; 'single' is one rank. Example: tp2-pp2-sp.
"""

SIZES = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size",
         "seq_length", "micro_batch_size", "num_microbatches", "seed")


def add_parser(commands, name: str) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help="every parallel layout against one rank", description=DESCRIPTION,
                                 formatter_class=HelpFormatter)
    parser.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help="comma-separated layout names")
    parser.add_argument("--spec", choices=sorted(SPECS), default="siamese",
                        help="siamese: SiameseNorm via the Python API; siamese-layer: via the layer spec object "
                             "Megatron-LM's --spec imports; siamese-hybrid: the authors' hybrid variant; stock: "
                             "Megatron's Pre-Norm layer, as a control for the check itself")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="parameter and activation dtype (bf16: mixed precision, fp32 main grads); sets the tolerance")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="process-group backend (default: nccl with CUDA, else gloo)")
    for field in SIZES:
        parser.add_argument("--" + field.replace("_", "-"), type=int, default=getattr(ModelCase, field),
                            help="model and data size")
    parser.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm", help="norm kind")
    parser.add_argument("--model", choices=MODEL_CLASSES, default="gpt",
                        help="GPTModel, or HybridModel (megatron-core >= 0.19) with SiameseNorm sublayers")
    parser.add_argument("--hybrid-layer-pattern", default=None, metavar="PATTERN",
                        help="HybridModel layers, e.g. '*-*-' (default: '*-' per --num-layers)")
    parser.add_argument("--plant-fault", choices=sorted(FAULTS), default=None,
                        help="plant a known bug on every rank to see the check fail")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--list", action="store_true", help="print the default layouts and exit")
    return parser


def problems(case: ModelCase, layouts: List[str]) -> List[str]:
    """What keeps the check from running (one line each), found before any rank starts."""
    found = [f"--{field.replace('_', '-')} must be at least 1 (got {getattr(case, field)})"
             for field in SIZES if field != "seed" and (getattr(case, field) or 1) < 1]
    if found:
        return found
    found += shape_problems(case)
    for name in layouts:
        try:
            layout = parse_layout(name)
        except ValueError as error:
            found.append(f"--layouts: {error}")
            continue
        found += [f"layout {name}: {problem}" for problem in split_problems(
            case, layout, vocab_size=case.vocab_size, micro_batch_size=case.micro_batch_size,
            global_batch_size=case.micro_batch_size * case.num_microbatches,
            global_batch_flag="--micro-batch-size x --num-microbatches =", spell=layout_part)]
    return found


def run(options: argparse.Namespace) -> int:
    if options.list:
        print("\n".join(DEFAULT_LAYOUTS))
        return 0
    case = ModelCase(norm=SPECS[options.spec], dtype=options.dtype, normalization=options.normalization,
                     model=options.model, hybrid_layer_pattern=options.hybrid_layer_pattern,
                     **{field: getattr(options, field) for field in SIZES})
    layouts = [name.strip() for name in options.layouts.split(",") if name.strip()]
    found = problems(case, layouts)
    if found:
        raise ConfigError(found)
    from megatron_siamese.check.command import HEADER, run_check
    from megatron_siamese.check.compare import TOLERANCES

    tolerance = TOLERANCES[case.dtype]
    print(f"SiameseNorm parallel correctness check: spec={options.spec} model={case.model} dtype={case.dtype} "
          f"layers={case.num_layers} hidden={case.hidden_size} microbatches={case.num_microbatches}")
    print(f"tolerance ({case.dtype}): {tolerance.describe()}; errors shown are max|a-b| / max|ref|")
    print(HEADER, flush=True)
    start = time.perf_counter()
    rows = run_check(case, layouts, options.spec, backend=options.backend, fault=options.plant_fault,
                     echo=lambda line: print(line, flush=True))
    passed = sum(r.status == "PASS" for r in rows)
    bad = [r for r in rows if r.status in ("FAIL", "ERROR")]
    skipped = sum(r.status == "SKIP" for r in rows)
    print(f"{passed} passed, {len(bad)} failed, {skipped} skipped in {time.perf_counter() - start:.0f}s")
    if options.json:
        with open(options.json, "w") as out:
            json.dump([dataclasses.asdict(r) for r in rows], out, indent=2)
    return 1 if bad else 0

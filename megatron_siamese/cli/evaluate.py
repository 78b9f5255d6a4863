"""``megatron-siamese eval``: lm-evaluation-harness on a Transformers model directory (evaluation/)."""

from __future__ import annotations

import argparse
import os
import tempfile
from types import SimpleNamespace

from megatron_siamese.cli import flags
from megatron_siamese.training.args import ConfigError

RESULTS = "results.json"


def _parser(commands, name: str) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        name, help="lm-evaluation-harness on an exported model (needs the [hf] extra)",
        description="Run lm-evaluation-harness (--model hf, trust_remote_code) on a Transformers model directory, "
                    "by default on the held-out synthetic addition problems the study scores "
                    "(docs/evaluate.md). Prints the harness's table and writes its results as JSON.",
        formatter_class=flags.HelpFormatter)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--hf", metavar="DIR",
                       help="a Transformers model directory (megatron-siamese export --output-dir DIR)")
    model.add_argument("--load", metavar="CHECKPOINT",
                       help="a checkpoint (ours or Megatron-LM's, any TP/PP layout): exported to a temporary "
                            "Transformers directory first, as megatron-siamese export writes it")
    parser.add_argument("--tasks", default="siamese_addition",
                        help="comma-separated tasks: siamese_addition, siamese_addition_reversed (for models trained "
                             "on reversed sums, as study's addition runs are), or lm-evaluation-harness tasks whose data it can reach")
    parser.add_argument("--addition-digits", type=int, default=3,
                        help="operand digits of the addition problems")
    parser.add_argument("--limit", type=int, default=None, help="problems per task (default: all 500)")
    parser.add_argument("--batch-size", type=int, default=16, help="requests per forward pass")
    parser.add_argument("--device", default="cpu", help="torch device the harness runs the model on (e.g. cuda)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "auto"),
                        help="dtype the model is loaded in")
    parser.add_argument("--output-dir", default="runs/eval", help=f"where {RESULTS} goes")
    parser.add_argument("--log-samples", action="store_true", help=f"keep every request's result in {RESULTS}")
    parser.add_argument("--overwrite", action="store_true", help=f"replace an existing {RESULTS}")
    return parser


def _run(options: argparse.Namespace) -> int:
    from megatron_siamese.evaluation.harness import EvalPlan, check, evaluate, require_lm_eval, table, write_results

    plan = EvalPlan(model_dir=options.hf, tasks=[t.strip() for t in options.tasks.split(",") if t.strip()],
                    limit=options.limit, batch_size=options.batch_size, device=options.device, dtype=options.dtype,
                    addition_digits=options.addition_digits, log_samples=options.log_samples)
    check(plan)  # everything but an exported --load's directory, before exporting it
    output = os.path.join(options.output_dir, RESULTS)
    if os.path.exists(output) and not options.overwrite:
        raise ConfigError([f"{output} exists: choose another --output-dir or pass --overwrite"])
    require_lm_eval()
    addition = [task for task in plan.tasks if task.startswith("siamese_addition")]
    print(f"eval: {', '.join(plan.tasks)} on {options.hf or options.load}"
          + (f", {plan.limit} problems a task" if plan.limit else "")
          + (f" ({options.addition_digits}-digit held-out addition problems: a model trained on text, the embedded "
             "job's, scores near 0)" if addition else ""), flush=True)
    with tempfile.TemporaryDirectory(prefix="siamese-eval-") as scratch:
        if options.load is not None:
            plan.model_dir = _export(options.load, os.path.join(scratch, "hf"))
        results = evaluate(plan)
    print(table(results))
    write_results(results, output)
    print(f"results: {output}")
    return 0


def _export(checkpoint: str, directory: str) -> str:
    from megatron_siamese.hf.architecture import ExportError
    from megatron_siamese.hf.export import export
    from megatron_siamese.training.checkpoint_files import CheckpointError

    try:
        export(checkpoint, directory)
    except (ExportError, CheckpointError) as error:
        raise ConfigError([str(error)]) from None
    print(f"exported {checkpoint} to a temporary Transformers directory (as megatron-siamese export does)")
    return directory


evaluate = SimpleNamespace(add_parser=_parser, run=_run)

"""``megatron-siamese``: the package's commands.

    megatron-siamese train [flags]     pretrain a GPT (default: SiameseNorm, TP=2, embedded corpus)
    megatron-siamese check [flags]     every parallel layout against one rank (see check --help)
    megatron-siamese study [flags]     Pre-/Post-/SiameseNorm at three learning rates, and addition
    megatron-siamese upcycle --load PRE --output-dir OUT [model flags]
                                       a Pre-Norm checkpoint as an equivalent SiameseNorm one
    megatron-siamese analyze --load CKPT [--compare-load PRE] [model flags]
                                       stream contributions, logit lens, magnitudes, effective depth

Model flags (layers, hidden size, ...) are train's; upcycle and analyze run at tp=1, pp=1.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import List, Optional

from megatron_siamese.training.trainer import TrainArgs


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls, helps: dict) -> None:
    """One --flag per field, typed from the field's default."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool) or f.name in _OPTIONAL_BOOLS:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=helps.get(f.name))
        else:
            kind = type(default) if default is not None else (int if f.name in _OPTIONAL_INTS else str)
            parser.add_argument(flag, type=kind, default=default, help=helps.get(f.name))


_OPTIONAL_INTS = {"vpp", "ffn_hidden_size", "num_query_groups", "save_interval", "stop_step"}
_OPTIONAL_BOOLS = {"fused_ops"}

TRAIN_HELP = {
    "norm": "residual scheme: siamese (SiameseNorm), siamese-layer (the --spec layer object), "
            "siamese-hybrid (the authors' QK-norm variant), pre (Megatron's stock Pre-Norm layer), "
            "post (Post-Norm on Megatron's layer)",
    "tp": "tensor-parallel size", "pp": "pipeline-parallel size",
    "vpp": "virtual pipeline stages per pipeline rank (interleaved 1F1B)",
    "dp": "data-parallel size", "sp": "sequence parallelism (needs tp > 1)",
    "distributed_optimizer": "shard optimizer state over data-parallel ranks",
    "global_batch_size": "sequences per optimizer step (a multiple of micro-batch-size * dp)",
    "steps": "optimizer steps", "lr": "peak learning rate (linear warmup, cosine decay)",
    "eval_interval": "validate every N steps", "eval_iters": "validation batches per evaluation",
    "save_interval": "save a distributed checkpoint every N steps (and at the last step)",
    "load": "resume from a checkpoint directory (or a directory holding a `latest` file), in any "
            "TP/PP layout; with --steps equal to its step it only evaluates",
    "stop_step": "stop after this step and save a checkpoint (resume later with --load)",
    "fused_ops": "force the fused C++/CUDA ops on (--fused-ops) or off (--no-fused-ops); default: "
                 "on where the extension has kernels",
    "output_dir": "checkpoints and results go here",
    "cache_dir": "where the tokenized corpus and dataset indices are cached",
    "data_prefix": "an indexed dataset (.bin/.idx prefix) of byte tokens instead of the embedded corpus",
    "dtype": "fp32 or bf16", "recompute": "activation recompute: none, full or selective",
    "task": "lm (the corpus), or synthetic addition: addition (sum written normally) or "
            "addition-reversed (sum written least significant digit first); addition needs tp=pp=1 "
            "and reports exact-match accuracy on held-out problems",
    "addition_digits": "operands of up to this many digits for the addition tasks",
    "transformer_impl": "local (Megatron's own modules) or transformer_engine (TE GEMMs and attention, GPUs)",
    "fp8": "Transformer Engine FP8 format: hybrid or e4m3 (needs --transformer-impl transformer_engine)",
    "fp8_recipe": "FP8 scaling recipe as Megatron names it: delayed, tensorwise or mxfp8 (Blackwell)",
}


def _train_args(options: argparse.Namespace) -> TrainArgs:
    fields = {f.name for f in dataclasses.fields(TrainArgs)}
    return TrainArgs(**{k: v for k, v in vars(options).items() if k in fields})


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-siamese", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser("train", help="pretrain a GPT with Megatron-Core")
    _add_dataclass_flags(train_parser, TrainArgs, TRAIN_HELP)
    train_parser.add_argument(
        "--compare", nargs="?", const="pre,siamese", default=None, metavar="NORMS",
        help="run the same training for each comma-separated scheme (default: pre,siamese), print "
             "a side-by-side table and write loss curves to OUTPUT_DIR/compare.png")
    commands.add_parser("check", help="parallel correctness check (flags: check --help)",
                        add_help=False)
    for name, text in (("upcycle", "convert a stock Pre-Norm checkpoint into SiameseNorm"),
                       ("analyze", "stream analysis of a SiameseNorm checkpoint")):
        sub = commands.add_parser(name, help=text)
        _add_dataclass_flags(sub, TrainArgs, TRAIN_HELP)
        sub.set_defaults(tp=1, progress=False)  # single rank; checkpoints reshard on load
        if name == "analyze":
            sub.add_argument("--compare-load", default=None,
                             help="a Pre-Norm checkpoint of the same size for the effective-depth probes")
    study_parser = commands.add_parser(
        "study", help="the small-scale reproduction study (about 42 minutes on 2 CPU cores)")
    study_parser.add_argument("--output-dir", default="runs/study")
    study_parser.add_argument("--cache-dir", default=".cache/megatron_siamese")
    study_parser.add_argument("--steps", type=int, default=None,
                              help="language-modelling steps per run (default: the plan's 200)")
    study_parser.add_argument("--arithmetic-steps", type=int, default=None,
                              help="addition steps per run (default: the plan's 1500)")
    study_parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds")
    study_parser.add_argument("--schemes", default=None,
                              help="comma-separated subset of pre,post,siamese,siamese-hybrid")
    study_parser.add_argument("--learning-rates", default=None,
                              help="comma-separated peak learning rates (default: 1e-3,4e-3,1.6e-2)")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:
        from megatron_siamese.check.command import main as check_main

        return check_main(argv[1:])
    options = parser.parse_args(argv)

    if options.command in ("upcycle", "analyze"):
        if (options.tp, options.pp, options.vpp, options.dp) != (1, 1, None, 1):
            parser.error(f"{options.command} runs on one rank: drop --tp/--pp/--vpp/--dp (any saved "
                         "layout loads at tp=1, pp=1)")
        args = dataclasses.replace(_train_args(options), load=None)  # --load is what they read
        if options.command == "upcycle":
            from megatron_siamese.research.upcycle import upcycle

            print(f"SiameseNorm checkpoint (step 0): {upcycle(args, options.load)}")
        else:
            from megatron_siamese.research.analysis import analyze, format_tables

            results = analyze(dataclasses.replace(args, load=options.load), options.compare_load)
            print(format_tables(results))
            print(f"plots in {args.output_dir}")
    if options.command == "study":
        from megatron_siamese.research.study import StudyPlan, run_study, tables

        plan = StudyPlan(output_dir=options.output_dir, cache_dir=options.cache_dir,
                         seeds=tuple(int(v) for v in options.seeds.split(",")))
        if options.schemes:
            plan.schemes = tuple(options.schemes.split(","))
        if options.learning_rates:
            plan.learning_rates = tuple(float(v) for v in options.learning_rates.split(","))
        if options.arithmetic_steps:
            plan.arithmetic_steps = options.arithmetic_steps
        if options.steps:
            plan.base = dataclasses.replace(plan.base, steps=options.steps,
                                            warmup_steps=min(plan.base.warmup_steps, options.steps - 1),
                                            eval_interval=min(plan.base.eval_interval, options.steps))
        print(tables(run_study(plan)))
    if options.command == "train":
        from megatron_siamese.training.trainer import format_summary, train

        args = _train_args(options)
        if options.compare:
            from megatron_siamese.training.compare import compare

            print(compare(args, [n.strip() for n in options.compare.split(",") if n.strip()]))
        else:
            print(format_summary(train(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

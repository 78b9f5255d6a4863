"""``megatron-siamese``: the package's commands.

    megatron-siamese train [flags]     pretrain a GPT (default: SiameseNorm, TP=2, embedded corpus)
    megatron-siamese check [flags]     every parallel layout against one rank (see check --help)
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


_OPTIONAL_INTS = {"vpp", "ffn_hidden_size", "save_interval", "stop_step"}
_OPTIONAL_BOOLS = {"fused_ops"}

TRAIN_HELP = {
    "norm": "residual scheme: siamese (SiameseNorm), siamese-layer (the --spec layer object), "
            "pre (Megatron's stock Pre-Norm layer), post (Post-Norm on Megatron's layer)",
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
}


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
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:
        from megatron_siamese.check import main as check_main

        return check_main(argv[1:])
    options = parser.parse_args(argv)

    if options.command == "train":
        from megatron_siamese.training.trainer import format_summary, train

        fields = {f.name for f in dataclasses.fields(TrainArgs)}
        args = TrainArgs(**{k: v for k, v in vars(options).items() if k in fields})
        if options.compare:
            from megatron_siamese.training.compare import compare

            print(compare(args, [n.strip() for n in options.compare.split(",") if n.strip()]))
        else:
            print(format_summary(train(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

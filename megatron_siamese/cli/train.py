"""``megatron-siamese train``: Megatron-LM's own training loop with SiameseNorm's model (runtime/pretrain.py).
Under a launcher (RANK and WORLD_SIZE set) it is the calling rank; else it starts the ranks through
torchrun's machinery (standalone: one host). Refused on megatron-core 0.16.1, which has no training loop."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from megatron_siamese.runtime.registry import ConfigError
from megatron_siamese.versions import training_loop_problem

DESCRIPTION = """\
Pretrain a GPT with Megatron-LM's own training loop (megatron.training.pretrain): its flags, its
checkpoints (--save/--load, --save-interval, --async-save, --exit-signal-handler), its logs
(iteration lines, --tensorboard-dir, --wandb-project), with SiameseNorm's layers (--norm picks
another residual scheme). With no model flags (--num-layers) it trains the embedded default: a
4-layer GPT on the King James Bible, byte tokens, 300 steps; with no data flags, on that corpus.

Without a GPU it runs on CPU with gloo. The command's own flags:
  --nproc-per-node N    ranks to start without torchrun (default: TP x PP x CP x EP, so DP 1; more
                        ranks are data parallel)
  --compare [SCHEMES]   one run per comma-separated scheme (pre,siamese without a value), the same
                        flags otherwise; then a table and the curves in TENSORBOARD_DIR/compare.png
Megatron-LM's flags follow, then ours in their group "SiameseNorm (megatron_siamese)".
"""
# Megatron-LM's model-parallel sizes whose product is the ranks one model replica takes
REPLICA_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                 "--expert-model-parallel-size")


def add_parser(commands, name: str) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help="pretrain a GPT with Megatron-LM's training loop", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    parser.add_argument("-h", "--help", action="store_true", help="this help, then Megatron-LM's flags")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                        help="ranks to start without torchrun (torchrun's flag; default: TP x PP x CP x EP)")
    parser.add_argument("--compare", nargs="?", const="pre,siamese", default=None, metavar="SCHEMES",
                        help="one run per comma-separated scheme (pre,siamese without a value), the same flags "
                             "otherwise; then a table and the curves in TENSORBOARD_DIR/compare.png")
    parser.set_defaults(megatron_flags=[])  # everything else: Megatron-LM's flags (cli.main)
    return parser


def ranks_per_replica(flags: list) -> int:
    from megatron_siamese.runtime.pretrain_flags import flag_value

    product = 1
    for flag in REPLICA_FLAGS:
        value = flag_value(flags, flag)
        if value is not None:
            if not value.isdigit() or int(value) < 1:
                raise SystemExit(f"megatron-siamese train: {flag} {value}: expected a positive integer")
            product *= int(value)
    return product


def launched() -> bool:
    """Whether a launcher started this process as one rank of a job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(options: argparse.Namespace) -> int:
    flags = list(options.megatron_flags)
    problem = training_loop_problem("megatron-siamese train")
    if options.help:
        print(DESCRIPTION)
        if problem:  # no Megatron-LM parser to list the flags of
            print(problem)
        else:
            from megatron_siamese.runtime.pretrain import print_help

            print_help()
        return 0
    if problem:
        raise ConfigError([problem])
    if launched():
        if options.nproc_per_node is not None or options.compare is not None:
            given = "--nproc-per-node" if options.nproc_per_node is not None else "--compare"
            raise ConfigError([f"{given} starts ranks itself, and a launcher (torchrun) started this one: run it "
                               "without the launcher"])
        from megatron_siamese.runtime import pretrain

        sys.argv = ["megatron-siamese train", *flags]
        pretrain.main()
        return 0
    ranks = options.nproc_per_node or ranks_per_replica(flags)
    if options.compare is not None:
        from megatron_siamese.runtime import scheme_comparison

        norms = scheme_comparison.parse(options.compare)
        found = scheme_comparison.problems(norms, flags)
        if found:
            raise ConfigError(found)
        return scheme_comparison.compare_schemes(norms, flags, lambda run_flags: start_ranks(ranks, run_flags))
    return start_ranks(ranks, flags)


def start_ranks(ranks: int, flags: list) -> int:
    """The job's ranks through torchrun's machinery; its exit status: 2 when the ranks refused the
    flags (rank 0 said why), 1 when a rank failed (it printed its own error; torchrun's summary
    names it)."""
    print(f"megatron-siamese train: {ranks} rank{'s' if ranks > 1 else ''} on this host "
          f"(torchrun --standalone --nproc-per-node {ranks})", flush=True)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run as torchrun

    from megatron_siamese.runtime.quiet import warning_options

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default for several ranks, without its notice
    os.environ.setdefault("PYTHONWARNINGS", warning_options())  # the notices Megatron warns at import
    arguments = get_args_parser().parse_args(["--standalone", "--nproc-per-node", str(ranks), "--module",
                                              "megatron_siamese.runtime.pretrain", *flags])
    try:
        torchrun(arguments)
    except SignalException as stopped:  # torchrun's agent passed it to every rank and waited for them
        name = signal.Signals(stopped.sigval).name
        print(f"megatron-siamese train: stopped by {name}, which every rank was sent (under --exit-signal-handler "
              "each finishes its iteration and saves a checkpoint first)", file=sys.stderr, flush=True)
        return 128 + stopped.sigval
    except ChildFailedError as failure:
        if any(error.exitcode == 2 for error in failure.failures.values()):  # a usage error: rank 0 said it
            return 2
        rank, error = next(iter(failure.failures.items()))
        print(f"megatron-siamese train: error: rank {rank} exited with status {error.exitcode} "
              "(its own error is above)", file=sys.stderr, flush=True)
        return 1
    return 0

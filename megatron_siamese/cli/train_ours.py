"""``megatron-siamese train`` on megatron-core 0.16.1, whose wheel has no Megatron training loop: our
own (training/trainer.py), until issue 51 deletes it (cli/train.py runs Megatron's loop from 0.17)."""

from __future__ import annotations

import argparse
import sys

from megatron_siamese.cli import flags

DESCRIPTION = """\
Pretrain a GPT with Megatron-Core: SiameseNorm by default, or a stock baseline (--norm);
TP, SP, PP (virtual stages too), DP with the distributed optimizer, mixture-of-experts layers
(--num-experts) with EP, recompute; the embedded King James Bible, byte-level. Megatron-LM's
flag names work (--tensor-model-parallel-size, --train-iters, --micro-batch-size, ...) beside
the short ones (--tp, --steps, ...).

Checkpoints: --save-interval N (and at the end), --stop-step N, --exit-interval N,
--exit-duration-in-mins M; Ctrl-C, SIGTERM, SIGUSR1 or SIGUSR2 (to the command, any rank, or all
of a job's processes) finishes the step on every rank, saves a checkpoint and exits 0 (a second
signal stops at once); --load resumes. One job at a time per --output-dir (a lock file).
"""


def add_parser(commands, name: str) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help="pretrain a GPT with Megatron-Core", description=DESCRIPTION,
                                 formatter_class=flags.HelpFormatter)
    flags.add_model_flags(parser)
    flags.add_parallel_flags(parser)
    flags.add_training_flags(parser)
    flags.add_checkpoint_flags(parser)
    flags.add_data_flags(parser)
    flags.add_logging_flags(parser)
    parser.add_argument("--compare", nargs="?", const="pre,siamese", default=None, metavar="NORMS",
                        help="run the same training for each comma-separated scheme (pre,siamese without a value), "
                             "print a side-by-side table and write loss curves to OUTPUT_DIR/compare.png")
    return parser


def run(options: argparse.Namespace) -> int:
    args = flags.train_args(options)  # ConfigError: every problem, before anything starts
    from megatron_siamese.training.preflight import loads_its_empty_save_directory, resume_hint

    load = args.load

    if loads_its_empty_save_directory(args):  # a requeued job's first attempt, as Megatron-LM starts it
        import dataclasses

        print(f"--load {args.load} holds no checkpoint yet (it is the --save directory): starting from step 0",
              flush=True)
        args = dataclasses.replace(args, load=None)
    if options.compare:
        from megatron_siamese.training.args import ConfigError
        from megatron_siamese.training.compare import compare

        norms = [n.strip() for n in options.compare.split(",") if n.strip()]
        problems = [p for norm in norms for p in _scheme_problem(args, norm)]
        if problems:
            raise ConfigError(problems)
        table = compare(args, norms)
        if table is not None:  # rank 0 of a launched job speaks for it
            print(table)
        return 0
    from megatron_siamese.runtime import launch
    from megatron_siamese.runtime.hangs import CollectiveTimeout

    launch.start_rank_server()  # the ranks' imports overlap the trainer's below
    from megatron_siamese.training.run_log import results_line
    from megatron_siamese.training.trainer import format_summary, train

    try:
        summary = train(args)
    except launch.RankFailed as failure:  # a lost rank: say where the run goes on from
        raise launch.RankFailed(f"{failure}{resume_hint(args, load)}", failure.details) from None
    except CollectiveTimeout as hung:  # under torchrun or srun: this rank's own words, and the same hint
        raise CollectiveTimeout(f"{hung}{resume_hint(args, load)}") from hung
    if summary is None:  # a rank of a launched job other than 0: rank 0 reports
        return 0
    if summary.stopped:
        from megatron_siamese.training.preflight import checkpoint_dir, foreign_checkpoints

        why = f" ({summary.stop_reason})" if summary.stop_reason else ""
        if summary.checkpoints:  # where --save put them (OUTPUT_DIR/checkpoints without it)
            print(f"stopped at step {summary.steps_done}{why}: checkpoint saved to {summary.checkpoints[-1]} "
                  f"(resume with --load {checkpoint_dir(args)})", file=sys.stderr)
        else:
            print(f"stopped at step {summary.steps_done}{why}: not saved, {checkpoint_dir(args)} holds another run's "
                  f"checkpoints ({', '.join(foreign_checkpoints(args))}; --overwrite replaces them)", file=sys.stderr)
        return 0
    print(format_summary(summary))
    print(results_line(args, summary))
    return 0


def _scheme_problem(args, norm: str):
    import dataclasses

    from megatron_siamese.training.args import ConfigError

    try:
        dataclasses.replace(args, norm=norm)
    except ConfigError as error:
        return [f"--compare {norm}: {p}" for p in error.problems]
    return []

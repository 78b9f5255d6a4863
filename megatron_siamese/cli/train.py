"""``megatron-siamese train``: Megatron-LM's own training loop with SiameseNorm's model (runtime/pretrain.py).
Under a launcher (RANK and WORLD_SIZE set) it is the calling rank; else it starts the ranks through
torchrun's machinery (standalone: one host). Refused on megatron-core 0.16.1, which has no training loop."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Optional

from megatron_siamese.runtime.registry import ConfigError
from megatron_siamese.versions import training_loop_problem

DESCRIPTION = """\
Pretrain a GPT with Megatron-LM's own training loop (megatron.training.pretrain): its flags, its
checkpoints (--save/--load, --save-interval, --async-save, --exit-signal-handler), its logs
(iteration lines, --tensorboard-dir, --wandb-project), with SiameseNorm's layers (--norm picks
another residual scheme). With no model flags (--num-layers) it trains the embedded default: a
4-layer GPT on the King James Bible, byte tokens, 300 iterations; with no data flags, on that corpus.

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


# imported once by the server the ranks fork from (beside runtime/launch.py's): Megatron-LM's loop, and the
# tokenizer package its NullTokenizer imports (with transformers: seconds a rank would spend each)
RANK_PRELOAD = ("megatron_siamese.runtime.pretrain", "megatron.training", "megatron.core.tokenizers.text.libraries")


def start_ranks(ranks: int, flags: list, log: Optional[str] = None, environment: Optional[dict] = None) -> int:
    """The job's ranks through torchrun's machinery (torch's elastic launch: a standalone rendezvous,
    its agent here), each running ``runtime.pretrain`` with ``flags``; on CPU forked from a server that
    imported Megatron-LM's loop once. Its exit status: 2 when the ranks refused the flags (rank 0 said
    why), 1 when a rank failed (it printed its own error). ``log``: a file the ranks write their output
    to; ``environment``: variables set in each rank."""
    import tempfile
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    from megatron_siamese import device
    from megatron_siamese.runtime import launch
    from megatron_siamese.runtime.quiet import warning_options

    started = (f"megatron-siamese train: {ranks} rank{'s' if ranks > 1 else ''} on this host "
               f"(torchrun --standalone --nproc-per-node {ranks})")
    _tell(started, log, sys.stdout)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default for several ranks, without its notice
    os.environ.setdefault("PYTHONWARNINGS", warning_options())  # the notices Megatron warns at import
    method = launch.start_method(device.backend(), RANK_PRELOAD)
    # torchrun --standalone's rendezvous (torch.distributed.run.run), with a function for the ranks to run
    # the agent's files in a directory removed after (torchrun's default, a new /tmp/torchelastic_* each run, stays)
    agent_files = tempfile.TemporaryDirectory(prefix="megatron-siamese-agent-", ignore_cleanup_errors=True)
    arguments = get_args_parser().parse_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
                                              "--rdzv-id", str(uuid.uuid4()), "--nproc-per-node", str(ranks),
                                              "--start-method", method, "--log-dir", agent_files.name,
                                              "--no-python", "megatron-siamese-rank"])
    config, _, _ = config_from_args(arguments)
    try:
        with launch.agent_in_this_process():
            # in each rank too: a server another command started has the environment it had then
            inherited = {name: os.environ[name] for name in ("OMP_NUM_THREADS", "PYTHONWARNINGS")}
            elastic_launch(config, train_rank)(flags, os.getpid(), log, {**inherited, **(environment or {})})
    except SignalException as stopped:  # torch's agent passed it to every rank and waited for them
        print(f"megatron-siamese train: stopped by {signal.Signals(stopped.sigval).name}, which every rank was sent"
              f"{saving_note(stopped.sigval, flags)}", file=sys.stderr, flush=True)
        return 128 + stopped.sigval
    except ChildFailedError as failure:
        if any(error.exitcode == 2 for error in failure.failures.values()):  # a usage error: rank 0 said it
            return 2
        if any(error.exitcode == launch.INTERRUPTED for error in failure.failures.values()):
            # SIGINT reached the ranks, not this agent (a thread's, as study's, or one sent to the ranks alone)
            _tell(f"megatron-siamese train: stopped by SIGINT, which reached its ranks, not this command"
                  f"{saving_note(signal.SIGINT, flags)}", log, sys.stderr)
            return launch.INTERRUPTED
        rank, error = next(iter(failure.failures.items()))
        print(f"megatron-siamese train: error: rank {rank} exited with status {error.exitcode} "
              "(its own error is above)", file=sys.stderr, flush=True)
        return 1
    finally:
        agent_files.cleanup()
    return 0


def _tell(line: str, log: Optional[str], stream) -> None:
    """``line`` to the ranks' ``log`` if they have one, else to ``stream``."""
    if log is None:
        print(line, file=stream, flush=True)
    else:
        with open(log, "a") as out:
            print(line, file=out)


def saving_note(signum: int, flags: list) -> str:
    """What the ranks saved on ``signum``, to end the line that says the job stopped: Megatron's
    --exit-signal-handler saves on its --exit-signal (SIGTERM unless given) where --save names a directory.
    Where it saved nothing on the signal, the newest checkpoint of --save and how to resume from it."""
    from megatron_siamese.runtime.pretrain_flags import flag_value

    exit_signal = flag_value(flags, "--exit-signal") or "SIGTERM"  # Megatron-LM's default (a name: its parser's)
    save = flag_value(flags, "--save")
    newest = newest_saved(save)
    if "--exit-signal-handler" not in flags or exit_signal != signal.Signals(signum).name:
        resume = ("" if newest is None else
                  f"; the same command resumes from iteration {newest}, the newest checkpoint in {save}"
                  if flag_value(flags, "--load") == save else
                  f"; the newest checkpoint in {save} is iteration {newest}: add --load {save} to resume from it")
        return f"; no checkpoint was saved on it (--exit-signal-handler saves one on {exit_signal} first){resume}"
    if save is None:
        return " (under --exit-signal-handler each finishes its iteration first; without --save nothing is saved)"
    return (" (under --exit-signal-handler each finishes its iteration and saves a checkpoint first; "
            + (f"the newest in {save}: iteration {newest})" if newest else f"none is recorded in {save})"))


def newest_saved(save: Optional[str]) -> Optional[str]:
    """The iteration of the newest checkpoint Megatron recorded in ``save`` (read when the ranks have ended)."""
    from megatron_siamese.training.checkpoint_files import TRACKER

    tracker = os.path.join(save, TRACKER) if save else None
    return open(tracker).read().strip() if tracker and os.path.isfile(tracker) else None


def train_rank(flags: list, launcher_pid: int, log: Optional[str], environment: dict) -> None:
    """One rank of ``start_ranks``' job: Megatron-LM's loop with ``flags``, its output to ``log`` if given."""
    from megatron_siamese.runtime.launch import default_signal_handlers, interrupt_as_exit_status

    default_signal_handlers()  # first: the server's ignored stop signals would lose the agent's meanwhile
    import faulthandler
    import multiprocessing
    import traceback

    import torch
    import torch._dynamo

    from megatron_siamese.runtime import orphans, pretrain

    orphans.watch(launcher_pid)  # a rank forked from the server outlives a killed launcher otherwise
    # a process forked from the server has its start method for default: a fresh rank has the platform's
    # (Megatron's data loader workers are forked from the rank, with a local worker_init_fn)
    multiprocessing.set_start_method(None, force=True)
    os.environ.update(environment)
    # what runtime.pretrain sets before torch's import, read at that import: a server another command
    # started (study's accuracy runs, the check's) imported torch without it
    torch._dynamo.config.disable = os.environ.get("TORCHDYNAMO_DISABLE") == "1"
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if log is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(output, 1)
        os.dup2(output, 2)
    faulthandler.enable()  # a crash leaves each thread's Python stack in the rank's output
    sys.argv = ["megatron-siamese train", *flags]
    try:
        with interrupt_as_exit_status():
            pretrain.main()
    except SystemExit:
        end_on_a_held_back_signal_soon()
        raise
    except Exception:  # torch's worker wrapper would keep the traceback to itself
        traceback.print_exc()
        sys.stderr.flush()
        raise
    end_on_a_held_back_signal_soon()  # noted after the loop's last check, it ended the loop no sooner


# how long a rank stopped by a signal waits for the agent to take its result: the agent reads every rank's
# once all have returned (Megatron's signal handler stops them at one iteration; the last rank then draws the
# loss curve)
STOPPED_RANK_GRACE_S = 10.0


def end_on_a_held_back_signal_soon() -> None:
    """A rank whose loop noted a signal (--exit-signal-handler holds it back until the checkpoint is saved)
    ends on it, unless the agent takes its result first. The agent that sent the signal to stop the job
    waits for its ranks to end, not for their results (torch's worker wrapper would wait for that read
    until the agent's 30 s ran out and it killed the rank); ranks sent the signal by anyone else return
    their results as usual, within the grace."""
    import threading
    import time

    from megatron_siamese.runtime.pretrain import held_back_exit_signal

    signum = held_back_exit_signal()
    if signum is None:
        return
    from megatron_siamese.versions import speaks_for_the_job

    if speaks_for_the_job():  # the agent's line follows when every rank has ended: seconds, said here
        print(f"megatron-siamese train: {signal.Signals(signum).name} noted; the loop has ended (saving first, with "
              f"--save) and its ranks end within {STOPPED_RANK_GRACE_S:.0f} s", flush=True)

    def end():
        time.sleep(STOPPED_RANK_GRACE_S)
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signum)

    # the signal's own ending, here (only the main thread may set it): SIGINT's Python handler would end the
    # rank with an exception, in another thread
    signal.signal(signum, signal.SIG_DFL)
    threading.Thread(target=end, name="end-on-the-signal", daemon=True).start()

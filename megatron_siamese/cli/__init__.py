"""``megatron-siamese``: the package's commands.

    megatron-siamese train [flags]      Megatron-LM's pretrain() with SiameseNorm's layers, Megatron-LM's
                                        flags (default: the embedded job; megatron-core >= 0.17)
    megatron-siamese check [flags]      every parallel layout against one rank
    megatron-siamese plan [train flags] --gpu-memory GPU
                                        what the job costs per GPU, stock Pre-Norm beside SiameseNorm
    megatron-siamese study [flags]      every residual scheme at five learning rates, and addition (each
                                        run Megatron-LM's loop)
    megatron-siamese upcycle --load PRE --output-dir OUT
                                        a Pre-Norm checkpoint as an equivalent SiameseNorm one
    megatron-siamese analyze --load CKPT [--compare-load PRE]
                                        stream contributions, logit lens, magnitudes, effective depth
    megatron-siamese generate --load CKPT --prompt TEXT [--prompt TEXT ...] [--tp N --pp N]
                                        continue prompts (Megatron's inference engine, KV cache)
    megatron-siamese export --load CKPT --output-dir DIR
                                        a checkpoint (any layout) as a Hugging Face Transformers model
    megatron-siamese import-hf --hf DIR --output-dir OUT
                                        a Hugging Face model directory back as a Megatron checkpoint
    megatron-siamese eval --hf DIR | --load CKPT [--tasks T]
                                        lm-evaluation-harness on an exported model (addition by default)

Every command checks all of its settings before starting any rank (train: on its ranks, with
Megatron-LM's parser, before any model is built) and says, one line per problem, what to change
(exit status 2). Failures print one line; ``--debug`` (or MEGATRON_SIAMESE_DEBUG=1) prints the
traceback too.

Every command also runs as the ranks of a job ``torchrun`` launched (single- or multi-node,
``srun torchrun`` on SLURM; runtime/launch.py): then rank 0 speaks for the job (settings
problems, tables, summaries), every rank exits with the same status, and a rank's own failure
names the rank.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import select
import sys
import traceback
from typing import List, Optional

from megatron_siamese.cli import check, generate, hf, plan, research, train
from megatron_siamese.cli.evaluate import evaluate
from megatron_siamese.runtime.launchers import JoinError, LaunchError
from megatron_siamese.runtime.registry import typos
from megatron_siamese.training.args import ConfigError

DEBUG_ENV = "MEGATRON_SIAMESE_DEBUG"
COMMANDS = {"train": train, "check": check, "plan": plan, "study": research.study, "upcycle": research.upcycle,
            "analyze": research.analyze, "generate": generate, "export": hf.export, "import-hf": hf.import_hf,
            "eval": evaluate}


class Parser(argparse.ArgumentParser):
    """One line for a usage error, exit status 2, with the nearest flag to each one it does not know. No
    abbreviations (subcommands' parsers are of this class too): ``--save DIR`` must not silently mean
    ``--save-interval``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.words: List[str] = []

    def parse_known_args(self, args=None, namespace=None):
        self.words = list(sys.argv[1:] if args is None else args)  # for error's hints
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        # a command passing the rest on to Megatron-LM's parser (train, plan) knows too few flags to name typos
        hints = "" if self.get_default("megatron_flags") is not None else typos(self.words, self._option_string_actions)
        self.exit(2, f"{self.prog}: error: {message}{hints} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="megatron-siamese", description=(__doc__ or "").replace("``", ""),  # read as text, not reST
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        sub = command.add_parser(commands, name)
        sub.add_argument("--debug", action="store_true", help="print tracebacks of failures (also: "
                                                               f"{DEBUG_ENV}=1)")
    return parser


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    subcommands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return subcommands.choices[command]


def _report(command: str, lines: List[str], every_rank: bool = False) -> None:
    """Errors for the user: from rank 0 of a launched job (every rank finds the same settings
    problems), or, for a rank's own failure, from that rank, named."""
    from megatron_siamese.runtime import launchers

    prefix = "" if launchers.reporter() else f"rank {os.environ.get('RANK', '?')}: "
    if prefix and not every_rank:
        return
    for line in lines:
        print(f"megatron-siamese {command}: error: {prefix}{line}", file=sys.stderr, flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    from megatron_siamese.runtime.quiet import silence_known_notices

    options = parse(sys.argv[1:] if argv is None else argv)
    debug = options.debug or os.environ.get(DEBUG_ENV) == "1"
    _say_where_a_crash_was()
    silence_known_notices()
    try:
        return COMMANDS[options.command].run(options)
    except ConfigError as error:  # settings it cannot run with: say what to change
        _report(options.command, error.problems, every_rank=getattr(error, "every_rank", False))
        return 2
    except JoinError as error:  # this rank could not meet the others: each rank says so itself
        _report(options.command, [str(error)], every_rank=True)
        return 2
    except LaunchError as error:  # a launch that cannot be this run's job (the same on every rank)
        _report(options.command, [str(error)])
        return 2
    except KeyboardInterrupt:
        print(f"megatron-siamese {options.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError as error:
        if not _stdout_reader_gone():  # a pipe of the run's own broke (to a rank, the fork server): a failure
            return _failed(options.command, error, debug)
        # the reader went away (`... --list | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as error:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        return _failed(options.command, error, debug)


def parse(words: List[str]) -> argparse.Namespace:
    """The options of a command line (its command first); a usage error exits 2, saying so."""
    parser = build_parser()
    options, unknown = parser.parse_known_args(words)
    options.argv = list(words[1:])  # the command's words: which flags were given (plan takes train's rule from them)
    if unknown and getattr(options, "megatron_flags", None) is not None:
        options.megatron_flags = unknown  # train on Megatron's loop: Megatron-LM's parser reads them
    elif unknown:  # said by the command's parser: its name, and its --help to read
        _command_parser(parser, options.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    return options


def _say_where_a_crash_was() -> None:
    """A native crash (SIGSEGV in torch, gloo, a kernel), under torchrun too, prints each
    thread's Python stack (spawned ranks enable it themselves)."""
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable()
        except (AttributeError, ValueError):  # stderr is no file (replaced in-process): leave it
            pass


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader closed it: only then is a BrokenPipeError the reader's doing
    (silencing stdout after any other would swallow the run's output and report success)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll, or stdout is no file (replaced, closed)
        return False


def _failed(command: str, error: BaseException, debug: bool) -> int:
    """One line for a failure (a rank's own error, not the launcher's wrapper); the traceback on request."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    summary = lines[0] if type(error).__name__ == "RankFailed" else f"{type(error).__name__}: {lines[-1]}"
    _report(command, [summary], every_rank=True)
    if debug:
        traceback.print_exception(error)
        details = getattr(error, "details", "")
        if details:
            print(details, file=sys.stderr)
    else:
        print(f"(run with --debug or {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

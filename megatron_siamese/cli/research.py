"""``megatron-siamese study``, ``upcycle`` and ``analyze``: the research tools (research/)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import textwrap
from types import SimpleNamespace
from typing import List, Optional

from megatron_siamese.cli import flags
from megatron_siamese.research.study import SCHEMES
from megatron_siamese.training.args import ConfigError


def _split(text: str, kind, flag: str) -> tuple:
    try:
        values = tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError([f"{flag} takes comma-separated {kind.__name__} values (got {text!r})"]) from None
    if not values:
        raise ConfigError([f"{flag} is empty"])
    return values


# -- study -------------------------------------------------------------------------------


def _study_parser(commands, name: str) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help="the small-scale reproduction study (about an hour on 2 CPU cores)",
                                 description="Pre-Norm, Post-Norm, SiameseNorm and its hybrid variant, HybridNorm, Mix-LN "
                                             "and the paper's ablation at five learning rates (two seeds, a warmup of a "
                                             "quarter of the run; the single-stream schemes and SiameseNorm again at a "
                                             "10-step warmup and two rates), then reversed addition (docs/research.md). "
                                             "Each run is Megatron-LM's training loop: megatron-core >= 0.17.",
                                 formatter_class=flags.HelpFormatter)
    parser.add_argument("--output-dir", default="runs/study", help="results, plots and the per-run directories")
    parser.add_argument("--cache-dir", default=flags.DEFAULTS["cache_dir"], help="tokenized corpus cache")
    # the runs' iterations and warmups by Megatron-LM's names for them (each run is its loop)
    parser.add_argument("--train-iters", type=int, default=None,
                        help="language-modelling iterations per run (default: 200)")
    parser.add_argument("--arithmetic-train-iters", type=int, default=None,
                        help="addition iterations per run (default: 1500; 0: no addition runs)")
    parser.add_argument("--seeds", default="1,2",
                        help="the language-modelling runs' comma-separated seeds (the short-warmup panel runs the first)")
    parser.add_argument("--arithmetic-seeds", default="1,2,3", help="the addition runs' comma-separated seeds")
    parser.add_argument("--schemes", default=None, help=f"comma-separated subset of {','.join(SCHEMES)}")
    parser.add_argument("--learning-rates", default=None,
                        help="comma-separated peak learning rates (default: 1e-3,2e-3,4e-3,1.6e-2,6.4e-2)")
    parser.add_argument("--lr-warmup-iters", type=int, default=None, help="the main panel's warmup (default: 50)")
    parser.add_argument("--short-lr-warmup-iters", type=int, default=None,
                        help="the second panel's warmup (default: 10; 0: no second panel)")
    return parser


def _run_study(options: argparse.Namespace) -> int:
    from megatron_siamese.cli.train import launched
    from megatron_siamese.research.study import StudyPlan, run_study, tables

    if launched():
        raise ConfigError(["study starts its own runs (one rank each, two at a time): run it without a launcher"])
    seeds = _split(options.seeds, int, "--seeds")
    plan = StudyPlan(output_dir=options.output_dir, cache_dir=options.cache_dir, seeds=seeds,
                     short_warmup_seeds=seeds[:1], arithmetic_seeds=_split(options.arithmetic_seeds, int,
                                                                           "--arithmetic-seeds"))
    if options.schemes:
        plan.schemes = _split(options.schemes, str, "--schemes")
        unknown = sorted(set(plan.schemes) - set(SCHEMES))
        if unknown:
            raise ConfigError([f"--schemes: unknown {', '.join(unknown)}; choose from {', '.join(SCHEMES)}"])
    if options.learning_rates:
        plan.learning_rates = _split(options.learning_rates, float, "--learning-rates")
    if options.arithmetic_train_iters is not None:
        if options.arithmetic_train_iters < 0:
            raise ConfigError([f"--arithmetic-train-iters must be at least 0 (got {options.arithmetic_train_iters})"])
        plan.arithmetic_steps = options.arithmetic_train_iters
        if not plan.arithmetic_steps:
            plan.arithmetic_schemes = ()
    if options.lr_warmup_iters is not None:
        plan.warmup_steps = options.lr_warmup_iters
    if options.short_lr_warmup_iters is not None:
        plan.short_warmup_steps = options.short_lr_warmup_iters or None
    if options.train_iters is not None:
        if options.train_iters < 1:
            raise ConfigError([f"--train-iters must be at least 1 (got {options.train_iters})"])
        plan.steps, plan.eval_interval = options.train_iters, min(plan.eval_interval, options.train_iters)
        # a shorter run keeps its warmups inside it
        plan.warmup_steps = min(plan.warmup_steps, options.train_iters - 1)
        if plan.short_warmup_steps is not None:
            plan.short_warmup_steps = min(plan.short_warmup_steps, options.train_iters - 1)
    for flag, warmup in (("--lr-warmup-iters", plan.warmup_steps), ("--short-lr-warmup-iters", plan.short_warmup_steps)):
        if warmup is not None and not 0 <= warmup < plan.steps:
            raise ConfigError([f"{flag} must lie in [0, {plan.steps}) (got {warmup})"])
    print(tables(run_study(plan)))
    return 0


study = SimpleNamespace(add_parser=_study_parser, run=_run_study)


# -- upcycle and analyze: one rank, a checkpoint in, its model ---------------------------

CHECKPOINTS_VALUE = " (default: the checkpoint's)"


def _single_rank_parser(commands, name: str, help: str, description: str, output_required: bool):
    from megatron_siamese.training.checkpoint_settings import model_fields

    output = "--output-dir DIR" if output_required else "[--output-dir DIR]"
    description += ("\n\nThe model's flags (the groups model, mixture of experts, precision and kernels) are for a "
                    "checkpoint that records no settings (an earlier release's); any other's model is what it "
                    "records, which a flag given must agree with.")
    description = "\n\n".join(textwrap.fill(paragraph, 100, break_on_hyphens=False) for paragraph in description.split("\n\n"))
    parser = commands.add_parser(name, help=help, description=description, formatter_class=flags.HelpFormatter,
                                 usage=f"%(prog)s --load CHECKPOINT {output} [options] [the model's flags]")
    parser.add_argument("--load", required=True, metavar="CHECKPOINT",
                        help="the checkpoint to read (a run's directory, its checkpoints directory or one iter_<N> in it, "
                             "Megatron-LM's or ours; any TP/PP layout)")
    parser.add_argument("--output-dir", required=output_required, default=None if output_required else "runs/analysis",
                        help="where to write")
    flags.add_model_flags(parser, schemes=False)  # the scheme is the command's (Pre-Norm in, SiameseNorm out)
    flags.add_data_flags(parser)
    # the model is the checkpoint's: its flags are needed only for a checkpoint that records none
    weights_depend_on = set(model_fields())
    for action in parser._actions:
        if action.dest in weights_depend_on:
            action.default = argparse.SUPPRESS
            if not flags.sets_other_value(action):  # such a switch says what it sets, not a default
                stated = re.sub(r" ?\(default: [^)]*\)|; default: [^)]*", "", action.help or "")
                action.help = stated + CHECKPOINTS_VALUE
    return parser


def _read_checked(path: str, flag: str = ""):
    """The checkpoint at ``path`` (read_checkpoint's), or a ConfigError saying why not, ``flag`` first; a missing
    or broken one said before torch is imported."""
    from megatron_siamese.training import checkpoint_files

    try:
        checkpoint_files.checked(path)
        from megatron_siamese.inference.session import read_checkpoint

        return read_checkpoint(path)
    except checkpoint_files.CheckpointError as error:
        raise ConfigError([f"{flag}{error}"]) from None


def _single_rank_args(options: argparse.Namespace, norm: str, reads: Optional[str] = None, reads_note: str = ""):
    """TrainArgs of the checkpoint's model on one rank (checkpoints reshard on load): the model it records,
    which the model flags given must agree with; for a checkpoint that records none, the flags'. ``reads``:
    the scheme the command takes, said before any rank starts (``reads_note`` after it)."""
    from megatron_siamese.training.args import TrainArgs
    from megatron_siamese.training.checkpoint_settings import model_differences, model_fields

    saved = _read_checked(options.load)
    given = {name: getattr(options, name) for name in model_fields() if hasattr(options, name)}
    model = dict(given, norm=norm)
    if reads and saved.settings is not None and saved.settings.norm != reads:
        raise ConfigError([f"--load {saved.path} holds a {saved.settings.norm} model: {options.command} reads a "
                           f"{reads} one{reads_note}"])
    if saved.settings is not None:
        recorded = {name: value for name, value in dataclasses.asdict(saved.settings).items()
                    if name in {field.name for field in dataclasses.fields(TrainArgs)}}
        differ = model_differences(recorded, TrainArgs(**{**recorded, **given, "tp": 1, "pp": 1, "dp": 1}))
        if differ:
            raise ConfigError([f"--load {saved.path} holds another model than the flags describe ({', '.join(differ)}; "
                               "checkpoint -> flags): leave those flags out (the model is the checkpoint's)"])
        model = dict(recorded, norm=norm)
    return flags.train_args(options, **model, tp=1, pp=1, vpp=None, dp=1, load=None, output_dir=options.output_dir)


def _upcycle_parser(commands, name: str):
    return _single_rank_parser(commands, name, "convert a stock Pre-Norm checkpoint into SiameseNorm",
                               "Write a step-0 SiameseNorm checkpoint computing (up to the norm epsilon) what a "
                               "stock Megatron Pre-Norm checkpoint computes.",
                               output_required=True)


def _run_upcycle(options: argparse.Namespace) -> int:
    args = _single_rank_args(options, norm="siamese")
    existing = os.path.join(args.output_dir, "checkpoints")
    if os.path.isdir(existing) and os.listdir(existing):
        raise ConfigError([f"--output-dir {args.output_dir} already holds checkpoints: choose an empty one"])
    from megatron_siamese.research.upcycle import upcycle
    from megatron_siamese.training import checkpoint_files

    try:
        written = upcycle(args, options.load)
    except checkpoint_files.CheckpointError as error:  # not the Pre-Norm model the flags describe
        raise ConfigError([str(error).strip().splitlines()[0]]) from None
    print(f"SiameseNorm checkpoint (step 0): {written}")
    return 0


def _analyze_parser(commands, name: str):
    parser = _single_rank_parser(commands, name, "stream analysis of a SiameseNorm checkpoint",
                                 "Stream contributions, logit lens per stream, magnitudes by depth and effective "
                                 "depth of a SiameseNorm checkpoint.",
                                 output_required=False)
    parser.add_argument("--compare-load", default=None, metavar="CHECKPOINT",
                        help="a Pre-Norm checkpoint of the same size for the effective-depth probes")
    return parser


def _run_analyze(options: argparse.Namespace) -> int:
    args = _single_rank_args(options, norm="siamese", reads="siamese",
                             reads_note=" (--compare-load takes the stock Pre-Norm one it compares with)")
    if options.compare_load:
        compared = _read_checked(options.compare_load, "--compare-load: ").settings
        if compared is not None and compared.norm != "pre":
            raise ConfigError([f"--compare-load {options.compare_load} holds a {compared.norm} model: it takes the "
                               "stock Pre-Norm checkpoint the effective-depth probes compare with"])
    from megatron_siamese.research.analysis import analyze, format_tables

    results = analyze(dataclasses.replace(args, load=options.load), options.compare_load)
    print(format_tables(results))
    print(f"plots in {args.output_dir}")
    return 0


upcycle = SimpleNamespace(add_parser=_upcycle_parser, run=_run_upcycle)
analyze = SimpleNamespace(add_parser=_analyze_parser, run=_run_analyze)

__all__: List[str] = ["analyze", "study", "upcycle"]

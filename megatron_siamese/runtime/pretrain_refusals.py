"""What ``megatron-siamese train`` refuses before Megatron-LM's ``pretrain()`` starts, one line per problem
naming what to change, said once by rank 0 (exit status 2): Megatron-LM's own flag checks (its asserts
quoted), a model its TransformerConfig refuses, our flags' mismatches, a ``--load`` it would not load
(runtime/pretrain_load.py), flags it needs without a default, and flags ``pretrain_gpt.py`` follows and
we do not yet. Megatron-LM's dump of every argument is printed once they are accepted.
"""

from __future__ import annotations

import os
import sys

from megatron_siamese.runtime import pretrain_load as load
from megatron_siamese.runtime.pretrain_flags import EMBEDDED_JOB, TOKENIZER_FILES, flag_value, refuse

# Megatron-LM flags that change the model or the data in ways this script does not follow yet:
# refused by name rather than run as something else. (flag, argument, its off value)
NOT_FOLLOWED = (("--sft", "sft", False), ("--fim-data", "fim_data", False),
                ("--per-dataset-sequences-path", "per_dataset_sequences_path", None),
                ("--dataloader-inter-document-masking", "dataloader_inter_document_masking", False),
                ("--qk-l2-norm", "qk_l2_norm", False),
                ("--experimental-attention-variant", "experimental_attention_variant", None),
                ("--heterogeneous-layers-config-path", "heterogeneous_layers_config_path", None),
                ("--overlap-moe-expert-parallel-comm", "overlap_moe_expert_parallel_comm", False))

# Megatron-LM's flags its loop needs that have no default: left out, it failed with a TypeError (torch's Adam
# comparing a None learning rate; the evaluation count dividing by a None interval)
NEEDED_WITHOUT_DEFAULT = (("--lr", "lr"), ("--eval-interval", "eval_interval"))
EMBEDDED = {flag[0]: flag[1] for flag in EMBEDDED_JOB if len(flag) == 2}


def accepted_args(extra_args_provider, model_config):
    """Megatron-LM's parsed and validated args (``sys.argv``, with our flags), or a refusal.
    ``model_config(config, args)``: the model provider's config from Megatron-LM's."""
    from megatron.training import arguments

    # a data path without a tokenizer reads NullTokenizer's ids (given, it would be "overridden" with a warning)
    defaults = {} if flag_value(sys.argv, "--tokenizer-type") else {"tokenizer_type": "NullTokenizer"}
    if problem := tokenizer_problem(sys.argv):  # its parser builds the tokenizer
        refuse([problem])
    print_args, dumps = arguments._print_args, []  # Megatron-LM's dump of every argument (830 lines): once accepted
    arguments._print_args = lambda *dump: dumps.append(dump)
    try:
        args = arguments.parse_and_validate_args(extra_args_provider, args_defaults=defaults)
    except AssertionError as failed:  # Megatron-LM checks its flags with asserts, some without a message
        refuse([f"Megatron-LM refuses these flags: {failed_check(failed)}"])
    finally:
        arguments._print_args = print_args
    refuse_what_is_not_followed(args)
    problems = scheme_problems(args)
    problems += [problem] if (problem := load.checkpoint_problem(args)) else []
    problems += [f"{flag}: Megatron-LM's loop needs it and has no default; give it (the embedded job's, which model "
                 f"flags such as --num-layers leave out, is {flag} {EMBEDDED[flag]})"
                 for flag, name in NEEDED_WITHOUT_DEFAULT if getattr(args, name) is None
                 and not (args.skip_train and name == "eval_interval")]  # counts evaluations between iterations
    if problems:
        refuse(problems)
    model_config_problem(args, model_config)
    for dump in dumps:
        print_args(*dump)
    return args


# Megatron-LM's asserts without a message that users meet, said in words
SAID_PLAINLY = {"assert args.save_interval is not None": "--save needs --save-interval N, the iterations between saves"}


def failed_check(error: AssertionError) -> str:
    """An assert's message, or where it has none, the check itself as Megatron-LM wrote it (and in words)."""
    import traceback

    frame = traceback.extract_tb(error.__traceback__)[-1]
    where = f"{os.path.basename(frame.filename)}:{frame.lineno}"
    plainly = f": {SAID_PLAINLY[frame.line]}" if frame.line in SAID_PLAINLY else ""
    return f"{error} ({where})" if str(error) else f"`{frame.line}` ({where}){plainly}"


def tokenizer_problem(argv: list):
    """NullTokenizer (ours by default beside a --data-path) without --vocab-size: a TypeError in Megatron-LM's
    parser, which builds it. Where the command names a tokenizer's files, it meant another --tokenizer-type."""
    if ((flag_value(argv, "--tokenizer-type") or "NullTokenizer") != "NullTokenizer" or flag_value(argv, "--vocab-size")
            or any(flag in argv for flag in ("--use-checkpoint-args", "--yaml-cfg"))):  # they give it otherwise
        return None
    files = [flag for flag in TOKENIZER_FILES if flag_value(argv, flag)]
    if files:
        return (f"{', '.join(files)} name a tokenizer's files, which only the --tokenizer-type that reads them uses "
                "(GPT2BPETokenizer for GPT-2's --vocab-file and --merge-file, HuggingFaceTokenizer or "
                "SentencePieceTokenizer for a --tokenizer-model): give it")
    return ("--tokenizer-type NullTokenizer (the default here: token ids taken as they are) needs "
            "--vocab-size: give the largest token id + 1, or another --tokenizer-type")


def scheme_problems(args) -> list:
    """What of our flags the run cannot honour, one line each (said before any model is built)."""
    from megatron_siamese.inference.saved_args import settings_from_args
    from megatron_siamese.runtime.settings import scheme_setting_problems

    found = scheme_setting_problems(settings_from_args(args))  # the model the flags describe, as a checkpoint's
    if args.spec and args.norm != "siamese":
        found.append(f"--spec {' '.join(args.spec)} names the layer itself: drop --norm {args.norm}")
    if args.hybrid_layer_pattern and args.norm != "siamese":
        found.append(f"--hybrid-layer-pattern builds a HybridModel of SiameseNorm sublayers only: drop --norm {args.norm}")
    if args.norm in ("post", "hybridnorm", "mixln") and args.transformer_impl == "transformer_engine":
        found.append(f"--norm {args.norm} is built of Megatron's local modules: add --transformer-impl local")
    return found


def model_config_problem(args, model_config) -> None:
    """Refuses, in one line said once, a model Megatron's TransformerConfig refuses (heads over TP, say):
    built here as the model provider builds it, that refusal was each rank's traceback."""
    from megatron.training.arguments import core_transformer_config_from_args

    try:
        model_config(core_transformer_config_from_args(args), args)
    except (ValueError, AssertionError) as refused:
        refuse([f"Megatron refuses the model these flags describe: "
                f"{refused if isinstance(refused, ValueError) else failed_check(refused)}"])


def refuse_what_is_not_followed(args) -> None:
    given = [flag for flag, name, off in NOT_FOLLOWED if getattr(args, name, off) != off]
    if given:
        refuse([f"megatron_siamese.runtime.pretrain does not follow {', '.join(given)} yet (Megatron-LM's "
                "pretrain_gpt.py changes its model or data for them); run without, or use Megatron-LM's script with "
                "--spec megatron_siamese.specs siamese_layer_spec (docs/megatron-lm.md)."])

"""``megatron-siamese plan``: what a job costs per GPU, stock Pre-Norm beside SiameseNorm (plan/)."""

from __future__ import annotations

import argparse
import json
import os
from itertools import chain
from typing import List, Tuple

from megatron_siamese.cli import flags
from megatron_siamese.plan.args import MEGATRON_FSDP_STRATEGY, MEGATRON_LM_MODEL, PLAN, PlanArgs
from megatron_siamese.runtime.pretrain_flags import EMBEDDED_JOB, TOKENIZER_FILES, flag_value
from megatron_siamese.runtime.registry import ConfigError, definitions, typos
from megatron_siamese.runtime.settings import MODEL, MOE, PRECISION
from megatron_siamese.training.args import PARALLELISM, TRAINING

DESCRIPTION = """\
What a training job costs per GPU, for stock Pre-Norm and for SiameseNorm side by side: weights,
gradients, optimizer state, the activations kept for backward (SiameseNorm's joined and apart
paths, as --fused-ops / --boundary-ops leave them possible), the pipeline buffers (the packed
[s, b, 2h] streams between stages against stock's [s, b, h], over the microbatches 1F1B or the
interleaved schedule keeps in flight), the bytes each GPU sends per step over TP, SP, PP, DP and
EP, the difference, whether the most loaded pipeline stage fits --gpu-memory, and the largest
micro-batch that does. Arithmetic only: no rank starts, nothing is imported from torch.

Every flag of `megatron-siamese train` means the same here (with megatron-core >= 0.17, those
that do not change the cost, such as the learning rate, are read by Megatron-LM's parser and
ignored), so a training command becomes its plan by changing its first word and saying
--data-parallel-size, which train takes from its ranks (over TP x PP x CP). What it leaves out is
what train builds on a GPU: without --num-layers the embedded default job's model and batch, the
rest Megatron-LM's defaults (TP 1, Transformer Engine, dropout 0.1, the fused kernels); with
--num-layers Megatron-LM's defaults for all of it (LayerNorm, GELU, biases, learned positions),
and --hidden-size, --num-attention-heads, --seq-length, --max-position-embeddings and
--micro-batch-size are needed, as Megatron-LM needs them. The short names (--tp, --pp, --sp,
--dp, ...), --dtype and --recompute are the plan's alone (train takes Megatron-LM's: --bf16,
--fp16, --recompute-granularity ...), as are --gpu-memory, --json and the fusion switches'
positive forms. Megatron-LM flags that change the model and are not modeled are refused by name.
Measured against the CPU ranks within 5% per term (tests/test_plan_measured.py; docs/scale.md):

  megatron-siamese plan --num-layers 80 --hidden-size 8192 --num-attention-heads 64 \\
      --group-query-attention --num-query-groups 8 --ffn-hidden-size 28672 --swiglu \\
      --normalization RMSNorm --disable-bias-linear --position-embedding-type rope --hidden-dropout 0 \\
      --attention-dropout 0 --seq-length 4096 --max-position-embeddings 4096 --vocab-size 128256 \\
      --bf16 --tensor-model-parallel-size 8 --sequence-parallel \\
      --pipeline-model-parallel-size 8 --data-parallel-size 16 --use-distributed-optimizer \\
      --micro-batch-size 1 --global-batch-size 1024 --gpu-memory h100-80gb
"""

SETTINGS = definitions(PlanArgs)
POSITIONS = {"learned_absolute": "learned", "rope": "rotary"}
EMBEDDED_POSITIONS = int(flag_value(list(chain(*EMBEDDED_JOB)), "--max-position-embeddings"))
GROUPS = (MODEL, MOE, PRECISION, PARALLELISM, TRAINING, PLAN)


def add_parser(commands, name: str) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help="what a job costs per GPU: stock Pre-Norm beside SiameseNorm",
                                 description=DESCRIPTION, formatter_class=flags.HelpFormatter)
    for title in GROUPS:
        flags.add_group(parser, title, settings=SETTINGS)
    for action in parser._actions:  # the embedded job's settings: their defaults hold without --num-layers only
        if action.dest in MEGATRON_LM_MODEL and action.dest != "num_layers" and not flags.sets_other_value(action):
            default = EMBEDDED_POSITIONS if action.dest == "max_position_embeddings" else action.default
            action.help += f" (default: {_said(default)} without --num-layers; with it: " \
                           f"{_said(MEGATRON_LM_MODEL[action.dest], action.dest)})"
        if action.dest == "data_parallel_sharding_strategy":
            action.help += f" (default: {MEGATRON_FSDP_STRATEGY}, Megatron-LM's)"
    parser.add_argument("--json", metavar="PATH", help="also write every pipeline stage's costs as JSON")
    parser.set_defaults(megatron_flags=[])  # the rest of a train command line (cli.main): checked, then ignored
    return parser


def _said(value, name: str = "") -> str:
    """A default as the help says it: on / off, "required" where Megatron-LM has none."""
    if name == "global_batch_size":
        return "micro-batch x DP"
    if value is None:
        return "required"
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


_UNEVEN = "pipeline stages of other sizes than --num-layers over the stages are not modeled: leave it out"
_OPTIMIZER_DTYPES = "optimizer state and main copies in other dtypes than fp32 are not modeled: leave it out"
# Megatron-LM's flags that change what a GPU holds and the plan does not model (or knows by another name):
# refused, each saying what to give instead, rather than planned as another model than train builds
UNMODELED_FLAGS = {
    "--use-checkpoint-args": "plan reads no checkpoint: give the model's flags",
    "--use-rotary-position-embeddings": "give --position-embedding-type rope, which Megatron-LM makes of it",
    "--num-layers-per-virtual-pipeline-stage": "give --num-virtual-stages-per-pipeline-rank (layers per pipeline "
                                               "rank over it)",
    "--decoder-first-pipeline-num-layers": _UNEVEN, "--decoder-last-pipeline-num-layers": _UNEVEN,
    "--pipeline-model-parallel-layout": _UNEVEN, "--account-for-embedding-in-pipeline-split": _UNEVEN,
    "--account-for-loss-in-pipeline-split": _UNEVEN,
    "--kv-channels": "heads of another width than --hidden-size over --num-attention-heads are not modeled: leave "
                     "it out",
    "--use-precision-aware-optimizer": _OPTIMIZER_DTYPES, "--main-grads-dtype": _OPTIMIZER_DTYPES,
    "--main-params-dtype": _OPTIMIZER_DTYPES, "--exp-avg-dtype": _OPTIMIZER_DTYPES,
    "--exp-avg-sq-dtype": _OPTIMIZER_DTYPES,
    "--distribute-saved-activations": "recomputed activations spread over TP are not modeled: leave it out",
}


def check_the_rest_of_a_train_command(rest: list, given: set) -> None:
    """A train command line pasted whole: Megatron-LM's flags plan lacks (checkpoints, logging, data) cost
    nothing and are ignored; those that change the model and are not modeled, or that plan cannot read (a
    tokenizer's vocabulary), are refused by name, and unknown ones (all of them on megatron-core 0.16.1:
    no Megatron-LM parser)."""
    if not rest:
        return
    spelled = [word.split("=", 1)[0] for word in rest]
    found = [f"{flag}: {UNMODELED_FLAGS[flag]}" for flag in dict.fromkeys(spelled) if flag in UNMODELED_FLAGS]
    tokenizer = flag_value(rest, "--tokenizer-type")
    read = ([f"--tokenizer-type {tokenizer}"] if tokenizer not in (None, "NullTokenizer") else []) + [
        flag for flag in TOKENIZER_FILES if flag_value(rest, flag)]
    if read and "vocab_size" not in given:
        found.append(f"{', '.join(read)}: plan reads no tokenizer, so give its vocabulary's size as --vocab-size "
                     "(Megatron-LM pads it)")
    if found:
        raise ConfigError(found)
    from megatron_siamese.versions import ships_megatron_training

    unknown, known = rest, {flag for definition in SETTINGS.values() for flag in definition.all_flags}
    if ships_megatron_training():
        from megatron_siamese.runtime.pretrain import megatron_parser

        usage = "megatron-siamese plan [plan's flags] [the rest of a train command: Megatron-LM's flags]"
        parser = megatron_parser(usage)
        unknown, known = parser.parse_known_args(rest)[1], known | set(parser._option_string_actions)
    if unknown:
        why = "" if ships_megatron_training() else (": megatron-core < 0.17 has no Megatron-LM parser to tell its "
                                                    "other flags from typos, so plan takes only its own")
        raise ConfigError([f"unrecognized arguments: {' '.join(unknown)}{typos(unknown, known)} (see "
                           f"megatron-siamese plan --help){why}"])


def describe(args: PlanArgs) -> str:
    """The model, the layout and the batch, in a few lines."""
    layout = args.layout
    experts = (f", {args.num_moe_experts} experts (top {args.moe_router_topk}, width {args.expert_width})"
               if args.num_moe_experts else "")
    groups = f" / {args.num_query_groups} query groups" if args.num_query_groups else ""
    mlp = "SwiGLU" if args.gated_linear_unit else "GELU"
    from megatron_siamese.plan.states import layout_sharding

    return "\n".join([
        f"GPT: {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads{groups}, "
        f"MLP {args.mlp_width} ({mlp}){experts}, {args.normalization}, {'' if args.add_bias_linear else 'no '}biases, "
        f"{POSITIONS.get(args.position_embedding_type, args.position_embedding_type)} positions, vocabulary "
        f"{args.padded_vocab}, sequence {args.seq_length}; "
        f"{args.dtype}, {args.transformer_impl} modules, {args.attention} attention",
        f"layout {layout.name}: {layout.world_size} GPU{'' if layout.world_size == 1 else 's'}; micro-batch {args.micro_batch_size}, "
        f"{args.num_microbatches} microbatch{'' if args.num_microbatches == 1 else 'es'} a step on each data-parallel rank; recompute {layout.recompute}; "
        f"data parallelism: {layout_sharding(layout).name}",
    ])


def left_to_megatron_lm(options: argparse.Namespace, given: set) -> Tuple[dict, List[str], str]:
    """Train's rule for a command line that names a model (--num-layers; runtime/pretrain_flags.add_defaults):
    Megatron-LM's default for each setting of the embedded job it leaves out, a problem where Megatron-LM
    has none, and the line that says which rule it took."""
    if "num_layers" not in given:
        changes, problems = {}, []
        if "max_position_embeddings" not in given:  # the embedded job's, unless that refuses the sequence given
            changes["max_position_embeddings"] = EMBEDDED_POSITIONS
            if options.seq_length > EMBEDDED_POSITIONS:
                changes["max_position_embeddings"] = None
                problems.append(f"--seq-length {options.seq_length} is past the embedded default job's "
                                f"--max-position-embeddings {EMBEDDED_POSITIONS}, which Megatron-LM refuses: give "
                                f"--max-position-embeddings {options.seq_length} too")
        return changes, problems, ("megatron-siamese plan: no model given (--num-layers), so the embedded default "
                                   "job's, as train builds it on a GPU")
    required = [SETTINGS[name].flags[0] for name, default in MEGATRON_LM_MODEL.items()
                if default is None and name not in given | {"global_batch_size"}]
    problems = [f"--num-layers given, so the model is the command line's and Megatron-LM needs {', '.join(required)} "
                "with it (or leave --num-layers out: the embedded default job)"] if required else []
    changes = {name: default for name, default in MEGATRON_LM_MODEL.items() if name not in given and default is not None}
    if "global_batch_size" not in given:
        changes["global_batch_size"] = options.micro_batch_size * options.dp
    return changes, problems, ("megatron-siamese plan: --num-layers given, so nothing of the embedded default job: "
                               "what the command line leaves out is Megatron-LM's default, as train builds it on a GPU")


def planned_args(options: argparse.Namespace) -> Tuple[PlanArgs, str]:
    """The settings the command line plans, and the line saying which of train's defaults they take."""
    given = flags.given_settings(options.argv, SETTINGS)
    check_the_rest_of_a_train_command(options.megatron_flags, given)
    changes, missing, rule = left_to_megatron_lm(options, given)
    if options.use_megatron_fsdp and "data_parallel_sharding_strategy" not in given:  # TrainArgs' is no FSDP's
        changes["data_parallel_sharding_strategy"] = MEGATRON_FSDP_STRATEGY
    if {"--fp16", "--bf16"} <= {word.split("=", 1)[0] for word in options.argv}:
        missing.append("--fp16 and --bf16: Megatron-LM takes one of them")
    if options.sp and options.tp == 1:  # Megatron-LM warns and trains without it
        changes["sp"] = False
        rule += "\nmegatron-siamese plan: --sequence-parallel at TP 1 is off, as Megatron-LM turns it off"
    if options.json and not os.path.isdir(os.path.dirname(os.path.abspath(options.json))):
        missing.append(f"--json {options.json}: no directory {os.path.dirname(os.path.abspath(options.json))} to "
                       "write it in")
    try:
        args = flags.train_args(options, cls=PlanArgs, **changes)
    except ConfigError as error:  # every problem, one line each
        raise ConfigError(missing + error.problems) from None
    if missing:
        raise ConfigError(missing)
    return args, rule


def run(options: argparse.Namespace) -> int:
    args, rule = planned_args(options)
    print(rule)
    from megatron_siamese.plan.args import plan_inputs
    from megatron_siamese.plan.gpus import gpu_memory
    from megatron_siamese.plan.report import format_plan, make_plan, plan_json

    plan = make_plan(plan_inputs(args), args.siamese_paths, gpu_memory(args.gpu_memory))
    print(describe(args))
    print(format_plan(plan, args.gpu_memory))
    print("not counted: the CUDA context, NCCL's buffers, the allocator's fragmentation and the step's "
          "temporaries (leave a few GiB)")
    if args.layout.cp > 1 and args.attention == "flash":  # TE's ring of K/V chunks, its own exchange; stock's for both
        print(f"not counted in bytes sent: context parallelism's K/V exchange inside attention (--cp {args.layout.cp}), "
              "the same for stock and SiameseNorm (the attention is stock's)")
    if options.json:
        with open(options.json, "w") as out:
            json.dump(plan_json(plan, args.gpu_memory), out, indent=2)
    return 0

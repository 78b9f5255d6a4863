"""A training run's settings, and every problem with them found before any rank starts.

Plain data and arithmetic, no torch or Megatron import: the command line builds ``TrainArgs``
in the launching process and a bad value is refused in a fraction of a second, each problem
on one line saying what to change (``ConfigError``). Library users get the same list when
they construct ``TrainArgs``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

from megatron_siamese.hybrid_pattern import hybrid_pattern
from megatron_siamese.runtime.layout import RECOMPUTE, Layout
from megatron_siamese.runtime.settings import DTYPE_NAMES, MODEL_CLASSES, SCHEME_NAMES, ModelSettings

TASKS = ("lm", "addition", "addition-reversed")
FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
WARMUP_FRACTION = 0.1  # of the run, when no warm-up is given (Megatron-LM's --lr-warmup-fraction)
BYTE_VOCAB = 258  # ByteTokenizer: 256 bytes, end of document, padding
VOCAB_MULTIPLE = 64


class ConfigError(ValueError):
    """Settings a run cannot honour; ``problems`` holds one line per problem."""

    def __init__(self, problems: List[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def padded_vocab_size(vocab_size: int = BYTE_VOCAB, multiple: int = VOCAB_MULTIPLE) -> int:
    """The vocabulary padded to a multiple of 64, whatever the TP size.

    The padded rows are real logits in the softmax, so their number must not change with the
    layout: a checkpoint then loads at any TP size dividing it and computes the same losses
    (Megatron-LM pads to a multiple of 128 * TP, which ties checkpoints to TP).
    """
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass(frozen=True)
class TrainArgs(ModelSettings):
    """Everything a run needs (the model: ModelSettings); the CLI maps its flags onto these fields."""

    tp: int = 2
    pp: int = 1
    vpp: Optional[int] = None
    dp: int = 1
    sp: bool = False
    distributed_optimizer: bool = False
    micro_batch_size: int = 8
    global_batch_size: int = 16
    steps: int = 300
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: Optional[int] = None  # None: WARMUP_FRACTION of the run
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    seed: int = 1234
    eval_interval: int = 100
    eval_iters: int = 8
    save_interval: Optional[int] = None  # save a checkpoint every N steps (and at the end)
    load: Optional[str] = None  # a checkpoint directory, or a directory with a `latest` file
    stop_step: Optional[int] = None  # stop (saving a checkpoint) after this step, e.g. preemption
    output_dir: str = "runs/default"
    overwrite: bool = False  # allow an output directory that holds another run's checkpoints
    # on resume, a schedule (lr, min lr, warm-up, steps) unlike the checkpoint's is refused unless:
    override_opt_param_scheduler: bool = False  # ... these settings win
    use_checkpoint_opt_param_scheduler: bool = False  # ... the checkpoint's win
    cache_dir: str = ".cache/megatron_siamese"
    data_prefix: Optional[str] = None  # an indexed dataset of byte tokens; default: embedded KJV
    recompute: str = "none"  # none | full | selective
    task: str = "lm"  # lm: the corpus; addition(-reversed): synthetic addition (research/arithmetic.py)
    addition_digits: int = 3  # operands of up to this many digits (task=addition*)
    progress: bool = True

    def __post_init__(self):
        found = problems(self)
        if found:
            raise ConfigError(found)

    @property
    def warmup(self) -> int:
        """Warm-up steps: as given, else WARMUP_FRACTION of the run (below its length)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return min(round(WARMUP_FRACTION * self.steps), max(self.steps - 1, 0))

    @property
    def layout(self) -> Layout:
        return Layout(tp=self.tp, pp=self.pp, vpp=self.vpp, dp=self.dp, sp=self.sp,
                      distributed_optimizer=self.distributed_optimizer, recompute=self.recompute)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)


def _choice(name: str, value, choices, flag: str) -> List[str]:
    if value in choices:
        return []
    return [f"{flag} must be one of {', '.join(map(str, choices))} (got {value!r})"]


def problems(args: TrainArgs) -> List[str]:
    """Every problem with ``args``, one line each, saying what to change (empty: none)."""
    found: List[str] = []
    found += _choice("norm", args.norm, SCHEME_NAMES, "--norm")
    found += _choice("model", args.model, MODEL_CLASSES, "--model")
    if args.dtype == "fp16":
        found.append("--dtype fp16 is not supported (Megatron's fp16 needs loss scaling this trainer does not do): "
                     "use --bf16 or --dtype fp32")
    else:
        found += _choice("dtype", args.dtype, DTYPE_NAMES, "--dtype")
    found += _choice("normalization", args.normalization, ("LayerNorm", "RMSNorm"), "--normalization")
    found += _choice("position", args.position_embedding_type, ("rope", "learned_absolute"), "--position-embedding-type")
    found += _choice("recompute", args.recompute, RECOMPUTE, "--recompute")
    found += _choice("task", args.task, TASKS, "--task")
    found += _choice("impl", args.transformer_impl, ("local", "transformer_engine"), "--transformer-impl")
    found += _choice("recipe", args.fp8_recipe, FP8_RECIPES, "--fp8-recipe")
    if args.fp8 is not None:
        found += _choice("fp8", args.fp8, FP8_FORMATS, "--fp8-format")
        if args.transformer_impl != "transformer_engine":
            found.append("--fp8-format needs Transformer Engine's GEMMs: add --transformer-impl transformer_engine")

    sizes = dict(tp=("--tensor-model-parallel-size/--tp", args.tp), pp=("--pipeline-model-parallel-size/--pp", args.pp),
                 dp=("--dp", args.dp), layers=("--num-layers", args.num_layers), hidden=("--hidden-size", args.hidden_size),
                 heads=("--num-attention-heads", args.num_attention_heads), seq=("--seq-length", args.seq_length),
                 mbs=("--micro-batch-size", args.micro_batch_size), gbs=("--global-batch-size", args.global_batch_size),
                 steps=("--train-iters/--steps", args.steps), eval_interval=("--eval-interval", args.eval_interval),
                 eval_iters=("--eval-iters", args.eval_iters))
    bad_sizes = {key for key, (flag, value) in sizes.items() if value < 1}
    found += [f"{sizes[key][0]} must be at least 1 (got {sizes[key][1]})" for key in sorted(bad_sizes, key=list(sizes).index)]
    for flag, value in (("--num-virtual-stages-per-pipeline-rank/--vpp", args.vpp), ("--save-interval", args.save_interval),
                        ("--num-query-groups", args.num_query_groups), ("--ffn-hidden-size", args.ffn_hidden_size)):
        if value is not None and value < 1:
            found.append(f"{flag} must be at least 1 (got {value})")
    if args.lr < 0 or args.min_lr < 0 or args.min_lr > args.lr:
        found.append(f"learning rates must satisfy 0 <= --min-lr <= --lr (got --lr {args.lr:g}, --min-lr {args.min_lr:g})")

    if "steps" not in bad_sizes:
        if args.warmup_steps is not None and not 0 <= args.warmup_steps < args.steps:
            found.append(f"--lr-warmup-iters/--warmup-steps must lie in [0, --train-iters) (got {args.warmup_steps} "
                         f"for {args.steps} steps): lower it, or leave it out for {WARMUP_FRACTION:.0%} of the run")
        if args.stop_step is not None and not 0 < args.stop_step <= args.steps:
            found.append(f"--stop-step must lie in [1, --train-iters={args.steps}] (got {args.stop_step})")

    if not bad_sizes & {"tp", "hidden", "heads"}:
        if args.hidden_size % args.num_attention_heads:
            found.append(f"--hidden-size {args.hidden_size} is not a multiple of --num-attention-heads "
                         f"{args.num_attention_heads}: change one of them")
        if args.num_attention_heads % args.tp:
            found.append(f"--num-attention-heads {args.num_attention_heads} does not split over --tp {args.tp}: use a "
                         "tensor-parallel size that divides the head count")
        groups = args.num_query_groups
        if groups is not None and groups >= 1 and (args.num_attention_heads % groups or groups % args.tp):
            found.append(f"--num-query-groups {groups} must divide --num-attention-heads {args.num_attention_heads} "
                         f"and be a multiple of --tp {args.tp}")
        ffn = args.ffn_hidden_size or 4 * args.hidden_size
        if ffn >= 1 and ffn % args.tp:
            found.append(f"the MLP width {ffn} (--ffn-hidden-size) does not split over --tp {args.tp}")
        if padded_vocab_size() % args.tp:
            found.append(f"the padded byte vocabulary ({padded_vocab_size()}) does not split over --tp {args.tp}: "
                         "use 1, 2, 4, 5, 8, ...")
    if args.sp and args.tp == 1:
        found.append("--sequence-parallel/--sp needs --tp > 1")
    if args.vpp is not None and args.pp == 1:
        found.append("--num-virtual-stages-per-pipeline-rank/--vpp needs --pp > 1")
    if args.distributed_optimizer and args.dp == 1:
        found.append("--use-distributed-optimizer shards optimizer state over data-parallel ranks: it needs --dp > 1")
    if not bad_sizes & {"pp", "layers"} and (args.vpp is None or args.vpp >= 1):
        stages = args.pp * (args.vpp or 1)
        if args.model == "hybrid":
            pattern = hybrid_pattern(args)
            layers = len(pattern.layers)
            if not pattern.has_boundaries and layers % stages:
                found.append(f"the hybrid pattern's {layers} layers do not split into {stages} pipeline stages: change "
                             "--pp/--vpp, or write the stage boundaries into --hybrid-layer-pattern with '|'")
        elif args.num_layers % stages:
            found.append(f"--num-layers {args.num_layers} does not split over {stages} pipeline stages (--pp "
                         f"{args.pp}{f' x --vpp {args.vpp}' if args.vpp else ''}): use sizes whose product divides it")
    if not bad_sizes & {"mbs", "gbs", "dp"} and args.global_batch_size % (args.micro_batch_size * args.dp):
        found.append(f"--global-batch-size {args.global_batch_size} must be a multiple of --micro-batch-size x --dp = "
                     f"{args.micro_batch_size * args.dp}")
    if args.task != "lm" and (args.tp, args.pp) != (1, 1):
        found.append("the addition tasks' greedy evaluation runs on one rank: use --tp 1 --pp 1")
    if args.model == "hybrid":
        if args.norm != "siamese":
            found.append(f"--model hybrid builds SiameseNorm layers only: use --norm siamese (got --norm {args.norm})")
        from megatron_siamese.versions import installed_megatron_core, release

        if release(installed_megatron_core()) < (0, 19, 0):
            found.append(f"--model hybrid needs megatron-core >= 0.19 (installed: {installed_megatron_core()}); "
                         "use --model gpt here")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        found.append("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict each other: "
                     "pass one")
    return found

"""A model on its ranks: the model (``ModelSettings``), its layout and batch, in ``train``'s flags,
and every problem with them found before any rank starts.

What ``plan`` costs and ``upcycle``, ``analyze``, ``export`` and ``import-hf`` build a model from; the
schedule, optimizer and data are Megatron-LM's. Plain data, no torch or Megatron import, so a bad value
is refused in the launching process, each problem one line (``ConfigError``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

from megatron_siamese.runtime.divisibility import shape_problems, split_problems
from megatron_siamese.runtime.layout import (
    DEFAULT_RECOMPUTE_MODULES,
    RECOMPUTE,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    RECOMPUTE_MODULES,
    RECOMPUTE_PRESETS,
    SHARDING_STRATEGIES,
    TRAIN_FLAGS,
    Layout,
    Recompute,
    fsdp_refusals,
)
from megatron_siamese.runtime.registry import ConfigError, Switch, definitions, field_problems, setting  # noqa: F401
from megatron_siamese.runtime.settings import ModelSettings, model_class_problems, scheme_setting_problems
from megatron_siamese.training import recompute_flags

BYTE_VOCAB = 258  # ByteTokenizer: 256 bytes, end of document, padding
VOCAB_MULTIPLE = 64


def padded_vocab_size(vocab_size: int = BYTE_VOCAB, multiple: int = VOCAB_MULTIPLE) -> int:
    """The vocabulary padded to a multiple of 64, whatever the TP size: the padded rows are real logits,
    so a checkpoint loads at any TP dividing it (Megatron-LM's 128 * TP ties checkpoints to TP)."""
    return int(math.ceil(vocab_size / multiple) * multiple)


PARALLELISM, TRAINING, CHECKPOINTS, DATA = "parallelism", "training", "checkpoints", "data"  # argparse groups


@dataclass(frozen=True)
class TrainArgs(ModelSettings):
    """Everything a run needs (the model: ModelSettings). Each field is its setting's one
    definition (runtime/registry.py); the CLI's flags are built from them."""

    # the layout: each of these sets the Layout field it names
    tp: int = setting(2, group=PARALLELISM, flag=("--tensor-model-parallel-size", "--tp"), minimum=1, layout="tp",
                      help="tensor-parallel size")
    pp: int = setting(1, group=PARALLELISM, flag=("--pipeline-model-parallel-size", "--pp"), minimum=1, layout="pp",
                      help="pipeline-parallel size")
    vpp: Optional[int] = setting(None, group=PARALLELISM, flag=("--num-virtual-stages-per-pipeline-rank", "--vpp"),
                                 minimum=1, layout="vpp",
                                 help="virtual pipeline stages per pipeline rank (interleaved 1F1B)")
    cp: int = setting(1, group=PARALLELISM, flag=("--context-parallel-size", "--cp"), minimum=1, layout="cp",
                      help="context-parallel size: each sequence split over this many ranks (2 x cp chunks, two per "
                           "rank; the local attention all-gathers keys and values, Transformer Engine's runs its ring)")
    dp: int = setting(1, group=PARALLELISM, flag=("--data-parallel-size", "--dp"), minimum=1, layout="dp",
                      help="data-parallel size (train takes it from its ranks: --nproc-per-node or torchrun's, "
                           "over TP x PP x CP)")
    ep: int = setting(1, group=PARALLELISM, flag=("--expert-model-parallel-size", "--ep"), minimum=1, layout="ep",
                      help="expert-parallel size: MoE layers' experts split over this many of a pipeline stage's "
                           "tp x cp x dp ranks (adds no ranks: --ep x --etp must divide --tp x --cp x --dp)")
    etp: Optional[int] = setting(None, group=PARALLELISM, flag=("--expert-tensor-parallel-size", "--etp"), minimum=1,
                                 layout="etp", help="tensor-parallel size of the experts (unset: --tp)")
    sp: bool = setting(False, group=PARALLELISM, flag=("--sequence-parallel", "--sp"), action="store_true",
                       layout="sp", help="sequence parallelism (needs TP > 1)")
    distributed_optimizer: bool = setting(False, group=PARALLELISM,
                                          flag=("--use-distributed-optimizer", "--distributed-optimizer"),
                                          action="store_true", layout="distributed_optimizer",
                                          help="shard optimizer state over data-parallel ranks")
    recompute: str = setting("none", group=PARALLELISM, flag="--recompute", choices=RECOMPUTE,
                             help="activation recompute preset: full (each layer, Megatron-LM's --recompute-granularity "
                                  "full --recompute-method uniform --recompute-num-layers 1) or selective (the norms and "
                                  "the MLP: --recompute-granularity selective --recompute-modules layernorm mlp)")
    recompute_granularity: Optional[str] = setting(
        None, group=PARALLELISM, flag="--recompute-granularity", choices=RECOMPUTE_GRANULARITIES,
        help="Megatron-LM's: full (whole layers, as --recompute-method says) or selective (--recompute-modules "
             "inside each layer); not with --recompute",
        switches=(Switch(("--recompute-activations",), "Megatron-LM's: same as --recompute-granularity selective",
                         action="store_const", const="selective"),))
    recompute_method: Optional[str] = setting(
        None, group=PARALLELISM, flag="--recompute-method", choices=RECOMPUTE_METHODS,
        help="Megatron-LM's, with --recompute-granularity full: uniform (each model chunk's layers in groups of "
             "--recompute-num-layers, each recomputed from its input) or block (the first --recompute-num-layers "
             "layers of each chunk recomputed, the rest not)")
    recompute_num_layers: Optional[int] = setting(None, group=PARALLELISM, flag="--recompute-num-layers", minimum=1,
                                                  help="Megatron-LM's: the layers of --recompute-method")
    recompute_modules: Optional[Tuple[str, ...]] = setting(
        None, group=PARALLELISM, flag="--recompute-modules", nargs="*", metavar="MODULE",
        help="Megatron-LM's, with --recompute-granularity selective: what each layer recomputes, of "
             f"{', '.join(RECOMPUTE_MODULES)} as the installed megatron-core offers them (unset: Megatron's core_attn)")
    # fully sharded data parallelism (runtime/data_parallel.py): these two set Layout.fsdp (TrainArgs.layout)
    use_torch_fsdp2: bool = setting(False, group=PARALLELISM, flag="--use-torch-fsdp2", action="store_true",
                                    help="fully sharded data parallelism with torch FSDP2 (Megatron's "
                                         "TorchFullyShardedDataParallel): parameters, gradients and optimizer state "
                                         "sharded over the --dp ranks (not with --pp, --ep or "
                                         "--use-distributed-optimizer)")
    use_megatron_fsdp: bool = setting(False, group=PARALLELISM, flag="--use-megatron-fsdp", action="store_true",
                                      help="fully sharded data parallelism with Megatron-FSDP, sharding what "
                                           "--data-parallel-sharding-strategy says over the --dp ranks, with "
                                           "Megatron's distributed optimizer (not with --pp; needs einops)")
    data_parallel_sharding_strategy: str = setting(
        "no_shard", group=PARALLELISM, flag="--data-parallel-sharding-strategy", choices=SHARDING_STRATEGIES,
        layout="fsdp_sharding",
        help="what Megatron-FSDP shards: no_shard (nothing), optim (optimizer state), "
             "optim_grads (and gradients), optim_grads_params (and parameters: full sharding); megatron-core "
             "0.16.1 trains only the last two")

    micro_batch_size: int = setting(8, group=TRAINING, flag="--micro-batch-size", minimum=1,
                                    help="sequences per microbatch")
    global_batch_size: int = setting(16, group=TRAINING, flag="--global-batch-size", minimum=1,
                                     help="sequences per optimizer step (a multiple of micro batch size x DP)")
    seed: int = setting(1234, group=TRAINING, flag="--seed", help="random seed (weights and data order)")
    distributed_timeout_minutes: float = setting(
        60.0, group=TRAINING, flag="--distributed-timeout-minutes", minimum=0.01,
        help="how long a rank waits for the others (to join, in a collective, for a checkpoint) before the job "
             "fails, naming the collective and any rank that never came (Megatron-LM's flag)")

    # where a command writes, and the checkpoint it reads (the commands' own flags: upcycle, analyze, export)
    output_dir: str = setting("runs/default", group=CHECKPOINTS, flag="--output-dir",
                              help="where the command writes (a checkpoint's in OUTPUT_DIR/checkpoints)")
    load: Optional[str] = setting(None, group=CHECKPOINTS, flag="--load", metavar="DIR",
                                  help="a run's directory (its checkpoints), a checkpoints directory (its "
                                       "latest_checkpointed_iteration.txt) or one iter_<N> in it, at any TP/PP layout")
    cache_dir: str = setting(".cache/megatron_siamese", group=DATA, flag="--cache-dir",
                             help="where the tokenized corpus and dataset indices are cached")

    def __post_init__(self):
        if self.recompute_modules is not None:  # a list from Python callers: the field's tuple
            object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))
        found = problems(self)
        if found:
            raise ConfigError(found)

    @property
    def recomputation(self) -> Recompute:
        """The activation recompute the --recompute preset or Megatron-LM's flags ask for."""
        if self.recompute_granularity is None:
            return RECOMPUTE_PRESETS[self.recompute]
        modules = self.recompute_modules
        if self.recompute_granularity == "selective" and modules is None:
            modules = DEFAULT_RECOMPUTE_MODULES
        return Recompute(self.recompute_granularity, self.recompute_method, self.recompute_num_layers, modules or ())

    @property
    def fsdp(self) -> str:
        """Layout.fsdp: which fully sharded data parallelism the two Megatron-LM flags ask for."""
        return "torch" if self.use_torch_fsdp2 else "megatron" if self.use_megatron_fsdp else "none"

    @property
    def layout(self) -> Layout:
        """The Layout the settings that name one of its fields fill (the others keep Layout's defaults)."""
        fields = {d.layout: getattr(self, name) for name, d in definitions(type(self)).items() if d.layout}
        return Layout(**fields, fsdp=self.fsdp, recompute=self.recomputation)

    @property
    def padded_vocab(self) -> int:
        """The vocabulary the model is built with: the byte tokenizer's, padded (``padded_vocab_size``)."""
        return padded_vocab_size()

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)


def problems(args: TrainArgs) -> List[str]:
    """Every problem with ``args``, one line each, saying what to change (empty: none)."""
    invalid = field_problems(args, type(args))  # each value against its own definition
    found = list(invalid.values())
    if args.fp8 is not None and args.transformer_impl != "transformer_engine":
        found.append("--fp8-format needs Transformer Engine's GEMMs: add --transformer-impl transformer_engine")

    if args.sp and args.tp == 1:
        found.append("--sequence-parallel/--sp needs --tp > 1")
    if args.vpp is not None and args.pp == 1:
        found.append("--num-virtual-stages-per-pipeline-rank/--vpp needs --pp > 1")
    if args.distributed_optimizer and args.dp == 1:
        found.append("--use-distributed-optimizer shards optimizer state over data-parallel ranks: it needs --dp > 1 "
                     "(plan: --data-parallel-size, the ranks over TP x PP x CP that train has)")
    found += _expert_layout_problems(args)
    found += _fsdp_problems(args)
    found += recompute_flags.problems(args)
    found += shape_problems(args)
    found += split_problems(args, _layout_to_split(args), vocab_size=args.padded_vocab,
                            micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size)

    if args.model == "hybrid":
        if args.norm != "siamese":
            found.append(f"--model hybrid builds SiameseNorm layers only: use --norm siamese (got --norm {args.norm})")
    found += model_class_problems(args)
    found += scheme_setting_problems(args)
    return found


def _expert_layout_problems(args: TrainArgs) -> List[str]:
    """Expert parallelism regroups each pipeline stage's tp x cp x dp ranks (Layout): --ep x --etp must divide them."""
    if any(not isinstance(value, int) or value < 1 for value in (args.tp, args.cp, args.dp, args.ep, args.etp or args.tp)):
        return []  # refused by the settings' own checks
    experts, dense = args.ep * (args.etp or args.tp), args.tp * args.cp
    if (dense * args.dp) % experts == 0:
        return []
    multiple = experts // math.gcd(dense, experts)
    dp = next(dp for dp in range(args.dp, args.dp + multiple + 1) if dp % multiple == 0)
    cp = f" x --cp {args.cp}" if args.cp > 1 else ""
    return [f"--expert-model-parallel-size/--ep {args.ep} x --expert-tensor-parallel-size/--etp {args.etp or args.tp} "
            f"= {experts} must divide --tp {args.tp}{cp} x --dp {args.dp} = {dense * args.dp} (expert parallelism "
            f"adds no ranks: it regroups those of a pipeline stage): use --dp {dp}"
            + ("" if multiple == dp else f" (a multiple of {multiple})")]


def _fsdp_problems(args: TrainArgs) -> List[str]:
    """Layout's rules for fully sharded data parallelism, in the flags' words."""
    if args.use_torch_fsdp2 and args.use_megatron_fsdp:
        return ["--use-torch-fsdp2 and --use-megatron-fsdp are two implementations of one thing: pass one"]
    found = []
    if args.data_parallel_sharding_strategy != "no_shard" and not args.use_megatron_fsdp:
        found.append(f"--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy} is Megatron-FSDP's: "
                     "add --use-megatron-fsdp")
    if args.fsdp == "none":
        return found
    return found + fsdp_refusals(args.fsdp, tp=args.tp, cp=args.cp, dp=args.dp, pp=args.pp,
                                 ep=args.ep, expert_tp=args.etp or args.tp,
                                 distributed_optimizer=args.distributed_optimizer, words=TRAIN_FLAGS)


def _layout_to_split(args: TrainArgs) -> Layout:
    """``args.layout``; when its flags conflict (said above in the flags' words), its sizes
    alone, so that every divisibility problem is still listed in the same run."""
    try:
        return args.layout
    except ValueError:
        layout = Layout(tp=args.tp, pp=args.pp, vpp=args.vpp if args.pp > 1 else None, dp=args.dp,
                        sp=args.sp and args.tp > 1)
        try:  # the experts' split too, where the ranks hold it (else said above)
            return layout.with_(ep=args.ep, etp=args.etp)
        except ValueError:
            return layout

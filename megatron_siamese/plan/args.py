"""The plan's settings: ``train``'s (every flag means the same here) and the plan's own: the GPU, the
vocabulary, and how Megatron runs the layers where that changes what they keep. Plain data, no torch.

The defaults are what ``train`` builds on a GPU: without a model on the command line (no
``--num-layers``) the embedded default job's model and batch, the rest Megatron-LM's defaults; with one,
Megatron-LM's defaults for all it leaves out (``MEGATRON_LM_MODEL``), as ``runtime/pretrain_flags.py``
has it for train."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import List, Optional

from megatron_siamese.plan.activations import Implementation
from megatron_siamese.plan.gpus import gpu_memory_problem
from megatron_siamese.plan.per_gpu import PlanInputs
from megatron_siamese.plan.recompute import MODELED_MODULES, unmodeled_modules
from megatron_siamese.plan.shapes import SIAMESE_SCHEMES, shape_of
from megatron_siamese.plan.states import layout_sharding
from megatron_siamese.runtime.registry import KEY, ConfigError, Switch, setting
from megatron_siamese.training.args import BYTE_VOCAB, TrainArgs, padded_vocab_size
from megatron_siamese.training.args import problems as train_problems

PLAN = "plan"  # the argparse group of the plan's own settings
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")  # Megatron-LM's --attention-backend


def _switch(default: bool, flag: str, help: str):
    """A plan setting turned on by ``flag`` and off by its ``--no-`` form."""
    return setting(default, group=PLAN, flag=flag, action=argparse.BooleanOptionalAction, help=help)


def _megatron_lms(name: str, default, **changes):
    """TrainArgs' setting ``name`` with Megatron-LM's default, which train takes on a GPU (TrainArgs'
    own is the CPU run's), and ``changes`` to its definition."""
    definition = TrainArgs.__dataclass_fields__[name].metadata[KEY]
    return dataclasses.field(default=default, metadata={KEY: dataclasses.replace(definition, **changes)})


_DTYPE = TrainArgs.__dataclass_fields__["dtype"].metadata[KEY]


@dataclass(frozen=True)
class PlanArgs(TrainArgs):
    """``train``'s settings and the plan's own, with train's defaults on a GPU."""

    tp: int = _megatron_lms("tp", 1)
    transformer_impl: str = _megatron_lms("transformer_impl", "transformer_engine")
    moe_token_dispatcher_type: str = _megatron_lms("moe_token_dispatcher_type", "allgather")
    ffn_hidden_size: Optional[int] = _megatron_lms(
        "ffn_hidden_size", None, help="MLP width (default: 4 x hidden; with --swiglu two thirds of that, rounded down "
                                      "to a multiple of 64, as Megatron-LM's parser sets it)")
    # fp16 as train has it (Megatron-LM's loss-scaled fp16): a bf16 model's bytes
    dtype: str = _megatron_lms("dtype", "fp32", check=None, switches=(*_DTYPE.switches, Switch(
        ("--fp16",), "same as --dtype fp16", action="store_const", const="fp16")))

    vocab_size: int = setting(BYTE_VOCAB, group=PLAN, flag="--vocab-size", minimum=1,
                              help="tokens in the vocabulary, padded as Megatron-LM pads it (to a multiple of "
                                   "--make-vocab-size-divisible-by x --tp; default: the embedded corpus's byte "
                                   "vocabulary)")
    make_vocab_size_divisible_by: int = setting(128, group=PLAN, flag="--make-vocab-size-divisible-by", minimum=1,
                                                help="Megatron-LM's: the vocabulary is padded to a multiple of this "
                                                     "times --tp")
    gpu_memory: str = setting("h100-80gb", group=PLAN, flag="--gpu-memory", check=gpu_memory_problem,
                              metavar="GPU|SIZE",
                              help="the memory of one GPU: a100-40gb, a100-80gb, h100-80gb (h100), h200-141gb "
                                   "(h200), as nvidia-smi reports them, or a size (80GiB, 81559MiB, 141GB; a GB is "
                                   "10^9 bytes: 80GB is 74.5 GiB, an H100 80GB holds 79.6)")
    attention_backend: str = setting(
        "auto", group=PLAN, flag="--attention-backend", choices=ATTENTION_BACKENDS,
        help="Megatron-LM's: flash / fused keep Q, K, V and the output; unfused / local also the s x s "
             "probabilities; auto: flash with --transformer-impl transformer_engine, else local")
    bias_gelu_fusion: bool = _switch(
        True, "--bias-gelu-fusion",
        "Megatron's fused bias-GELU, whose activation keeps its input only (Megatron-LM's default; "
        "--no-bias-gelu-fusion: torch's GELU)")
    bias_swiglu_fusion: bool = _switch(
        True, "--bias-swiglu-fusion",
        "Megatron's fused bias-SwiGLU, whose activation keeps its input only (Megatron-LM's default; "
        "--no-bias-swiglu-fusion: torch's SwiGLU)")
    masked_softmax_fusion: bool = _switch(
        True, "--masked-softmax-fusion",
        "Megatron's fused masked softmax in unfused attention (its kernel takes 16-bit scores of a sequence "
        "of 17 to 4096 tokens), which keeps the 16-bit probabilities only (Megatron-LM's default; "
        "--no-masked-softmax-fusion: torch's softmax, which keeps its fp32 output as well)")
    rope_fusion: bool = _switch(
        True, "--rope-fusion",
        "fused RoPE (Transformer Engine's kernel), which keeps no cosines and sines per layer (Megatron-LM's "
        "default)")
    hidden_dropout: float = setting(0.1, group=PLAN, flag="--hidden-dropout", minimum=0.0,
                                    help="dropout after each sublayer: its mask kept per sublayer (Megatron-LM's "
                                         "default)")
    attention_dropout: float = setting(0.1, group=PLAN, flag="--attention-dropout", minimum=0.0,
                                       help="dropout on the attention probabilities (unfused attention keeps its mask "
                                            "and output; Megatron-LM's default)")
    max_position_embeddings: Optional[int] = setting(
        None, group=PLAN, flag="--max-position-embeddings", minimum=1,
        help="rows of the learned position table, at least --seq-length (Megatron-LM's)")
    group_query_attention: bool = setting(
        False, group=PLAN, flag="--group-query-attention", action="store_true",
        help="Megatron-LM's switch for --num-query-groups, which it ignores without it")
    deallocate_pipeline_outputs: bool = _switch(
        True, "--deallocate-pipeline-outputs",
        "free a stage output's data once sent, as Megatron-LM does (--no-deallocate-pipeline-outputs: "
        "kept until its backward, as a schedule driven without it keeps it)")

    def __post_init__(self):
        found = problems(self)
        if found:
            raise ConfigError(found)

    @property
    def bias_activation_fusion(self) -> bool:
        """Whether the MLP's activation is Megatron's fused one (GELU's or SwiGLU's switch, as the MLP is)."""
        # Megatron-LM fuses GELU only with a bias to add
        return self.bias_swiglu_fusion if self.gated_linear_unit else self.bias_gelu_fusion and self.add_bias_linear

    @property
    def padded_vocab(self) -> int:
        """Megatron-LM's padded vocabulary: a multiple of --make-vocab-size-divisible-by x --tp (splits over TP)."""
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by * self.tp)

    @property
    def mlp_width(self) -> int:
        """The dense MLP's width as Megatron-LM's parser sets it: --ffn-hidden-size, else 4 x hidden,
        with --swiglu two thirds of that rounded down to a multiple of 64 (two input projections)."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.gated_linear_unit else 4 * self.hidden_size

    @property
    def attention(self) -> str:
        """The attention kernel: "flash" (flash, fused) or "unfused" (unfused, local)."""
        backend = self.attention_backend
        if backend == "auto":
            return "flash" if self.transformer_impl == "transformer_engine" else "unfused"
        return "flash" if backend in ("flash", "fused") else "unfused"

    @property
    def siamese_paths(self) -> List[str]:
        """The SiameseNorm paths the settings leave possible on a GPU (``--fused-ops``, ``--boundary-ops``)."""
        if self.fused_ops is False:
            return ["pytorch"]
        return {True: ["joined"], False: ["apart"]}.get(self.boundary_ops, ["joined", "apart"])


# the embedded job's settings (runtime/pretrain_flags.EMBEDDED_JOB, PlanArgs' defaults) as Megatron-LM leaves
# each once the command line names a model (--num-layers) and not it: its default, or None where it has
# none (the flag is required; the global batch: micro-batch x DP)
MEGATRON_LM_MODEL = {"num_layers": None, "hidden_size": None, "num_attention_heads": None, "seq_length": None,
                     "max_position_embeddings": None,
                     "normalization": "LayerNorm", "position_embedding_type": "learned_absolute",
                     "gated_linear_unit": False, "add_bias_linear": True, "micro_batch_size": None,
                     "global_batch_size": None}
MEGATRON_FSDP_STRATEGY = "optim_grads_params"  # Megatron-LM's --data-parallel-sharding-strategy


def problems(args: PlanArgs) -> List[str]:
    """The problems with these settings, ``train``'s and the plan's own (one line each)."""
    found = train_problems(args)
    if args.num_query_groups and not args.group_query_attention:
        found.append(f"--num-query-groups {args.num_query_groups} without --group-query-attention: Megatron-LM ignores "
                     "it then (every head its own keys and values); add --group-query-attention, or leave it out")
    if args.max_position_embeddings is not None and args.max_position_embeddings < args.seq_length:
        found.append(f"--max-position-embeddings {args.max_position_embeddings} is below --seq-length "
                     f"{args.seq_length}, which Megatron-LM refuses: give at least {args.seq_length}")
    if args.norm not in SIAMESE_SCHEMES:
        found.append(f"plan sets stock Pre-Norm beside a SiameseNorm model of the standard variant: use --norm "
                     f"{' or --norm '.join(SIAMESE_SCHEMES)} (got --norm {args.norm})")
    if args.model != "gpt":
        found.append("plan models GPTModel: use --model gpt")
    ablations = [flag for flag, off in (("--no-siamese-input-norm", not args.siamese_input_norm),
                                        ("--no-siamese-depth-scale", not args.siamese_depth_scale)) if off]
    if ablations:
        found.append(f"plan counts the paper's SiameseNorm block; the component study's ablation{'s' if len(ablations) > 1 else ''} "
                     f"{' and '.join(ablations)} {'are' if len(ablations) > 1 else 'is'} not modeled: drop "
                     f"{'them' if len(ablations) > 1 else 'it'}")
    # DeepSeek-class parts (MLA's projections and latents; MTP's layers, embedding copy and logits)
    deepseek = [flag for flag, on in (("--multi-latent-attention", args.multi_latent_attention),
                                      ("--mtp-num-layers", args.mtp_num_layers)) if on]
    if deepseek:
        both = len(deepseek) > 1
        found.append(f"plan does not model {' or '.join(deepseek)} ({'their' if both else 'its'} weights, activations "
                     f"and traffic): leave {'them' if both else 'it'} out")
    try:
        unmodeled = unmodeled_modules(args.recomputation.modules)
    except ValueError:  # recompute flags Megatron refuses: said above, in the flags' words
        unmodeled = []
    # what train's rules said of these ("add X") would not make them plannable: "leave it out" alone
    found = [problem for problem in found if not any(f"--recompute-modules {module} " in problem
                                                     for module in unmodeled)]
    if unmodeled:
        found.append(f"plan does not model selective recompute of {', '.join(unmodeled)} (it models "
                     f"{', '.join(MODELED_MODULES)}): leave {'them' if len(unmodeled) > 1 else 'it'} out of "
                     "--recompute-modules")
    if args.fp8 is not None:
        found.append("plan counts bf16 or fp32 activations; what Transformer Engine keeps under FP8 is not modeled: "
                     "leave --fp8-format out")
    if args.num_moe_experts and args.ep > 1 and args.moe_token_dispatcher_type != "alltoall":
        found.append(f"plan counts the expert-parallel traffic of Megatron's alltoall dispatcher: use "
                     f"--moe-token-dispatcher-type alltoall (got {args.moe_token_dispatcher_type})")
    flash = args.attention_backend in ("flash", "fused")
    if flash and args.transformer_impl != "transformer_engine":
        found.append(f"--attention-backend {args.attention_backend} is Transformer Engine's attention: add "
                     "--transformer-impl transformer_engine (Megatron's local modules compute it unfused)")
    if args.cp > 1 and args.transformer_impl == "transformer_engine" and args.attention == "unfused":
        found.append(f"--attention-backend {args.attention_backend} under context parallelism: Transformer "
                     "Engine runs CP in its flash or fused attention; use --attention-backend flash, fused or auto")
    return found


def plan_inputs(args: PlanArgs) -> PlanInputs:
    bytes_ = 4 if args.dtype == "fp32" else 2
    # the kernel Megatron's fused masked softmax runs in: 16-bit scores of 17 to 4096 keys (else torch's softmax)
    softmax_fusion = args.masked_softmax_fusion and bytes_ == 2 and 16 < args.seq_length <= 4096
    impl = Implementation(bytes=bytes_, attention=args.attention, fused_activation=args.bias_activation_fusion,
                          softmax_fusion=softmax_fusion, rope_fusion=args.rope_fusion,
                          hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout)
    return PlanInputs(shape_of(args, args.padded_vocab, args.max_position_embeddings), args.layout, args.norm, impl, args.micro_batch_size,
                      args.num_microbatches, 4 if args.dtype == "fp32" else 2, layout_sharding(args.layout),
                      args.deallocate_pipeline_outputs)

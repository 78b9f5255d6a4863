"""Command-line flags: Megatron-LM's names where Megatron has one, the short names kept, a
help text and the default on every flag, and groups a command takes only what it uses."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from megatron_siamese.runtime.layout import RECOMPUTE
from megatron_siamese.runtime.settings import DTYPE_NAMES, MODEL_CLASSES, SCHEME_NAMES
from megatron_siamese.training.args import FP8_FORMATS, FP8_RECIPES, TASKS, TrainArgs

DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainArgs)}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown on every flag; descriptions keep their line breaks."""



def add(group, dest: str, *names: str, help: str, default: Any = dataclasses.MISSING, **kwargs) -> None:
    """A flag for TrainArgs field ``dest`` (default: the field's)."""
    value = DEFAULTS[dest] if default is dataclasses.MISSING else default
    group.add_argument(*names, dest=dest, default=value, help=help, **kwargs)


def add_model_flags(parser: argparse.ArgumentParser, schemes: bool = True) -> None:
    group = parser.add_argument_group("model")
    if schemes:
        add(group, "norm", "--norm", choices=SCHEME_NAMES,
            help="residual scheme: siamese (SiameseNorm), siamese-layer (the Megatron-LM --spec layer object), "
                 "siamese-hybrid (the authors' QK-norm variant), pre (Megatron's Pre-Norm layer), post (Post-Norm)")
        add(group, "model", "--model", choices=MODEL_CLASSES,
            help="gpt (GPTModel) or hybrid (HybridModel, megatron-core >= 0.19, SiameseNorm only)")
        add(group, "hybrid_layer_pattern", "--hybrid-layer-pattern", metavar="PATTERN",
            help="HybridModel layers, e.g. '*-*-' ('*' attention, '-' MLP; default: '*-' per --num-layers)")
    add(group, "num_layers", "--num-layers", type=int, help="transformer layers (GPT blocks)")
    add(group, "hidden_size", "--hidden-size", type=int, help="hidden size")
    add(group, "num_attention_heads", "--num-attention-heads", type=int, help="attention heads")
    add(group, "num_query_groups", "--num-query-groups", type=int,
        help="key/value head groups (GQA; default: one per head)")
    add(group, "ffn_hidden_size", "--ffn-hidden-size", type=int, help="MLP width (default: 4 x hidden)")
    add(group, "seq_length", "--seq-length", type=int, help="tokens per sequence")
    add(group, "normalization", "--normalization", choices=("LayerNorm", "RMSNorm"), help="norm kind")
    add(group, "position_embedding_type", "--position-embedding-type", choices=("rope", "learned_absolute"),
        help="position embedding")
    add(group, "gated_linear_unit", "--swiglu", action=argparse.BooleanOptionalAction,
        help="SwiGLU MLP (--no-swiglu: GELU)")
    add(group, "add_bias_linear", "--add-bias-linear", action="store_true", help="biases in the linear layers")
    add(group, "add_bias_linear", "--disable-bias-linear", action="store_false", help="no biases (Megatron-LM's name)")
    add(group, "zero_centered_gamma", "--apply-layernorm-1p", action="store_true",
        help="zero-centred norm weights (gamma = 1 + w)")
    add(group, "share_embeddings_and_output_weights", "--untie-embeddings-and-output-weights",
        action="store_false", help="separate input embedding and output layer weights")
    add(group, "init_method_std", "--init-method-std", type=float, help="standard deviation of the weight init")
    precision = parser.add_argument_group("precision and kernels")
    add(precision, "dtype", "--dtype", choices=DTYPE_NAMES + ("fp16",), help="parameter and activation dtype")
    precision.add_argument("--bf16", dest="dtype", action="store_const", const="bf16", help="same as --dtype bf16")
    add(precision, "fused_ops", "--fused-ops", action=argparse.BooleanOptionalAction,
        help="the fused C++/CUDA dual-norm ops: on, off, or (unset) wherever the extension has kernels")
    add(precision, "transformer_impl", "--transformer-impl", choices=("local", "transformer_engine"),
        help="Megatron's own modules, or Transformer Engine's GEMMs and attention (GPUs)")
    add(precision, "fp8", "--fp8-format", "--fp8", choices=FP8_FORMATS, help="Transformer Engine FP8 format")
    add(precision, "fp8_recipe", "--fp8-recipe", choices=FP8_RECIPES, help="FP8 scaling recipe, as Megatron names it")


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallelism")
    add(group, "tp", "--tensor-model-parallel-size", "--tp", type=int, help="tensor-parallel size")
    add(group, "pp", "--pipeline-model-parallel-size", "--pp", type=int, help="pipeline-parallel size")
    add(group, "vpp", "--num-virtual-stages-per-pipeline-rank", "--vpp", type=int,
        help="virtual pipeline stages per pipeline rank (interleaved 1F1B)")
    add(group, "dp", "--data-parallel-size", "--dp", type=int, help="data-parallel size")
    add(group, "sp", "--sequence-parallel", "--sp", action="store_true", help="sequence parallelism (needs TP > 1)")
    add(group, "distributed_optimizer", "--use-distributed-optimizer", "--distributed-optimizer",
        action="store_true", help="shard optimizer state over data-parallel ranks")
    add(group, "recompute", "--recompute", choices=RECOMPUTE,
        help="activation recompute: full (whole layers) or selective (norms and MLP)")


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training")
    add(group, "micro_batch_size", "--micro-batch-size", type=int, help="sequences per microbatch")
    add(group, "global_batch_size", "--global-batch-size", type=int,
        help="sequences per optimizer step (a multiple of micro batch size x DP)")
    add(group, "steps", "--train-iters", "--steps", type=int, help="optimizer steps")
    add(group, "lr", "--lr", type=float, help="peak learning rate (linear warm-up, cosine decay)")
    add(group, "min_lr", "--min-lr", type=float, help="final learning rate")
    add(group, "warmup_steps", "--lr-warmup-iters", "--warmup-steps", type=int,
        help="warm-up steps (default: 10%% of the run)")
    add(group, "weight_decay", "--weight-decay", type=float, help="weight decay")
    add(group, "clip_grad", "--clip-grad", type=float, help="gradient norm clipping")
    add(group, "seed", "--seed", type=int, help="random seed (weights and data order)")
    add(group, "eval_interval", "--eval-interval", type=int, help="validate every N steps")
    add(group, "eval_iters", "--eval-iters", type=int, help="validation batches per evaluation")
    add(group, "progress", "--progress", action=argparse.BooleanOptionalAction, help="progress bar and status lines")


def add_checkpoint_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("checkpoints")
    add(group, "output_dir", "--output-dir", help="checkpoints (OUTPUT_DIR/checkpoints) and results go here")
    add(group, "save_interval", "--save-interval", type=int,
        help="save a distributed checkpoint every N steps and at the end (default: none)")
    add(group, "stop_step", "--stop-step", "--exit-interval", type=int,
        help="stop after this step and save a checkpoint (resume with --load)")
    add(group, "load", "--load", metavar="DIR", help="resume from a checkpoints directory (its `latest`) or one "
        "step_<N> in it, at any TP/PP layout; --train-iters equal to its step only evaluates it")
    add(group, "overwrite", "--overwrite", action="store_true",
        help="replace the checkpoints another run left in OUTPUT_DIR (refused otherwise)")
    add(group, "override_opt_param_scheduler", "--override-opt_param-scheduler", action="store_true",
        help="on resume, train with these --lr/--min-lr/warm-up/--train-iters even if the checkpoint's differ")
    add(group, "use_checkpoint_opt_param_scheduler", "--use-checkpoint-opt_param-scheduler", action="store_true",
        help="on resume, keep the checkpoint's learning-rate schedule")


def add_data_flags(parser: argparse.ArgumentParser, tasks: bool = True) -> None:
    group = parser.add_argument_group("data")
    add(group, "cache_dir", "--cache-dir", help="where the tokenized corpus and dataset indices are cached")
    add(group, "data_prefix", "--data-prefix", "--data-path", metavar="PREFIX",
        help="an indexed dataset (.bin/.idx prefix) of byte tokens (default: the embedded King James Bible)")
    if tasks:
        add(group, "task", "--task", choices=TASKS,
            help="lm (the corpus), or synthetic addition (sum written normally or reversed; TP = PP = 1)")
        add(group, "addition_digits", "--addition-digits", type=int, help="operand digits (addition tasks)")


def train_args(options: argparse.Namespace, **changes) -> TrainArgs:
    """TrainArgs from the parsed flags (fields a command has no flag for keep their defaults)."""
    fields = {name: getattr(options, name) for name in DEFAULTS if hasattr(options, name)}
    return TrainArgs(**{**fields, **changes})

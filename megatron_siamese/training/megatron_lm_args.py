"""The run's arguments as Megatron-LM names them: the ``args`` of a checkpoint's common state.

Megatron-LM's ``load_checkpoint`` reads them back (parallel sizes, ``no_save_rng``/``no_save_optim``,
consumed samples, ``check_checkpoint_args``), so writing the same names lets its loop start from a
model-only checkpoint of ours and ``--use-checkpoint-args`` rebuild the model. Plain values only:
megatron-core 0.19 reads the common state with ``weights_only=True``.
"""

from __future__ import annotations

from argparse import Namespace

from megatron_siamese.hybrid_pattern import hybrid_pattern, num_layers
from megatron_siamese.runtime.settings import ModelSettings, moe_layer_freq

CHECKPOINT_VERSION = 3.0  # Megatron-LM's current "checkpoint_version" (3.0: no QKV reordering on load)
# the layer spec Megatron-LM's --spec names for a scheme, where there is one (docs/megatron-lm.md)
SPECS = {"siamese-layer": ["megatron_siamese.specs", "siamese_layer_spec"]}
MOE_SPECS = {"siamese-layer": ["megatron_siamese.specs", "siamese_moe_layer_spec"]}  # with --num-experts
# pretrain_hybrid.py's --spec: the whole HybridModel stack (local modules, as train builds it)
HYBRID_SPEC = ["megatron_siamese.hybrid", "siamese_hybrid_stack_spec"]


def _model_class_args(model: ModelSettings) -> dict:
    """What tells Megatron-LM's loader a HybridModel checkpoint from a GPTModel's: the layer pattern,
    and num_layers counted as it derives it, one per pattern symbol."""
    if model.model != "hybrid":
        return dict(num_layers=model.num_layers, spec=(MOE_SPECS if model.num_moe_experts else SPECS).get(model.norm))
    return dict(num_layers=num_layers(model), hybrid_layer_pattern=hybrid_pattern(model).text, spec=HYBRID_SPEC)


# settings Megatron-LM names as ModelSettings does
_SAME_NAMED = ("hidden_size", "num_attention_heads", "position_embedding_type", "normalization", "add_bias_linear",
               "qk_layernorm", "init_method_std", "seq_length", "transformer_impl")
_SAME_NAMED_MOE = ("moe_shared_expert_intermediate_size", "moe_router_topk", "moe_router_load_balancing_type",
                   "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_token_dispatcher_type", "moe_grouped_gemm")


def _same_named(model: ModelSettings, names) -> dict:
    return {name: getattr(model, name) for name in names}


def _moe_args(model: ModelSettings) -> dict:
    """The mixture-of-experts settings under Megatron-LM's names (its --use-checkpoint-args reads
    them; --moe-layer-freq as its int or 0/1 list)."""
    if model.num_moe_experts is None:
        return dict(num_experts=None)
    return dict(num_experts=model.num_moe_experts, moe_layer_freq=moe_layer_freq(model.moe_layer_freq),
                moe_ffn_hidden_size=model.expert_width, **_same_named(model, _SAME_NAMED_MOE))


def model_args(model: ModelSettings, vocab_size: int, vocab_multiple: int) -> dict:
    """The model's shape in Megatron-LM's argument names (what --use-checkpoint-args reads)."""
    return dict(
        **_model_class_args(model),
        **_same_named(model, _SAME_NAMED),
        ffn_hidden_size=model.mlp_width,
        group_query_attention=model.num_query_groups is not None,
        num_query_groups=model.num_query_groups or model.num_attention_heads,
        kv_channels=model.hidden_size // model.num_attention_heads,
        encoder_seq_length=model.seq_length,
        max_position_embeddings=model.seq_length,
        add_position_embedding=True,  # Megatron-LM's default: learned positions where the type asks for them
        apply_layernorm_1p=model.zero_centered_gamma,
        swiglu=model.gated_linear_unit,
        add_qkv_bias=model.add_bias_linear,
        untie_embeddings_and_output_weights=not model.share_embeddings_and_output_weights,
        padded_vocab_size=vocab_size,
        make_vocab_size_divisible_by=vocab_multiple,
        bf16=model.dtype == "bf16",
        fp16=False,
        **_moe_args(model),
    )


def checkpoint_args(args, step: int, vocab_size: int, vocab_multiple: int) -> Namespace:
    """The Namespace a model-only checkpoint of ``args`` (a TrainArgs) saved at ``step`` carries: the
    model and its layout (no optimizer state, no schedule: Megatron-LM's loop starts both fresh)."""
    return Namespace(
        **model_args(args, vocab_size, vocab_multiple),
        **args.layout.model_parallel_sizes(),
        data_parallel_size=args.dp,
        world_size=args.world_size,
        sequence_parallel=args.sp,
        use_distributed_optimizer=args.distributed_optimizer,
        use_torch_fsdp2=args.use_torch_fsdp2,  # its optimizer state is the non-distributed optimizer's
        ckpt_format="torch_dist",
        # the run is deterministic without RNG state (no dropout; the data is a function of the
        # step): none is saved, and Megatron-LM's loader then skips it (no --no-load-rng needed)
        no_save_rng=True,
        no_save_optim=True,  # Megatron-LM then starts a fresh optimizer
        iteration=step,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        consumed_train_samples=step * args.global_batch_size,
        skipped_train_samples=0,
        consumed_valid_samples=0,
        seed=args.seed,
    )

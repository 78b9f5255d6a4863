"""plan counts the model Megatron-LM's loop builds from the same flags: its parser's MLP width and
its tokenizer setup's padded vocabulary are the oracle (megatron-core >= 0.17 ships them)."""

import pytest

from megatron_siamese.plan.args import PlanArgs
from megatron_siamese.versions import ships_megatron_training

pytestmark = pytest.mark.skipif(not ships_megatron_training(), reason="megatron-core < 0.17: no Megatron-LM parser")


def megatron_lm_args(*flags: str):
    """Megatron-LM's arguments for ``flags`` on one rank, validated as its loop validates them."""
    from megatron.training.arguments import validate_args

    from megatron_siamese.runtime.pretrain import megatron_parser

    args = megatron_parser().parse_args(["--num-layers", "2", "--seq-length", "64", "--max-position-embeddings", "64",
                                         "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer", *flags])
    args.world_size, args.rank = 1, 0
    validate_args(args)
    return args


@pytest.mark.parametrize("hidden, swiglu, ffn", [(128, True, None), (96, True, None), (128, False, None),
                                                 (128, True, 200)])
def test_the_mlp_is_as_wide_as_megatron_lms_parser_makes_it(hidden, swiglu, ffn):
    flags = ["--hidden-size", str(hidden), "--num-attention-heads", "4", *(["--swiglu"] if swiglu else []),
             *(["--ffn-hidden-size", str(ffn)] if ffn else [])]
    plan = PlanArgs(hidden_size=hidden, num_attention_heads=4, gated_linear_unit=swiglu, ffn_hidden_size=ffn, tp=1)
    assert plan.mlp_width == megatron_lm_args(*flags, "--vocab-size", "257").ffn_hidden_size


@pytest.mark.parametrize("vocab, divisible, tp", [(258, 128, 1), (258, 128, 2), (50257, 64, 4), (128256, 128, 4)])
def test_the_vocabulary_is_padded_as_megatron_lm_pads_it(vocab, divisible, tp):
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    plan = PlanArgs(vocab_size=vocab, make_vocab_size_divisible_by=divisible, tp=tp, num_attention_heads=4,
                    hidden_size=128)
    assert plan.padded_vocab == calculate_padded_vocab_size(vocab, divisible, tp, logging_enabled=False)


def test_a_bad_value_of_a_megatron_lm_flag_is_refused_in_plans_own_name():
    from cli_runs import cli_here

    done = cli_here("plan", "--lr", "abc")
    assert done.returncode == 2 and "megatron-siamese plan: error: argument --lr: invalid float value" in done.stderr
    assert "usage: megatron-siamese plan" in done.stderr and "megatron-siamese train" not in done.stderr, done.stderr


def test_a_misspelled_flag_is_named_with_the_nearest_of_plans_and_megatron_lms():
    from cli_runs import cli_here

    done = cli_here("plan", "--nrom", "pre", "--save-intervall", "5")
    assert done.returncode == 2 and "unrecognized arguments: --nrom pre --save-intervall 5 (--nrom: did you mean " \
        "--norm?; --save-intervall: did you mean --save-interval?)" in done.stderr, done.stderr


# train command lines, each planned as train builds it on a GPU, and its data-parallel size (its ranks'
# over TP x PP x CP there, --data-parallel-size to the plan)
TRAIN_COMMANDS = {
    "the embedded job": ([], 1),
    "a model of the command line": (["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
                                     "--seq-length", "2048", "--max-position-embeddings", "4096",
                                     "--micro-batch-size", "4"], 2),
    "GQA, GELU without biases": (["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8",
                                  "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
                                  "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "2"],
                                 1),
    "Megatron-FSDP": (["--use-megatron-fsdp", "--no-gradient-accumulation-fusion", "--ckpt-format", "fsdp_dtensor"], 2),
    "the fused kernels off": (["--no-bias-swiglu-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion"], 1),
    "fp16, SP at TP 1": (["--fp16", "--sequence-parallel"], 1),
}
# what the model and its cost depend on: the plan's settings and Megatron-LM's arguments, each read alike
SAME_NAME = ("transformer_impl", "num_layers", "hidden_size", "num_attention_heads", "seq_length", "normalization",
             "position_embedding_type", "add_bias_linear", "micro_batch_size", "global_batch_size", "hidden_dropout",
             "attention_dropout", "masked_softmax_fusion", "use_megatron_fsdp", "moe_token_dispatcher_type")
READINGS = {
    **{name: (lambda args, name=name: getattr(args, name),) * 2 for name in SAME_NAME},
    "tp": (lambda plan: plan.tp, lambda megatron: megatron.tensor_model_parallel_size),
    "sp": (lambda plan: plan.sp, lambda megatron: megatron.sequence_parallel),
    "dtype": (lambda plan: plan.dtype, lambda megatron: "fp16" if megatron.fp16 else "bf16" if megatron.bf16 else "fp32"),
    "swiglu": (lambda plan: plan.gated_linear_unit, lambda megatron: megatron.swiglu),
    "mlp width": (lambda plan: plan.mlp_width, lambda megatron: megatron.ffn_hidden_size),
    "position table": (lambda plan: plan.max_position_embeddings or plan.seq_length,
                       lambda megatron: megatron.max_position_embeddings),
    "query groups": (lambda plan: plan.num_query_groups if plan.group_query_attention else None,
                     lambda megatron: megatron.num_query_groups if megatron.group_query_attention else None),
    "fused bias-activation": (lambda plan: plan.bias_activation_fusion,  # as Megatron-LM's config takes it
                              lambda megatron: megatron.bias_swiglu_fusion if megatron.swiglu else megatron.bias_gelu_fusion),
    "fused RoPE": (lambda plan: plan.rope_fusion and plan.position_embedding_type == "rope",
                   lambda megatron: megatron.apply_rope_fusion),
    "Megatron-FSDP's sharding": (
        lambda plan: plan.use_megatron_fsdp and plan.data_parallel_sharding_strategy,
        lambda megatron: megatron.use_megatron_fsdp and megatron.data_parallel_sharding_strategy),
}


@pytest.mark.parametrize("command", sorted(TRAIN_COMMANDS))
def test_plan_plans_the_model_train_builds_from_the_same_flags_on_a_gpu(command, monkeypatch):
    """Train's rule (the embedded job without --num-layers, Megatron-LM's defaults for the rest, or for all
    with it) read off Megatron-LM's parser after train's own additions, against plan's reading."""
    from megatron.training.arguments import validate_args

    from megatron_siamese.cli import parse
    from megatron_siamese.cli.plan import planned_args
    from megatron_siamese.runtime.pretrain import megatron_parser
    from megatron_siamese.runtime.pretrain_flags import add_defaults

    # Megatron-FSDP's checks of a GPU job's setting and of the GPU (an H100 here)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setattr("megatron.training.arguments.get_device_arch_version", lambda: 9)
    words, dp = TRAIN_COMMANDS[command]
    trained = megatron_parser().parse_args(add_defaults([*words, "--mock-data"], gpu=True))
    trained.world_size, trained.rank = dp, 0
    validate_args(trained)
    planned, _ = planned_args(parse(["plan", *words, "--data-parallel-size", str(dp)]))
    assert {what: of_plan(planned) for what, (of_plan, _) in READINGS.items()} == \
        {what: of_megatron(trained) for what, (_, of_megatron) in READINGS.items()}

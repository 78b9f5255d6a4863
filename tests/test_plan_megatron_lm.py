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

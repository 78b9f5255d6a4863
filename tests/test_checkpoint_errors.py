"""The model settings a checkpoint records, and how another model's are compared with them (the
refusal of a ``--load`` of another model names each difference)."""

import pytest

from megatron_siamese.training.args import TrainArgs
from megatron_siamese.training.checkpoint_settings import SETTINGS_KEY, model_fields, model_problem, recorded


@pytest.mark.stack_independent
def test_every_model_setting_is_compared_but_the_kernels_and_the_init():
    assert "norm" in model_fields() and "hidden_size" in model_fields() and "model" in model_fields()
    assert not {"fused_ops", "init_method_std", "fp8", "tp", "distributed_optimizer", "seed"} & set(model_fields())
    saved = recorded(TrainArgs())
    assert model_problem("ckpt", {SETTINGS_KEY: saved}, TrainArgs(tp=1, fused_ops=False, seed=7)) is None
    refused = model_problem("ckpt", {SETTINGS_KEY: saved}, TrainArgs(norm="pre", ffn_hidden_size=256))
    assert "--norm siamese -> pre, --ffn-hidden-size 512 -> 256" in refused
    assert model_problem("ckpt", {SETTINGS_KEY: saved}, TrainArgs(ffn_hidden_size=512)) is None  # the same MLP
    assert model_problem("ckpt", {}, TrainArgs(norm="pre")) is None  # saved before settings were: unknown

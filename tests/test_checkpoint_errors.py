"""The model settings a checkpoint records, and how another model's are compared with them (the
refusal of a ``--load`` of another model names each difference); a directory whose tracker is missing."""

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


@pytest.mark.stack_independent
def test_a_directory_without_its_tracker_says_whether_a_save_finished(tmp_path):
    """No `latest_checkpointed_iteration.txt`: either no save finished, or one did and the job stopped
    before recording it (an async save is recorded iterations later); each is said as it is."""
    from megatron_siamese.training.checkpoint_files import CheckpointError, resolve

    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "iter_0000002" / "metadata.json").write_text("{}")  # torch's .metadata, written last, is not
    with pytest.raises(CheckpointError, match=r"has no complete checkpoint \(iter_0000002: a save that did not "
                                              r"finish\).*start without --load"):
        resolve(str(tmp_path))
    (tmp_path / "iter_0000004").mkdir()
    for name in ("metadata.json", ".metadata"):
        (tmp_path / "iter_0000004" / name).write_text("")
    with pytest.raises(CheckpointError, match=r"records no checkpoint \(no `latest_checkpointed_iteration.txt`: the "
                                              r"job stopped before its last save was recorded\); complete checkpoints "
                                              rf"in {tmp_path}: iter_0000004 \(pass one to --load\)"):
        resolve(str(tmp_path))

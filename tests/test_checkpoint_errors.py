"""The model settings a checkpoint records, and how another model's are compared with them (the
refusal of a ``--load`` of another model names each difference); a directory whose tracker is missing."""

import pytest

from megatron_siamese.training.args import TrainArgs
from megatron_siamese.training.checkpoint_settings import SETTINGS_KEY, model_fields, model_problem, recorded
from megatron_siamese.versions import installed_megatron_core, release


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


@pytest.mark.stack_independent
def test_a_directory_of_the_other_kind_is_named_with_the_command_that_reads_it(tmp_path, capsys):
    """A Transformers model given as a checkpoint points to import-hf and eval's --hf; a checkpoint given as a
    Transformers model to export and eval's --load. (Each said only that it was not what was asked for.)"""
    from megatron_siamese.cli import main
    from megatron_siamese.training.checkpoint_files import CheckpointError, resolve

    transformers, checkpoint = tmp_path / "hf", tmp_path / "run" / "iter_0000004"
    transformers.mkdir()
    (transformers / "config.json").write_text("{}")
    checkpoint.mkdir(parents=True)
    with pytest.raises(CheckpointError, match=rf"--load {transformers} is a Transformers model directory, not a "
                                              rf"checkpoint: `megatron-siamese import-hf --hf {transformers} "
                                              r"--output-dir DIR` makes one of it \(eval reads it as --hf\)"):
        resolve(str(transformers))
    assert main(["import-hf", "--hf", str(checkpoint), "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().endswith("has no config.json: give a Hugging Face model directory (it is a "
                                                    "checkpoint already: `megatron-siamese export` makes a Hugging "
                                                    "Face model of it)")
    assert main(["eval", "--hf", str(checkpoint), "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().endswith("no config.json there; it is a checkpoint: give it as --load")


def test_train_refuses_a_load_with_nothing_to_load_or_past_its_train_iters(tmp_path, monkeypatch):
    """A directory that holds no checkpoint, and is not the --save one a requeue starts from, trained from
    random with exit status 0 (a Transformers export, a TensorBoard directory); a checkpoint past
    --train-iters failed in Megatron's data sampler, or did nothing."""
    from argparse import Namespace

    from megatron_siamese.runtime import pretrain_load

    def problem(load, save=None, train_iters=30, common=None):
        monkeypatch.setattr(pretrain_load, "_common_state", lambda *args: common)
        return pretrain_load.checkpoint_problem(Namespace(load=str(load), save=save and str(save), ckpt_step=None,
                                                          train_iters=train_iters, finetune=False))

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "ck").mkdir()  # its common state, stubbed
    assert problem(tmp_path / "tensorboard").startswith(f"--load {tmp_path / 'tensorboard'} holds no checkpoint "
                                                        "(Megatron-LM's loop would start from random): give a checkpoint")
    assert "it is a Transformers model directory; `megatron-siamese import-hf --hf" in problem(tmp_path / "hf")
    assert problem(tmp_path / "tensorboard", save=tmp_path / "tensorboard") is None  # a requeue's first start
    assert problem(tmp_path / "ck", common={"iteration": 200}, train_iters=100) == (
        f"--load {tmp_path / 'ck'} is at iteration 200, past --train-iters 100: give a larger --train-iters to train "
        "on (Megatron-LM's loop would fail, or do nothing)")
    assert problem(tmp_path / "ck", common={"iteration": 100}, train_iters=100) is None  # a finished requeue


def complete_checkpoint(path):
    path.mkdir(parents=True)
    for name in ("metadata.json", ".metadata"):  # what a finished save leaves (torch's .metadata last)
        (path / name).write_text("{}")
    return path


@pytest.mark.stack_independent
def test_train_refuses_a_load_megatron_lm_would_start_from_random(tmp_path):
    """Megatron-LM's loop loads ``--load``'s tracker, or ``--load/iter_<--ckpt-step>``, and starts from
    random for anything else: one checkpoint, a run's directory or an unrecorded save is refused
    naming the flags that load it; an empty ``--save`` directory (a requeue's first start) is not."""
    from megatron_siamese.runtime.pretrain_load import loaded_checkpoint
    from megatron_siamese.training.checkpoint_files import CheckpointError, write_latest

    checkpoints = tmp_path / "run" / "checkpoints"
    complete_checkpoint(checkpoints / "iter_0000004")
    with pytest.raises(CheckpointError, match=rf"records no checkpoint .*would start from random: --ckpt-step 4 "
                                              rf"loads iter_0000004, the newest complete one"):
        loaded_checkpoint(str(checkpoints))
    assert loaded_checkpoint(str(checkpoints), 4) == str(checkpoints / "iter_0000004")
    with pytest.raises(CheckpointError, match=rf"--ckpt-step 6: there is no complete {checkpoints}/iter_0000006; complete "
                                              rf"checkpoints in {checkpoints}: iter_0000004"):
        loaded_checkpoint(str(checkpoints), 6)
    write_latest(str(checkpoints), 4)
    assert loaded_checkpoint(str(checkpoints)) == str(checkpoints / "iter_0000004")
    with pytest.raises(CheckpointError, match=rf"--load {checkpoints}/iter_0000004 is one checkpoint; .*would start "
                                              rf"from random: --load {checkpoints} --ckpt-step 4"):
        loaded_checkpoint(str(checkpoints / "iter_0000004"))
    with pytest.raises(CheckpointError, match=rf"is a run's directory; .*: --load {checkpoints}$"):
        loaded_checkpoint(str(tmp_path / "run"))
    assert loaded_checkpoint(str(tmp_path / "empty")) is None  # --save X --load X, the first start
    complete_checkpoint(tmp_path / "earlier" / "step_3")
    with pytest.raises(CheckpointError, match=r"iter_<N> checkpoints only, and these are an earlier release's"):
        loaded_checkpoint(str(tmp_path / "earlier"))


@pytest.mark.skipif(release(installed_megatron_core()) >= (0, 19), reason="megatron-core 0.19 reads its own format")
def test_a_newer_megatron_cores_checkpoint_is_refused_naming_the_stack_that_reads_it(tmp_path):
    """megatron-core 0.19 keeps a checkpoint's common state (its args, holding classes 0.19 added) in one of the
    shards, which 0.16.1 cannot read: refused by version, not reported as an unreadable save."""
    import io

    import torch
    from torch.distributed.checkpoint import FileSystemWriter, save

    from megatron_siamese.training.checkpoint_files import COMMON_SHARD, problems

    checkpoint = tmp_path / "iter_0000002"
    common = io.BytesIO()
    torch.save({"iteration": 2}, common)  # as 0.19 writes it: a torch.save archive among the shards
    save({f"{COMMON_SHARD}/shard_0_1": common}, storage_writer=FileSystemWriter(str(checkpoint)), no_dist=True)
    (checkpoint / "metadata.json").write_text("{}")
    (found,) = problems(str(checkpoint))
    assert found.startswith(f"{checkpoint} was written by megatron-core >= 0.19 (its common state is one of the "
                            f"shards), which megatron-core {installed_megatron_core()} cannot read: run this command "
                            "with 0.19 (bash scripts/setup.sh mcore019")
    # the refusal a command prints: no steps beside it to load instead (they are 0.19's too; it said there were none)
    from megatron_siamese.training.checkpoint_files import CheckpointError, checked

    with pytest.raises(CheckpointError) as refused:
        checked(str(checkpoint))
    assert str(refused.value).endswith("or export the model there and import-hf it here")

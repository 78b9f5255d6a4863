"""Checkpoints carry the run's settings; a resume that cannot work, every broken file, a full disk
and an interrupted save are named in one line (the CLI as a user drives it: exit codes, no
Traceback, the files left on disk); the changes a resume may make work and continue the losses."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_siamese.training.args import TrainArgs
from megatron_siamese.training.checkpoint_files import TRACKER
from megatron_siamese.training.checkpoint_settings import SETTINGS_KEY, model_fields, model_problem, recorded

CLI = [sys.executable, "-m", "megatron_siamese.cli"]
SMALL = ["--num-layers", "2", "--hidden-size", "32", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--eval-iters", "1", "--eval-interval", "100", "--no-progress",
         "--log-interval", "1"]
FAULTS = str(Path(__file__).parent / "fault_injection")  # sitecustomize: an injected full disk


class Run(type(Path())):
    """A run's output directory, with the losses it logged (``.losses``)."""


def cli(*args, env=None, timeout=300):
    start = time.monotonic()
    done = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    done.seconds = time.monotonic() - start
    return done


def train(output, cache, *args, **kwargs):
    return cli("train", *SMALL, "--cache-dir", cache, "--output-dir", output, *args, **kwargs)


def losses(done) -> dict:
    """Step -> training loss, from Megatron-LM's iteration lines (--log-interval 1: one per step)."""
    return {int(step): float(loss) for step, loss in
            re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|", done.stdout)}


def assert_refused(done, *messages, exit_code=2):
    assert done.returncode == exit_code, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, done.stderr
    for message in messages:
        assert message in errors[0], errors[0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, cache):
    """A 4-step run on one rank, checkpoints at steps 2 and 4 (and its losses)."""
    root = Run(tmp_path_factory.mktemp("saved") / "run")
    done = train(root, cache, "--tp", "1", "--steps", "4", "--save-interval", "2")
    assert done.returncode == 0, done.stderr
    root.losses = losses(done)
    assert sorted(root.losses) == [1, 2, 3, 4]
    return root


@pytest.fixture(scope="module")
def distributed(tmp_path_factory, cache):
    """A 4-step TP1 x DP2 distributed-optimizer run, checkpoints at steps 2 and 4."""
    root = Run(tmp_path_factory.mktemp("distributed") / "run")
    done = train(root, cache, "--tp", "1", "--dp", "2", "--use-distributed-optimizer", "--steps", "4",
                 "--save-interval", "2")
    assert done.returncode == 0, done.stderr
    root.losses = losses(done)
    return root


def copy_of(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run" / "checkpoints"


# -- the settings a checkpoint stores -----------------------------------------------------

@pytest.mark.stack_independent
def test_every_model_setting_is_compared_but_the_kernels_and_the_init():
    assert "norm" in model_fields() and "hidden_size" in model_fields() and "model" in model_fields()
    assert not {"fused_ops", "init_method_std", "fp8", "tp", "distributed_optimizer", "lr"} & set(model_fields())
    saved = recorded(TrainArgs())
    assert model_problem("ckpt", {SETTINGS_KEY: saved}, TrainArgs(tp=1, fused_ops=False, lr=1e-3)) is None
    refused = model_problem("ckpt", {SETTINGS_KEY: saved}, TrainArgs(norm="pre", ffn_hidden_size=256))
    assert "--norm siamese -> pre, --ffn-hidden-size 512 -> 256" in refused
    assert model_problem("ckpt", {SETTINGS_KEY: saved}, TrainArgs(ffn_hidden_size=512)) is None  # the same MLP
    assert model_problem("ckpt", {}, TrainArgs(norm="pre")) is None  # saved before settings were: unknown


def test_the_settings_are_in_the_common_state(saved):
    from megatron_siamese.training.checkpoint_files import common_state

    stored = common_state(str(saved / "checkpoints" / "iter_0000004"))[SETTINGS_KEY]
    assert stored["norm"] == "siamese" and stored["hidden_size"] == 32 and stored["save_interval"] == 2
    assert set(stored) == set(recorded(TrainArgs()))


@pytest.mark.stack_independent  # our own checks around Megatron: one stack is enough
def test_another_model_is_refused_listing_each_difference(tmp_path, cache, saved):
    done = train(tmp_path, cache, "--tp", "1", "--steps", "6", "--norm", "pre", "--hidden-size", "64",
                 "--load", saved / "checkpoints")
    assert_refused(done, f"--load {saved / 'checkpoints' / 'iter_0000004'} holds another model",
                   "--norm siamese -> pre", "--hidden-size 32 -> 64", "give the checkpoint's values")
    assert done.seconds < 30 and not (tmp_path / "checkpoints").exists()


def test_a_resume_may_change_the_layout_and_continues_the_losses(tmp_path, cache, saved):
    done = train(tmp_path, cache, "--tp", "2", "--recompute", "full", "--no-fused-ops", "--steps", "4",
                 "--load", saved / "checkpoints" / "iter_0000002")
    assert done.returncode == 0, done.stderr
    resumed = losses(done)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(saved.losses[step], abs=2e-4)


# -- the optimizer state across layouts ---------------------------------------------------

def test_the_optimizer_kind_and_a_distributed_optimizers_tp_must_match_or_weights_only(tmp_path, cache, distributed):
    checkpoints = distributed / "checkpoints"
    plain = train(tmp_path / "a", cache, "--tp", "1", "--dp", "2", "--steps", "4", "--load", checkpoints)
    assert_refused(plain, "holds the distributed optimizer's state, which the plain optimizer cannot load",
                   "resume with --use-distributed-optimizer", "--no-load-optim")
    tp2 = train(tmp_path / "b", cache, "--tp", "2", "--dp", "2", "--use-distributed-optimizer", "--steps", "4",
                "--load", checkpoints)
    assert_refused(tp2, "reshards over --dp only: resume at the saved --tp 1 --pp 1", "--no-load-optim")
    # weights only: a fresh optimizer, the schedule from the checkpoint's step
    weights = train(tmp_path / "c", cache, "--tp", "1", "--dp", "2", "--steps", "6", "--load", checkpoints,
                    "--no-load-optim")
    assert weights.returncode == 0, weights.stderr
    assert "at step 4" in weights.stdout and sorted(losses(weights)) == [5, 6]
    assert losses(weights)[5] < distributed.losses[1] - 0.1  # the trained weights, not a fresh model


def test_a_distributed_optimizers_state_reshards_over_dp(tmp_path, cache, distributed):
    done = train(tmp_path, cache, "--tp", "1", "--dp", "4", "--micro-batch-size", "1", "--use-distributed-optimizer",
                 "--steps", "4", "--load", distributed / "checkpoints" / "iter_0000002")
    assert done.returncode == 0, done.stderr
    resumed = losses(done)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):  # the same samples per step (4 = 2 x DP2 = 1 x DP4): the same losses
        assert resumed[step] == pytest.approx(distributed.losses[step], abs=2e-4)


# -- broken files -------------------------------------------------------------------------

def _shard(step: Path) -> Path:
    return sorted(step.glob("*.distcp"))[0]


BROKEN = {
    "missing common.pt": ("common.pt", lambda p: p.unlink(), "is missing"),
    "missing metadata.json": ("metadata.json", lambda p: p.unlink(), "is missing: the save did not finish"),
    "missing .metadata": (".metadata", lambda p: p.unlink(), "is missing: the save did not finish"),
    "random bytes in a shard": (None, lambda p: p.write_bytes(os.urandom(p.stat().st_size)), "is corrupt"),
    "a missing shard": (None, lambda p: p.unlink(), "is missing"),
}


@pytest.mark.stack_independent  # our own checks around Megatron: one stack is enough
@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_file_is_named_before_any_rank_starts(tmp_path, cache, saved, name):
    filename, corrupt, what = BROKEN[name]
    checkpoints = copy_of(saved, tmp_path)
    path = checkpoints / "iter_0000004" / filename if filename else _shard(checkpoints / "iter_0000004")
    if not path.exists():
        pytest.skip(f"this megatron-core writes no {filename} (from 0.19 the common state is a shard)")
    corrupt(path)
    done = train(tmp_path / "out", cache, "--tp", "1", "--steps", "6", "--load", checkpoints)
    assert_refused(done, f"{path} {what}", f"complete checkpoints in {checkpoints}: iter_0000002 (pass one to --load)")
    assert done.seconds < 30


@pytest.mark.stack_independent  # our own checks around Megatron: one stack is enough
def test_damage_inside_a_tensor_is_found_by_its_crc(tmp_path, cache, saved):
    # torch's loader checks no CRC: these bytes would load as wrong weights
    checkpoints = copy_of(saved, tmp_path)
    shard = _shard(checkpoints / "iter_0000004")
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = os.urandom(64)  # inside an item: its zip header still looks right
    shard.write_bytes(bytes(data))
    done = train(tmp_path / "out", cache, "--tp", "1", "--steps", "4", "--load", checkpoints)
    assert_refused(done, f"{shard} is corrupt (an item in it fails its CRC-32)",
                   f"complete checkpoints in {checkpoints}: iter_0000002")


@pytest.mark.stack_independent  # our own checks around Megatron: one stack is enough
def test_a_tracker_naming_a_missing_directory(tmp_path, cache, saved):
    checkpoints = copy_of(saved, tmp_path)
    shutil.rmtree(checkpoints / "iter_0000004")
    done = train(tmp_path / "out", cache, "--tp", "1", "--steps", "6", "--load", checkpoints)
    assert_refused(done, f"{checkpoints / TRACKER} names iteration 4, but there is no {checkpoints / 'iter_0000004'}",
                   "iter_0000002 (pass one to --load)")


# -- a full disk, an interrupted save, old checkpoints ------------------------------------

def test_a_full_disk_is_said_and_the_tracker_stays_on_the_last_complete_step(tmp_path, cache):
    done = train(tmp_path, cache, "--tp", "1", "--steps", "4", "--save-interval", "2",
                 env={"PYTHONPATH": os.pathsep.join([FAULTS, os.environ.get("PYTHONPATH", "")]),
                      "MEGATRON_SIAMESE_TEST_ENOSPC": "iter_0000004"})
    checkpoints = tmp_path / "checkpoints"
    assert_refused(done, f"disk full while saving iter_0000004 to {checkpoints}: No space left on device",
                   f"{TRACKER} still names iter_0000002", exit_code=1)
    assert (checkpoints / TRACKER).read_text().strip() == "2"
    assert sorted(os.listdir(checkpoints)) == ["iter_0000002", TRACKER]  # the partial iter_0000004 is gone


def _interrupted_first_save(checkpoints: Path, saved: Path):
    """What a second Ctrl-C during the first save leaves: a step directory without torch's index."""
    shutil.copytree(saved / "checkpoints" / "iter_0000002", checkpoints / "iter_0000002")
    (checkpoints / "iter_0000002" / ".metadata").unlink()


@pytest.mark.stack_independent  # our preflight and save logic, not Megatron's format
def test_an_interrupted_save_never_blocks_a_rerun_and_is_named_on_load(tmp_path, cache, saved):
    checkpoints = tmp_path / "run" / "checkpoints"
    _interrupted_first_save(checkpoints, saved)
    refused = train(tmp_path / "other", cache, "--tp", "1", "--steps", "4", "--load", checkpoints)
    assert_refused(refused, f"--load {checkpoints} has no complete checkpoint (iter_0000002: a save that did not finish)",
                   "start without --load")
    named = train(tmp_path / "other", cache, "--tp", "1", "--steps", "4", "--load", checkpoints / "iter_0000002")
    assert_refused(named, f"{checkpoints / 'iter_0000002' / '.metadata'} is missing: the save did not finish",
                   f"there is no complete checkpoint in {checkpoints}")
    rerun = train(tmp_path / "run", cache, "--tp", "1", "--steps", "2", "--save-interval", "2")
    assert rerun.returncode == 0, rerun.stderr
    assert (checkpoints / TRACKER).read_text().strip() == "2"
    assert (checkpoints / "iter_0000002" / ".metadata").exists()  # replaced by the new save, not mixed with it


@pytest.mark.stack_independent  # our preflight and save logic, not Megatron's format
def test_a_run_that_saves_nothing_is_not_refused_and_overwrite_waits_for_a_save(tmp_path, cache, saved):
    checkpoints = copy_of(saved, tmp_path)
    before = sorted(os.listdir(checkpoints))
    for extra in ([], ["--overwrite"]):
        done = train(tmp_path / "run", cache, "--tp", "1", "--steps", "1", *extra)
        assert done.returncode == 0, done.stderr
        assert sorted(os.listdir(checkpoints)) == before
    refused = train(tmp_path / "run", cache, "--tp", "1", "--steps", "2", "--save-interval", "2")
    assert_refused(refused, "already holds another run's checkpoints (iter_0000002, iter_0000004)", "--overwrite")


@pytest.mark.stack_independent
def test_a_stop_signal_does_not_save_among_another_runs_checkpoints(tmp_path, cache, saved):
    checkpoints = copy_of(saved, tmp_path)
    before = {name: (checkpoints / name).stat().st_mtime_ns for name in os.listdir(checkpoints)}
    process = subprocess.Popen([*CLI, "train", *SMALL, "--tp", "1", "--cache-dir", cache, "--output-dir",
                                tmp_path / "run", "--steps", "100000"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout.readline().startswith("checkpoints: none")  # not refused: it plans no save
    time.sleep(2.0)
    os.killpg(process.pid, signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert re.search(rf"stopped at step \d+ \(SIGINT\): not saved, {re.escape(str(checkpoints))} holds another run's "
                     r"checkpoints \(iter_0000002, iter_0000004; --overwrite replaces them\)", err), err[-3000:]
    assert {name: (checkpoints / name).stat().st_mtime_ns for name in os.listdir(checkpoints)} == before


@pytest.mark.stack_independent  # our preflight and save logic, not Megatron's format
def test_analyze_reads_the_weights_of_a_distributed_optimizer_checkpoint(tmp_path, cache, distributed):
    """analyze runs on one rank and loads no optimizer state, so a DP2 distributed-optimizer
    checkpoint (whose state cannot follow to DP1 x plain optimizer) analyzes as it is."""
    done = cli("analyze", *SMALL[:6], "--load", distributed / "checkpoints", "--cache-dir", cache,
               "--output-dir", tmp_path / "analysis")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "effective depth" in done.stdout

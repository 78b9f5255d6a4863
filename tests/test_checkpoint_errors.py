"""Checkpoints carry the run's settings; a resume that cannot work, every broken file, a full disk
and an interrupted save are named in one line (exit codes, no Traceback, the files left on disk);
the changes a resume may make work and continue the losses. On the session's ``trained_run`` and
``distributed_run`` (copied before a test changes them), driven in this process (``cli_here``:
what the command decides and does with a checkpoint), except where the process itself is tested
(a signal, the full disk injected into a new interpreter)."""

import os
import re
import shutil
import signal
from pathlib import Path

import pytest
from cli_refusals import record_rank_starts, running
from cli_runs import cli, cli_here
from conftest import SMALL_RUN, logged_losses

from megatron_siamese.training.args import TrainArgs
from megatron_siamese.training.checkpoint_files import TRACKER
from megatron_siamese.training.checkpoint_settings import SETTINGS_KEY, model_fields, model_problem, recorded

SMALL = SMALL_RUN  # the shared runs' settings: --no-progress, --log-interval 1 (a line per step)
FAULTS = str(Path(__file__).parent / "fault_injection")  # sitecustomize: an injected full disk


def train(output, cache, *args, **kwargs):
    """The command in a process of its own."""
    return cli("train", *SMALL, "--cache-dir", cache, "--output-dir", output, *args, **kwargs)


def train_here(output, cache, *args):
    """The command's ``main`` in this process."""
    return cli_here("train", *SMALL, "--cache-dir", cache, "--output-dir", output, *args)


def losses(done) -> dict:
    """Step -> training loss, from Megatron-LM's iteration lines (--log-interval 1: one per step)."""
    return logged_losses(done.stdout)


def assert_refused(done, *messages, exit_code=2):
    assert done.returncode == exit_code, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, done.stderr
    for message in messages:
        assert message in errors[0], errors[0]


@pytest.fixture
def rank_starts(monkeypatch):
    """Every start of ranks in this process during the test (``record_rank_starts``)."""
    return record_rank_starts(monkeypatch)


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


def test_the_settings_are_in_the_common_state(trained_run):
    from megatron_siamese.training.checkpoint_files import common_state

    stored = common_state(str(trained_run / "checkpoints" / "iter_0000004"))[SETTINGS_KEY]
    assert stored["norm"] == "siamese" and stored["hidden_size"] == 32 and stored["save_interval"] == 2
    assert set(stored) == set(recorded(TrainArgs()))


def test_another_model_is_refused_listing_each_difference(tmp_path, corpus_cache, trained_run, rank_starts):
    done = train_here(tmp_path, corpus_cache, "--tp", "1", "--steps", "6", "--norm", "pre", "--hidden-size", "64",
                      "--load", trained_run / "checkpoints")
    assert_refused(done, f"--load {trained_run / 'checkpoints' / 'iter_0000004'} holds another model",
                   "--norm siamese -> pre", "--hidden-size 32 -> 64", "give the checkpoint's values")
    assert rank_starts == [] and not (tmp_path / "checkpoints").exists()  # refused before any rank started


def test_a_resume_may_change_the_layout_and_continues_the_losses(tmp_path, corpus_cache, trained_run):
    done = train_here(tmp_path, corpus_cache, "--tp", "2", "--recompute", "full", "--no-fused-ops", "--steps", "4",
                      "--load", trained_run / "checkpoints" / "iter_0000002")
    assert done.returncode == 0, done.stderr
    resumed = losses(done)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(trained_run.losses[step], abs=2e-4)


# -- the optimizer state across layouts ---------------------------------------------------

def test_the_optimizer_kind_and_a_distributed_optimizers_tp_must_match_or_weights_only(
        tmp_path, corpus_cache, distributed_run, rank_starts):
    checkpoints = distributed_run / "checkpoints"
    plain = train_here(tmp_path / "a", corpus_cache, "--tp", "1", "--dp", "2", "--steps", "4", "--load", checkpoints)
    assert_refused(plain, "holds the distributed optimizer's state, which the plain optimizer cannot load",
                   "resume with --use-distributed-optimizer", "--no-load-optim")
    tp2 = train_here(tmp_path / "b", corpus_cache, "--tp", "2", "--dp", "2", "--use-distributed-optimizer",
                     "--steps", "4", "--load", checkpoints)
    assert_refused(tp2, "reshards over --dp only: resume at the saved --tp 1 --pp 1", "--no-load-optim")
    fsdp2 = train_here(tmp_path / "d", corpus_cache, "--tp", "1", "--dp", "2", "--use-torch-fsdp2", "--steps", "4",
                       "--load", checkpoints)  # FSDP2 steps its shards with the plain optimizer
    assert_refused(fsdp2, "resume with --use-distributed-optimizer instead of --use-torch-fsdp2", "--no-load-optim")
    assert rank_starts == []  # all refused before any rank started
    # weights only: a fresh optimizer, the schedule from the checkpoint's step
    weights = train_here(tmp_path / "c", corpus_cache, "--tp", "1", "--dp", "2", "--steps", "6", "--load", checkpoints,
                         "--no-load-optim")
    assert weights.returncode == 0, weights.stderr
    assert "at step 4" in weights.stdout and sorted(losses(weights)) == [5, 6]
    assert losses(weights)[5] < distributed_run.losses[1] - 0.1  # the trained weights, not a fresh model


def test_a_distributed_optimizers_state_reshards_over_dp(tmp_path, corpus_cache, distributed_run):
    """Resumed at step 2 on DP4 (the same samples per step: 4 = 2 x DP2 = 1 x DP4), the run goes on
    with the uninterrupted run's losses. Step 3's loss is computed before any update of the
    resumed run; step 4's after step 3's update, which Adam made with the state resharded from
    DP2 to DP4: a fresh state there (--no-load-optim, the control) gives another step-4 loss."""
    resume = ["--tp", "1", "--dp", "4", "--micro-batch-size", "1", "--use-distributed-optimizer", "--steps", "4",
              "--load", distributed_run / "checkpoints" / "iter_0000002"]
    done = train_here(tmp_path / "resharded", corpus_cache, *resume)
    fresh = train_here(tmp_path / "fresh", corpus_cache, *resume, "--no-load-optim")
    assert done.returncode == 0 and fresh.returncode == 0, done.stderr + fresh.stderr
    resumed, control = losses(done), losses(fresh)
    assert sorted(resumed) == sorted(control) == [3, 4]
    for step in (3, 4):  # the same losses as the uninterrupted run
        assert resumed[step] == pytest.approx(distributed_run.losses[step], abs=2e-4)
    # the control: the same weights at step 3, but step 3's update made with a fresh optimizer state
    # leads to another step-4 loss, which the comparison above would have refused
    assert control[3] == pytest.approx(distributed_run.losses[3], abs=2e-4)
    assert control[4] != pytest.approx(distributed_run.losses[4], abs=2e-4), (control, distributed_run.losses)


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


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_file_is_named_before_any_rank_starts(tmp_path, corpus_cache, trained_run, name, rank_starts):
    filename, corrupt, what = BROKEN[name]
    checkpoints = copy_of(trained_run, tmp_path)
    path = checkpoints / "iter_0000004" / filename if filename else _shard(checkpoints / "iter_0000004")
    if not path.exists():
        pytest.skip(f"this megatron-core writes no {filename} (from 0.19 the common state is a shard)")
    corrupt(path)
    done = train_here(tmp_path / "out", corpus_cache, "--tp", "1", "--steps", "6", "--load", checkpoints)
    assert_refused(done, f"{path} {what}", f"complete checkpoints in {checkpoints}: iter_0000002 (pass one to --load)")
    assert rank_starts == []


def test_damage_inside_a_tensor_is_found_by_its_crc(tmp_path, corpus_cache, trained_run, rank_starts):
    # torch's loader checks no CRC: these bytes would load as wrong weights
    checkpoints = copy_of(trained_run, tmp_path)
    shard = _shard(checkpoints / "iter_0000004")
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = os.urandom(64)  # inside an item: its zip header still looks right
    shard.write_bytes(bytes(data))
    done = train_here(tmp_path / "out", corpus_cache, "--tp", "1", "--steps", "4", "--load", checkpoints)
    assert_refused(done, f"{shard} is corrupt (an item in it fails its CRC-32)",
                   f"complete checkpoints in {checkpoints}: iter_0000002")
    assert rank_starts == []


def test_a_tracker_naming_a_missing_directory(tmp_path, corpus_cache, trained_run):
    checkpoints = copy_of(trained_run, tmp_path)
    shutil.rmtree(checkpoints / "iter_0000004")
    done = train_here(tmp_path / "out", corpus_cache, "--tp", "1", "--steps", "6", "--load", checkpoints)
    assert_refused(done, f"{checkpoints / TRACKER} names iteration 4, but there is no {checkpoints / 'iter_0000004'}",
                   "iter_0000002 (pass one to --load)")


# -- a full disk, an interrupted save, old checkpoints ------------------------------------

def test_a_full_disk_is_said_and_the_tracker_stays_on_the_last_complete_step(tmp_path, corpus_cache):
    # a new interpreter: the fault is injected by a sitecustomize on its PYTHONPATH
    done = train(tmp_path, corpus_cache, "--tp", "1", "--steps", "4", "--save-interval", "2",
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


def test_an_interrupted_save_never_blocks_a_rerun_and_is_named_on_load(tmp_path, corpus_cache, trained_run):
    checkpoints = tmp_path / "run" / "checkpoints"
    _interrupted_first_save(checkpoints, trained_run)
    refused = train_here(tmp_path / "other", corpus_cache, "--tp", "1", "--steps", "4", "--load", checkpoints)
    assert_refused(refused, f"--load {checkpoints} has no complete checkpoint (iter_0000002: a save that did not finish)",
                   "start without --load")
    named = train_here(tmp_path / "other", corpus_cache, "--tp", "1", "--steps", "4", "--load",
                       checkpoints / "iter_0000002")
    assert_refused(named, f"{checkpoints / 'iter_0000002' / '.metadata'} is missing: the save did not finish",
                   f"there is no complete checkpoint in {checkpoints}")
    rerun = train_here(tmp_path / "run", corpus_cache, "--tp", "1", "--steps", "2", "--save-interval", "2")
    assert rerun.returncode == 0, rerun.stderr
    assert (checkpoints / TRACKER).read_text().strip() == "2"
    assert (checkpoints / "iter_0000002" / ".metadata").exists()  # replaced by the new save, not mixed with it


def test_a_run_that_saves_nothing_is_not_refused_and_overwrite_waits_for_a_save(tmp_path, corpus_cache, trained_run):
    checkpoints = copy_of(trained_run, tmp_path)
    before = sorted(os.listdir(checkpoints))
    for extra in ([], ["--overwrite"]):
        done = train_here(tmp_path / "run", corpus_cache, "--tp", "1", "--steps", "1", *extra)
        assert done.returncode == 0, done.stderr
        assert sorted(os.listdir(checkpoints)) == before
    refused = train_here(tmp_path / "run", corpus_cache, "--tp", "1", "--steps", "2", "--save-interval", "2")
    assert_refused(refused, "already holds another run's checkpoints (iter_0000002, iter_0000004)", "--overwrite")


def test_a_stop_signal_does_not_save_among_another_runs_checkpoints(tmp_path, corpus_cache, trained_run):
    checkpoints = copy_of(trained_run, tmp_path)
    before = {name: (checkpoints / name).stat().st_mtime_ns for name in os.listdir(checkpoints)}
    with running("train", *SMALL, "--tp", "1", "--cache-dir", corpus_cache, "--output-dir", tmp_path / "run",
                 "--steps", "100000") as run:
        assert run.wait_for("stdout", r".").startswith("checkpoints: none")  # not refused: it plans no save
        run.wait_for("stdout", r"\] iteration +\d+/ *100000 \|")  # a step in (--log-interval 1)
        os.killpg(run.pid, signal.SIGINT)
        code, out, err = run.finish(timeout=120)
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert re.search(rf"stopped at step \d+ \(SIGINT\): not saved, {re.escape(str(checkpoints))} holds another run's "
                     r"checkpoints \(iter_0000002, iter_0000004; --overwrite replaces them\)", err), err[-3000:]
    assert {name: (checkpoints / name).stat().st_mtime_ns for name in os.listdir(checkpoints)} == before


def test_analyze_reads_the_weights_of_a_distributed_optimizer_checkpoint(tmp_path, corpus_cache, distributed_run):
    """analyze runs on one rank and loads no optimizer state, so a DP2 distributed-optimizer
    checkpoint (whose state cannot follow to DP1 x plain optimizer) analyzes as it is."""
    done = cli_here("analyze", *SMALL[:6], "--load", distributed_run / "checkpoints", "--cache-dir", corpus_cache,
                    "--output-dir", tmp_path / "analysis")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "effective depth" in done.stdout

"""--async-save (issue 44, part 3): checkpoints written by a forked writer while training goes on.

One run with every save in the background, whose writer of iter_0000008 never finishes (the
fault_injection sitecustomize's MEGATRON_SIAMESE_TEST_SLOW_SAVE): training goes on past step 8
while it writes, then a rank is SIGKILLed. The tracker still names the last complete checkpoint
(4, finished in the background), step 8's is incomplete, and the same command resumes from 4 and
ends with exactly the losses of a run that saved synchronously and was never interrupted (CPU
is deterministic: bitwise): what the background writer wrote is the state at its step, not a
later one. Megatron core's async save differs between 0.16 and 0.19, so the file runs on each stack."""

import os
import re
import signal
import sys
from pathlib import Path

from cli_runs import cli_here, train_losses
from conftest import SMALL_RUN
from job_runs import jobs  # noqa: F401  (the fixture)
from test_lost_rank import own_launcher_ranks

CLI = [sys.executable, "-m", "megatron_siamese.cli"]
FAULTS = str(Path(__file__).parent / "fault_injection")  # sitecustomize: a writer that never finishes
STEPS, SAVE_INTERVAL, STUCK_SAVE = 16, 4, 8
STEP_LINE = r"^ \[.*\] iteration +{step}/"


def train_args(output, cache, *more):
    checkpoints = output / "checkpoints"
    return [str(a) for a in ["train", *SMALL_RUN, "--tp", "1", "--dp", "2", "--steps", STEPS, "--save-interval",
                             SAVE_INTERVAL, "--cache-dir", cache, "--output-dir", output, "--save", checkpoints,
                             "--load", checkpoints, *more]]


def test_a_kill_during_an_async_save_leaves_the_last_complete_one_and_resumes_exactly(tmp_path, corpus_cache, jobs):
    synchronous = tmp_path / "synchronous"
    done = cli_here(*train_args(synchronous, corpus_cache))
    assert done.returncode == 0, done.stderr[-3000:]
    expected = train_losses(synchronous)

    output = tmp_path / "async"
    checkpoints = output / "checkpoints"
    command = [*CLI, *train_args(output, corpus_cache, "--async-save")]
    job = jobs.start(command, env={"PYTHONPATH": os.pathsep.join([FAULTS, os.environ.get("PYTHONPATH", "")]),
                                   "MEGATRON_SIAMESE_TEST_SLOW_SAVE": f"iter_{STUCK_SAVE:07d}"})
    job.wait_for(rf"^saved {re.escape(str(checkpoints))}/iter_0000004$")  # completed while training went on
    job.wait_for(rf"^saving {re.escape(str(checkpoints))}/iter_0000008 in the background$")
    job.wait_for(STEP_LINE.format(step=STUCK_SAVE + 2))  # two steps trained while iter_0000008 is written
    assert not any("iter_0000008" in line for line in job.lines() if line.startswith("saved")), job.said()[-3000:]
    ranks = own_launcher_ranks(job)
    assert len(ranks) == 2, ranks
    ranks[-1].send_signal(signal.SIGKILL)
    out, err = job.finish(timeout=120)
    assert job.returncode == 1, err[-3000:]
    assert re.search(rf"^megatron-siamese train: error: rank 1 was killed by SIGKILL before reporting; the newest "
                     rf"complete checkpoint is step 4 in {re.escape(str(checkpoints))}: the same command resumes "
                     rf"from it$", err, re.MULTILINE), err[-3000:]
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert not (checkpoints / "iter_0000008" / ".metadata").exists()  # torch_dist's metadata: written at completion

    again = jobs.run(command, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {checkpoints} at step 4" in again.stdout
    assert [f"saved {checkpoints}/iter_{step:07d}" for step in (8, 12, 16)] == [
        line.strip() for line in again.stdout.splitlines() if line.startswith("saved ")]
    assert train_losses(output) == expected

"""A rank that hangs inside a step (issue 44): it sleeps in a collective (the fault_injection
sitecustomize's MEGATRON_SIAMESE_TEST_HANG), and the others wait for it there.

The job must exit within --distributed-timeout-minutes (plus the grace in which the waiting ranks
name one another: ``hangs.grace_s``), naming the hung rank and the collective they waited in, with
no rank left running and no checkpoint but those every rank agreed on. The own launcher asks the
hung rank for its stack; under torchrun it prints its own when the timeout passes. Both run
Megatron on ranks and time out in gloo, so the file runs on each stack (torch 2.13 and 2.14)."""

import os
import re
import sys
import time
from pathlib import Path

from conftest import SMALL_RUN
from job_runs import jobs  # noqa: F401  (the fixture)

from megatron_siamese.runtime.hangs import grace_s
from megatron_siamese.runtime.launch import free_port

CLI = [sys.executable, "-m", "megatron_siamese.cli"]
FAULTS = str(Path(__file__).parent / "fault_injection")  # sitecustomize: the planted hang
TIMEOUT_MINUTES = 0.2
STARTUP_S = 90  # the launcher's and the ranks' imports, the model, the steps before the hang (2 cores)
WAITING = r"waiting in `[^`]+` at \S+:\d+ \(\w+\)"  # the waiting line, its file, line and function


def planted_hang(rank: int, call: int) -> dict:
    """That rank sleeps in its ``call``-th torch.distributed.all_reduce (fault_injection/sitecustomize.py)."""
    return {"PYTHONPATH": os.pathsep.join([FAULTS, os.environ.get("PYTHONPATH", "")]),
            "MEGATRON_SIAMESE_TEST_HANG": f"{rank}:{call}"}


def test_a_hung_rank_is_named_with_the_collective_and_only_agreed_checkpoints_remain(tmp_path, corpus_cache, jobs):
    checkpoints = tmp_path / "checkpoints"
    started = time.monotonic()
    done = jobs.run([*CLI, "train", *SMALL_RUN, "--tp", "1", "--dp", "2", "--steps", "30", "--save-interval", "2",
                     "--cache-dir", corpus_cache, "--output-dir", tmp_path, "--save", checkpoints, "--load", checkpoints,
                     "--distributed-timeout-minutes", TIMEOUT_MINUTES, "--debug"],
                    env=planted_hang(rank=1, call=40), timeout=600)
    seconds = time.monotonic() - started
    assert done.returncode == 1, done.stderr[-3000:]
    said = re.search(rf"^megatron-siamese train: error: rank 0 of 2 failed: CollectiveTimeout: rank 0 timed out after "
                     rf"12 s \(--distributed-timeout-minutes 0.2\) in step (\d+), {WAITING}; rank 1 of 2 never reached "
                     rf"it nor timed out within 3 s: hung \(run with --debug for its Python stack\); the newest complete "
                     rf"checkpoint is step (\d+) in {re.escape(str(checkpoints))}: the same command resumes from it$",
                     done.stderr, re.MULTILINE)
    assert said, done.stderr[-3000:]
    hung_in, newest = int(said[1]), int(said[2])
    assert newest == (hung_in - 1) // 2 * 2 and newest >= 2, said[0]
    # nothing of the step the ranks never agreed on: the saves before it only
    assert sorted(os.listdir(checkpoints)) == [f"iter_{step:07d}" for step in range(2, newest + 1, 2)] + [
        "latest_checkpointed_iteration.txt"]
    # the hung rank's own stack, asked for by the launcher: it sleeps in the planted all_reduce, inside a step
    stack = done.stderr[done.stderr.index("-- rank 1: no report"):]
    assert re.search(r"in _all_reduce_that_hangs\n(.*\n)*.* in train_step\n", stack), stack[:3000]
    assert seconds < STARTUP_S + 60 * TIMEOUT_MINUTES + grace_s(60 * TIMEOUT_MINUTES) + 30, seconds


def test_the_check_under_torchrun_names_the_layout_and_the_hung_rank_prints_its_stack(tmp_path, jobs):
    endpoint = f"localhost:{free_port()}"
    done = jobs.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                     "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", endpoint,
                     "--log-dir", tmp_path, "--redirects", "3",  # each rank's output in a file of its own
                     *CLI[1:], "check", "--layouts", "dp2", "--distributed-timeout-minutes", TIMEOUT_MINUTES],
                    env=planted_hang(rank=1, call=3), timeout=600)
    assert done.returncode not in (0, None), done.stderr[-3000:]
    said = {rank: "".join(path.read_text() for path in sorted(tmp_path.glob(f"**/attempt_0/{rank}/std*.log")))
            for rank in (0, 1)}
    assert re.search(rf"^megatron-siamese check: error: CollectiveTimeout: rank 0 timed out after 12 s "
                     rf"\(--distributed-timeout-minutes 0.2\) in layout dp2, {WAITING}; rank 1 of 2 never reached it "
                     rf"nor timed out within 3 s: hung \(its Python stack follows faulthandler's 'Timeout' line in its "
                     rf"output\)$", said[0], re.MULTILINE), said[0][-3000:]
    # the hung rank's own dump when the timeout passed: it sleeps in the planted all_reduce, inside the layout
    assert re.search(r"Timeout \(0:00:12\)!\nThread 0x\w+ \(most recent call first\):\n.* in _all_reduce_that_hangs\n"
                     r"(.*\n)*?.* in layout_step\n", said[1]), said[1][-5000:]

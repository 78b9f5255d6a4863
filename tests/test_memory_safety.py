"""Memory safety in the ranks (issue 49, docs/testing.md "Memory safety in the ranks").

A Megatron-FSDP step leaves no collective running on gloo's worker thread when it returns (the
heap corruption CI saw twice needed one running beside the rank's own work); the count sees a
collective left running (fault_injection's MEGATRON_SIAMESE_TEST_UNWAITED / _LEAVE_ONE).

scripts/sanitize.sh: AddressSanitizer in every rank of a check, with the extension's own kernels
built with it. A rank that writes into memory it freed fails the sanitized run, naming the error
(fault_injection's MEGATRON_SIAMESE_TEST_USE_AFTER_FREE); the fully sharded layouts (torch FSDP2
and every Megatron-FSDP one) run clean under it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAULTS = str(Path(__file__).parent / "fault_injection")  # sitecustomize: the planted use after free
STACK = os.environ.get("MEGATRON_SIAMESE_TEST_STACK") or ("mcore016" if sys.version_info < (3, 12) else "mcore019")
CHECK = [sys.executable, "-m", "megatron_siamese.cli", "check"]


def sanitized(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "sanitize.sh"), "--stack", STACK, "--", *CHECK, *args],
                          cwd=ROOT, env=env or dict(os.environ), capture_output=True, text=True, timeout=900)


def faults(**variables: str) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([FAULTS, os.environ.get("PYTHONPATH", "")]), **variables}


def unwaited_collectives(tmp_path, layouts: str, leave_one: bool = False) -> list:
    """Each rank's (count of asynchronous collectives left running when its step returned, count issued),
    over ``check --layouts`` (with one planted where ``leave_one``)."""
    log = tmp_path / f"unwaited-{leave_one}"
    env = faults(MEGATRON_SIAMESE_TEST_UNWAITED=str(log), **({"MEGATRON_SIAMESE_TEST_LEAVE_ONE": "1"} if leave_one
                                                            else {}))
    done = subprocess.run([*CHECK, "--layouts", layouts], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return [(int(line.split()[1]), int(line.split()[2])) for line in log.read_text().splitlines()]


def test_a_megatron_fsdp_step_leaves_no_collective_running(tmp_path):
    counts = unwaited_collectives(tmp_path, "dp2-mfsdp3,tp2-dp2-sp-mfsdp3,dp2-mfsdp2")
    assert len(counts) == 1 + 2 + 4 + 2 and {unwaited for unwaited, _ in counts} == {0}, counts  # the reference's too
    assert sum(issued for _, issued in counts) > 0, counts  # it saw the FSDP steps' asynchronous collectives


@pytest.mark.once("the count and the planted collective are ours; the step it counts in runs on every stack above")
def test_the_count_sees_a_collective_left_running(tmp_path):
    counts = unwaited_collectives(tmp_path, "dp2-mfsdp3", leave_one=True)
    assert len(counts) == 1 + 2 and {unwaited for unwaited, _ in counts} == {1}, counts


SANITIZER_HARNESS = pytest.mark.once(
    "the sanitizer harness and our kernels are the subject; the Megatron-FSDP step's own check (no collective "
    "left running, above) and the fully sharded layouts run on every stack")


@SANITIZER_HARNESS
def test_a_rank_writing_into_freed_memory_fails_the_sanitized_check():
    done = sanitized("--layouts", "dp2", env=faults(MEGATRON_SIAMESE_TEST_USE_AFTER_FREE="1"))
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert "sanitize: asan reported a memory error (round 1 of 1" in done.stderr, done.stderr[-3000:]
    assert "ERROR: AddressSanitizer: heap-use-after-free" in done.stderr and "WRITE of size" in done.stderr


@SANITIZER_HARNESS
def test_the_fully_sharded_layouts_run_clean_under_the_sanitizer():
    layouts = ["dp2-fsdp2", "tp2-dp2-sp-fsdp2", "dp2-mfsdp3", "tp2-dp2-sp-mfsdp3", "dp2-mfsdp2"]
    done = sanitized("--layouts", ",".join(layouts))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert f"sanitize: asan reported no memory error in 1 round(s) ({STACK})" in done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] and line.split()[0] in layouts]
    assert [(row[0], row[-1]) for row in rows] == [(name, "PASS") for name in layouts], done.stdout

"""A rank lost in the middle of a step, as at scale (issue 44): a SIGKILLed rank, then the
recovery Megatron-LM users rely on, with ``--save X --load X`` on every attempt.

* torchrun ``--max-restarts 1`` restarts the workers; they resume from X's newest complete
  checkpoint by themselves (each restart attempt forms its process groups under a store prefix
  of its own: ``job.restart_count``);
* the package's own launcher exits naming the dead rank and its signal, and where the run goes
  on from; the same command resumes;
* a SLURM step (``srun``, ``--requeue``): the other task stops, and the same tasks, started
  again, resume.

Each recovery ends with exactly the losses of an uninterrupted run (CPU is deterministic:
bitwise). The steps redone are those since the last save: killed after step 12 with saves every
5 steps, steps 11 and 12 are trained twice. Every run here trains Megatron on two ranks and
restarts from Megatron's checkpoints, so the file runs on each stack (torch 2.13 and 2.14 restart
differently: docs/training.md, "When a rank is lost")."""

import re
import signal
import sys

import psutil
import pytest
from cli_runs import cli_here, train_losses
from job_runs import jobs  # noqa: F401  (the fixture)

from megatron_siamese.runtime.launch import free_port

CLI = [sys.executable, "-m", "megatron_siamese.cli"]
STEPS, SAVE_INTERVAL, KILLED_AFTER = 16, 5, 12
RESUMED_AT = KILLED_AFTER // SAVE_INTERVAL * SAVE_INTERVAL
SMALL = ["--num-layers", "2", "--hidden-size", "32", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--eval-iters", "1", "--eval-interval", "100000", "--steps", STEPS,
         "--save-interval", SAVE_INTERVAL, "--no-progress", "--log-interval", "1"]
STEP_LINE = r"^ \[.*\] iteration +{step}/"


def train_args(output, cache):
    checkpoints = output / "checkpoints"
    return [str(a) for a in ["train", *SMALL, "--cache-dir", cache, "--output-dir", output, "--save", checkpoints,
                             "--load", checkpoints]]


def losses(output):
    found = train_losses(output)
    return [found.get(step) for step in range(1, STEPS + 1)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus_cache):
    output = tmp_path_factory.mktemp("uninterrupted")
    done = cli_here(*train_args(output, corpus_cache))
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(output)


def kill_a_rank_after_step(job, ranks_of, step=KILLED_AFTER):
    """SIGKILL the job's last rank once rank 0 has logged ``step``: inside the next step."""
    job.wait_for(STEP_LINE.format(step=step))
    ranks = ranks_of(job)
    assert len(ranks) == 2, ranks
    ranks[-1].send_signal(signal.SIGKILL)


def test_torchrun_restarts_a_killed_rank_and_the_run_ends_as_an_uninterrupted_one(tmp_path, corpus_cache, jobs,
                                                                                     uninterrupted):
    endpoint = f"localhost:{free_port()}"
    agent = jobs.start([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                        "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                        "--rdzv-id", endpoint, "-m", "megatron_siamese.cli", *train_args(tmp_path, corpus_cache)],
                       merge_output=True)
    kill_a_rank_after_step(agent, lambda job: psutil.Process(job.pid).children())  # torchrun's workers
    out, _ = agent.finish(timeout=300)
    assert agent.returncode == 0, out[-4000:]
    assert f"resumed from {tmp_path / 'checkpoints'} at step {RESUMED_AT}" in out, out[-4000:]
    assert losses(tmp_path) == uninterrupted


def own_launcher_ranks(job):
    servers = [c for c in psutil.Process(job.pid).children() if "forkserver" in " ".join(c.cmdline())]
    return sorted((rank for server in servers for rank in server.children()), key=lambda p: p.create_time())


def test_the_own_launcher_names_the_killed_rank_and_the_same_command_resumes(tmp_path, corpus_cache, jobs,
                                                                            uninterrupted):
    command = [*CLI, *train_args(tmp_path, corpus_cache)]
    job = jobs.start(command)
    kill_a_rank_after_step(job, own_launcher_ranks)
    out, err = job.finish(timeout=120)
    assert job.returncode == 1, err[-3000:]
    checkpoints = tmp_path / "checkpoints"
    assert re.search(rf"^megatron-siamese train: error: rank 1 was killed by SIGKILL before reporting; the newest "
                     rf"complete checkpoint is step {RESUMED_AT} in {re.escape(str(checkpoints))}: the same command "
                     rf"resumes from it$", err, re.MULTILINE), err[-3000:]
    again = jobs.run(command, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {checkpoints} at step {RESUMED_AT}" in again.stdout
    assert losses(tmp_path) == uninterrupted


def test_a_requeued_slurm_step_resumes(tmp_path, corpus_cache, jobs, uninterrupted):
    port = free_port()  # the requeued step's too: SLURM keeps the job id, so MASTER_PORT stays

    def step():
        base = dict(SLURM_NTASKS="2", SLURM_NNODES="1", SLURM_NODEID="0", SLURM_NODELIST="localhost",
                    SLURM_STEP_ID="0", SLURM_JOB_ID="1", MASTER_PORT=str(port))
        return [jobs.start([*CLI, *train_args(tmp_path, corpus_cache)], merge_output=True,
                           env={**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}) for rank in range(2)]

    tasks = step()
    tasks[0].wait_for(STEP_LINE.format(step=KILLED_AFTER))
    tasks[1].kill()  # a task lost: slurmstepd ends the step; its other task must not hang
    said, _ = tasks[0].finish(timeout=120)
    assert tasks[0].returncode not in (0, None), said[-3000:]
    tasks = step()  # the requeue: the same command lines
    said = [task.finish(timeout=300)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], said
    assert f"resumed from {tmp_path / 'checkpoints'} at step {RESUMED_AT}" in said[0], said[0][-3000:]
    assert losses(tmp_path) == uninterrupted

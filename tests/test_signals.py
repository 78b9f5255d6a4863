"""Stopping a run as schedulers and users do (subprocesses of the CLI, real signals): SIGTERM,
SIGINT, SIGUSR1/SIGUSR2 to the launcher, to one rank or to every process of the job; a second
signal; SIGKILL of the launcher's process group; --exit-interval and --exit-duration-in-mins;
and the lock on an output directory a live job writes.

Every test here runs on each stack: the runs train Megatron on their ranks, and a signal's stop
saves and resumes Megatron's checkpoints. The tests act on events (a line the run prints, a
checkpoint appearing), not after sleeps, and every process a test starts is ended with it
(tests/job_runs.py: ``jobs``). What the command line decides without a signal or a process of
its own to watch (a resume, the exit flags) runs in this process (``cli_here``)."""

import os
import re
import signal
import sys
import time

import psutil
import pytest
from cli_runs import cli_here
from job_runs import descendants, jobs, running  # noqa: F401  (jobs: the fixture)

from megatron_siamese.runtime.job_lock import LOCK_FILE
from megatron_siamese.runtime.launch import free_port

CLI = [sys.executable, "-m", "megatron_siamese.cli"]
SMALL = ["--num-layers", "2", "--hidden-size", "32", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--eval-iters", "1", "--eval-interval", "100000", "--steps", "100000",
         "--no-progress", "--log-interval", "1"]  # the status lines (resume, saves) and a line per step: events
STOPPED = re.compile(r"^stopped at step (\d+) \((.+?)\): checkpoint saved to (\S+) \(resume with --load (\S+)\)$")
A_FEW_STEPS_IN = r"^ \[.*\] iteration +2/"  # rank 0's line for step 2: past the first step's setup, training


def train_args(output, cache, *args):
    return ["train", *SMALL, "--cache-dir", cache, "--output-dir", output, *map(str, args)]


def start(jobs, output, cache, *args, env=None):
    """A long run, returned once its ranks train (rank 0's line for step 2)."""
    job = jobs.start([*CLI, *train_args(output, cache, *args)], env=env)
    job.wait_for(A_FEW_STEPS_IN)
    return job


def ranks_of(job):
    """The rank processes of a running command (children of its fork server), in rank order: the
    ranks other than 0 write to their logs (quiet ranks, ``rank<N>.log``), rank 0 to the command's
    output."""
    servers = [c for c in psutil.Process(job.pid).children() if "forkserver" in " ".join(c.cmdline())]
    ranks = [rank for server in servers for rank in server.children()]

    def rank_number(process):
        found = re.search(r"rank(\d+)\.log$", os.readlink(f"/proc/{process.pid}/fd/1"))
        return int(found.group(1)) if found else 0

    return sorted(ranks, key=rank_number)


def send(processes, signum):
    for process in processes:
        try:
            process.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


def stopped_line(err: str):
    """The one line a stopped run prints: (step, reason, checkpoint, directory to --load)."""
    found = [STOPPED.match(line) for line in err.splitlines() if line.startswith("stopped at step")]
    assert len(found) == 1 and found[0], err[-3000:]
    step, reason, saved, load = found[0].groups()
    return int(step), reason, saved, load


def tracked(checkpoints) -> int:
    """The iteration Megatron-LM's tracker file names as the newest complete checkpoint."""
    return int((checkpoints / "latest_checkpointed_iteration.txt").read_text())


def assert_complete_latest(checkpoints, step):
    assert tracked(checkpoints) == step
    saved = checkpoints / f"iter_{step:07d}"
    assert (saved / ".metadata").exists() and (saved / "metadata.json").exists()
    assert len(list(saved.glob("*.distcp"))) >= 2  # both ranks' shards: both saved at the agreed step
    assert sorted(p.name for p in checkpoints.glob("iter_*")) == [f"iter_{step:07d}"]


def resumes(output, cache, checkpoints, step):
    """The stopped run's checkpoint resumes (in this process: the checkpoint is what it proves)."""
    resumed = cli_here(*train_args(output, cache, "--load", checkpoints, "--stop-step", step + 1))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoints} at step {step}" in resumed.stdout, resumed.stdout
    assert "Traceback" not in resumed.stdout + resumed.stderr
    assert tracked(checkpoints) == step + 1


# -- a stop signal: every rank stops after the same step and saves -------------------------

# SIGTERM and SIGINT to the launcher alone: tests/test_cli.py
@pytest.mark.parametrize("signum,target", [(signal.SIGUSR2, "launcher"), (signal.SIGTERM, "one rank"),
                                            (signal.SIGTERM, "all"), (signal.SIGUSR1, "all")],
                         ids=lambda v: getattr(v, "name", v))
def test_a_stop_signal_to_any_or_all_processes_saves_one_agreed_step_and_exits_0(tmp_path, corpus_cache, jobs,
                                                                                 signum, target):
    job = start(jobs, tmp_path, corpus_cache)
    if target == "launcher":
        job.send_signal(signum)
    elif target == "one rank":
        ranks = ranks_of(job)
        assert len(ranks) == 2
        ranks[1].send_signal(signum)  # not rank 0: the one that speaks for the job must hear it from the others
    else:
        send(descendants(job.pid), signum)  # SLURM at a time limit: every process of the step
    out, err = job.finish(timeout=180)
    assert job.returncode == 0, err[-3000:]
    assert "Traceback" not in out + err
    step, reason, saved, load = stopped_line(err)
    assert reason == signum.name
    checkpoints = tmp_path / "checkpoints"
    assert saved == str(checkpoints / f"iter_{step:07d}") and load == str(checkpoints)
    assert_complete_latest(checkpoints, step)
    assert all(line.startswith(("stopped at step", f"{signum.name}: finishing this step")) for line in
               err.strip().splitlines()), err
    if (signum, target) == (signal.SIGTERM, "all"):  # what a scheduler's time limit leaves resumes
        resumes(tmp_path, corpus_cache, checkpoints, step)


# Planted in the run's processes: a checkpoint save that never finishes (each shard's fsync
# waits an hour), so the second signal surely lands inside the save, and only a stop at once
# can end the run.
SAVE_THAT_HANGS = """import os, time
_fsync = os.fsync
def fsync(fd):
    if os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp"):
        time.sleep(3600)
    return _fsync(fd)
os.fsync = fsync
"""


def test_a_second_signal_stops_at_once_and_leaves_nothing_in_the_next_runs_way(tmp_path, corpus_cache, jobs):
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "sitecustomize.py").write_text(SAVE_THAT_HANGS)
    python_path = os.pathsep.join(filter(None, [str(planted), os.environ.get("PYTHONPATH")]))
    output = tmp_path / "run"
    job = start(jobs, output, corpus_cache, env={"PYTHONPATH": python_path})
    checkpoints = output / "checkpoints"
    send(descendants(job.pid), signal.SIGTERM)
    job.wait_for(r"^SIGTERM: finishing this step", stream="stderr")  # the launcher took the first one
    deadline = time.monotonic() + 120
    while not list(checkpoints.glob("iter_*/*.distcp")):  # until the save writes its shards (and hangs)
        assert job.returncode is None and time.monotonic() < deadline, job.said()[-3000:]
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)  # the user's second one
    # the save never finishes: that the run ends at all shows the second signal stopped it at once
    # (60 s: generous for a loaded machine; a stop after the save would never come)
    out, err = job.finish(timeout=60)
    assert job.returncode == 130, err[-3000:]
    assert "Traceback" not in out + err
    assert err.strip().splitlines()[-1] == "megatron-siamese train: interrupted"
    left = list(checkpoints.glob("iter_*"))
    for step_dir in left:  # nothing half-written: what remains is complete and named by the tracker
        assert (step_dir / ".metadata").exists() and f"iter_{tracked(checkpoints):07d}" == step_dir.name
    assert not left  # the only save was the one stopped halfway: it is gone
    again = cli_here(*train_args(output, corpus_cache, "--stop-step", "2"))
    assert again.returncode == 0, again.stderr[-3000:]


# -- no orphans ----------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["the launcher", "its process group"])
def test_ranks_die_with_a_launcher_killed_by_sigkill(tmp_path, corpus_cache, jobs, how):
    job = start(jobs, tmp_path, corpus_cache, "--save-interval", "2")
    job.wait_for(r"^saved ")  # the ranks have saved: each started its checkpoint writer's helper
    ranks = ranks_of(job)
    assert len(ranks) == 2
    started = descendants(job.pid)[1:]  # the fork server, the resource tracker, the ranks and their helpers
    assert len(started) > 4, [p.cmdline()[-1][:80] for p in started]
    if how == "the launcher":
        job.kill()
    else:
        os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=30)
    _, alive = psutil.wait_procs(started, timeout=10)
    alive = running(alive)
    assert not alive, ("still running 10 s after the launcher was killed: "
                       f"{[(p.pid, ' '.join(p.cmdline())[-80:]) for p in alive]}")


# -- Megatron-LM's exit flags --------------------------------------------------------------

def test_exit_interval_stops_after_a_step_divisible_by_it_and_saves(tmp_path, corpus_cache):
    checkpoints = tmp_path / "saved"  # --save's directory, which the stop's line names for --load
    done = cli_here(*train_args(tmp_path, corpus_cache, "--exit-interval", "3", "--save", checkpoints))
    assert done.returncode == 0 and "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    step, reason, _, load = stopped_line(done.stderr)
    assert (step, reason, load) == (3, "--exit-interval 3", str(checkpoints))
    assert_complete_latest(checkpoints, 3)
    # resumed from 3, a step divisible by 3 is 6 (Megatron-LM's: the iteration number, not the steps run)
    done = cli_here(*train_args(tmp_path, corpus_cache, "--exit-interval", "3", "--save", checkpoints,
                                "--load", load))
    assert done.returncode == 0, done.stderr[-3000:]
    assert stopped_line(done.stderr)[:2] == (6, "--exit-interval 3")
    assert tracked(checkpoints) == 6


def test_exit_duration_stops_every_rank_after_the_same_step_and_saves(tmp_path, corpus_cache):
    done = cli_here(*train_args(tmp_path, corpus_cache, "--exit-duration-in-mins", "0.1"))
    assert done.returncode == 0 and "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    step, reason, _, _ = stopped_line(done.stderr)
    assert reason == "--exit-duration-in-mins 0.1" and step >= 1
    assert_complete_latest(tmp_path / "checkpoints", step)


# -- the lock on a live job's output directory ---------------------------------------------

def test_a_second_job_into_a_live_jobs_output_dir_is_refused_and_a_dead_ones_lock_blocks_nothing(
        tmp_path, corpus_cache, jobs):
    first = start(jobs, tmp_path, corpus_cache, "--save-interval", "2")
    first.wait_for(r"^saved ")  # a checkpoint: a resume into the directory is refused as well
    processes = descendants(first.pid)
    send(processes, signal.SIGSTOP)  # still a live job holding its lock, but no longer busy on the CPUs
    for extra in ([], ["--load", tmp_path / "checkpoints"]):
        # in this process: another process than the first job's, refused at its lock (a job of
        # its own would spend its time importing Megatron and starting a fork server first)
        second = cli_here(*train_args(tmp_path, corpus_cache, *extra))
        assert second.returncode == 2, second.stderr[-3000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in second.stderr, lines
        assert f"--output-dir {tmp_path} is in use by a running job (pid {first.pid} on " in lines[0], lines
        assert f"kill -TERM {first.pid}" in lines[0]
    assert first.returncode is None  # the first job runs on, untouched:
    send(processes, signal.SIGCONT)
    first.wait_for(rf"^saved .*iter_0*{tracked(tmp_path / 'checkpoints') + 2}$")  # it trains and saves on
    os.killpg(first.pid, signal.SIGKILL)  # the launcher's group: its ranks follow it (orphans.py)
    first.wait(timeout=30)
    _, alive = psutil.wait_procs(processes, timeout=30)
    assert not running(alive)
    assert (tmp_path / LOCK_FILE).exists()  # left behind by the killed job
    after = cli_here(*train_args(tmp_path, corpus_cache, "--steps", "2", "--overwrite"))
    assert after.returncode == 0, after.stderr[-3000:]


# -- a launched job (torchrun) -------------------------------------------------------------

def torchrun(jobs, output, cache):
    """A torchrun agent of two ranks running a long job, once its ranks train."""
    endpoint = f"localhost:{free_port()}"
    agent = jobs.start([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", endpoint,
                        "-m", "megatron_siamese.cli", *train_args(output, cache)], merge_output=True)
    agent.wait_for(A_FEW_STEPS_IN)
    return agent


def test_sigterm_to_every_process_of_a_torchrun_job_saves_one_agreed_step(tmp_path, corpus_cache, jobs):
    agent = torchrun(jobs, tmp_path, corpus_cache)
    processes = descendants(agent.pid)
    assert len(processes) >= 3  # the agent and its two ranks
    send(processes, signal.SIGTERM)  # the ranks get it twice: torchrun forwards its own
    out, _ = agent.finish(timeout=180)
    checkpoints = tmp_path / "checkpoints"
    step, reason, _, _ = stopped_line(out)
    assert reason == "SIGTERM"
    assert_complete_latest(checkpoints, step)
    assert "megatron_siamese/" not in out  # no traceback of ours (torchrun reports its own SIGTERM)
    assert not running(processes[1:])
    resumes(tmp_path, corpus_cache, checkpoints, step)


def test_ranks_of_a_torchrun_agent_killed_by_sigkill_save_and_exit(tmp_path, corpus_cache, jobs):
    agent = torchrun(jobs, tmp_path, corpus_cache)
    ranks = descendants(agent.pid)[1:]
    agent.kill()  # the ranks' parent-death signal: SIGTERM
    out, _ = agent.finish(timeout=180)  # the ranks hold the pipe until they exit
    assert not running(ranks)
    step, reason, _, _ = stopped_line(out)
    assert reason == "SIGTERM" and "Traceback" not in out
    assert_complete_latest(tmp_path / "checkpoints", step)


def test_sigterm_to_every_task_of_a_slurm_step_saves_one_agreed_step_and_each_exits_0(tmp_path, corpus_cache,
                                                                                     jobs):
    base = dict(SLURM_NTASKS="2", SLURM_NNODES="1", SLURM_NODEID="0", SLURM_NODELIST="localhost",
                SLURM_STEP_ID="0", SLURM_JOB_ID="1", MASTER_PORT=str(free_port()))
    tasks = [jobs.start([*CLI, *train_args(tmp_path, corpus_cache, "--tp", "2")], merge_output=True,
                        env={**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}) for rank in range(2)]
    tasks[0].wait_for(A_FEW_STEPS_IN)
    for task in tasks:  # what slurmstepd does at the time limit
        task.send_signal(signal.SIGTERM)
    said = [task.finish(timeout=180)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], said
    assert "Traceback" not in "".join(said)
    step, reason, _, _ = stopped_line(said[0])
    assert reason == "SIGTERM" and "stopped at step" not in said[1]  # rank 0 speaks for the job
    assert_complete_latest(tmp_path / "checkpoints", step)

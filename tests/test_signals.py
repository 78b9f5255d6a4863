"""Stopping a run as schedulers and users do (subprocesses of the CLI, real signals): SIGTERM,
SIGINT, SIGUSR1/SIGUSR2 to the launcher, to one rank or to every process of the job; a second
signal; SIGKILL of the launcher's process group; --exit-interval and --exit-duration-in-mins;
and the lock on an output directory a live job writes."""

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatron_siamese.runtime.job_lock import LOCK_FILE
from megatron_siamese.runtime.launch import free_port

pytestmark = pytest.mark.stack_independent  # the launcher and the loop around Megatron: one stack is enough

CLI = [sys.executable, "-m", "megatron_siamese.cli"]
SMALL = ["--num-layers", "2", "--hidden-size", "32", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--eval-iters", "1", "--eval-interval", "100000", "--steps", "100000",
         "--no-progress", "--log-interval", "100000"]  # status lines (resume, saves) without a line per step
STOPPED = re.compile(r"^stopped at step (\d+) \((.+?)\): checkpoint saved to (\S+) \(resume with --load (\S+)\)$")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def command(output, cache, *args):
    return [*CLI, "train", *SMALL, "--cache-dir", cache, "--output-dir", str(output), *map(str, args)]


def start(output, cache, *args, up="checkpoints: "):
    """A long run, returned once its ranks train (their first status line) and a few steps in."""
    process = subprocess.Popen(command(output, cache, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    line = process.stdout.readline()
    assert line.startswith(up), (line, process.stderr.read() if process.poll() is not None else "")
    time.sleep(2.0)
    return process


def ranks_of(process: subprocess.Popen):
    """The rank processes of a running command (children of its fork server)."""
    servers = [c for c in psutil.Process(process.pid).children() if "forkserver" in " ".join(c.cmdline())]
    return [rank for server in servers for rank in server.children()]


def job_processes(pid: int):
    """A process and all its descendants: what a scheduler signals at a time limit."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def running(processes):
    """Those still running (a zombie has exited: its parent has not reaped it yet)."""
    alive = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


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
    resumed = subprocess.run(command(output, cache, "--load", checkpoints, "--stop-step", step + 1),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoints} at step {step}" in resumed.stdout, resumed.stdout
    assert "Traceback" not in resumed.stdout + resumed.stderr
    assert tracked(checkpoints) == step + 1


# -- a stop signal: every rank stops after the same step and saves -------------------------

# SIGTERM and SIGINT to the launcher alone: tests/test_cli.py
@pytest.mark.parametrize("signum,target", [(signal.SIGUSR2, "launcher"), (signal.SIGTERM, "one rank"),
                                            (signal.SIGTERM, "all"), (signal.SIGUSR1, "all")],
                         ids=lambda v: getattr(v, "name", v))
def test_a_stop_signal_to_any_or_all_processes_saves_one_agreed_step_and_exits_0(tmp_path, cache, signum, target):
    process = start(tmp_path, cache)
    if target == "launcher":
        os.kill(process.pid, signum)
    elif target == "one rank":
        ranks = ranks_of(process)
        assert len(ranks) == 2
        ranks[-1].send_signal(signum)  # not rank 0: the one that speaks for the job must hear it from the others
    else:
        send(job_processes(process.pid), signum)  # SLURM at a time limit: every process of the step
    out, err = process.communicate(timeout=180)
    assert process.returncode == 0, err[-3000:]
    assert "Traceback" not in out + err
    step, reason, saved, load = stopped_line(err)
    assert reason == signum.name
    checkpoints = tmp_path / "checkpoints"
    assert saved == str(checkpoints / f"iter_{step:07d}") and load == str(checkpoints)
    assert_complete_latest(checkpoints, step)
    assert all(line.startswith(("stopped at step", f"{signum.name}: finishing this step")) for line in
               err.strip().splitlines()), err
    if (signum, target) == (signal.SIGTERM, "all"):  # what a scheduler's time limit leaves resumes
        resumes(tmp_path, cache, checkpoints, step)


def test_a_second_signal_stops_at_once_and_leaves_nothing_in_the_next_runs_way(tmp_path, cache):
    # a model whose save takes a while, so that the second signal lands inside it
    process = start(tmp_path, cache, "--num-layers", "4", "--hidden-size", "512")
    checkpoints = tmp_path / "checkpoints"
    send(job_processes(process.pid), signal.SIGTERM)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(checkpoints.glob("iter_*")) and process.poll() is None:
        time.sleep(0.002)  # until the save has begun
    began = time.monotonic()
    process.send_signal(signal.SIGTERM)  # the user's second one
    out, err = process.communicate(timeout=60)
    assert time.monotonic() - began < 30
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in out + err
    assert err.strip().splitlines()[-1] == "megatron-siamese train: interrupted"
    left = list(checkpoints.glob("iter_*"))
    for step_dir in left:  # nothing half-written: what remains is complete and named by the tracker
        assert (step_dir / ".metadata").exists() and f"iter_{tracked(checkpoints):07d}" == step_dir.name
    again = subprocess.run(command(tmp_path, cache, "--stop-step", "2", *(["--load", checkpoints] if left else [])),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]


# -- no orphans ----------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["the launcher", "its process group"])
def test_ranks_die_with_a_launcher_killed_by_sigkill(tmp_path, cache, how):
    process = start(tmp_path, cache, "--save-interval", "5")
    ranks = ranks_of(process)
    assert len(ranks) == 2
    if how == "the launcher":
        process.kill()
    else:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and running(ranks):
        time.sleep(0.2)
    alive = running(ranks)
    for rank in alive:
        rank.kill()
    assert not alive, f"ranks still running 10 s after the launcher was killed: {[r.pid for r in alive]}"


# -- Megatron-LM's exit flags --------------------------------------------------------------

def test_exit_interval_stops_after_a_step_divisible_by_it_and_saves(tmp_path, cache):
    checkpoints = tmp_path / "checkpoints"
    done = subprocess.run(command(tmp_path, cache, "--exit-interval", "3"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    assert stopped_line(done.stderr)[:2] == (3, "--exit-interval 3")
    assert_complete_latest(checkpoints, 3)
    # resumed from 3, a step divisible by 3 is 6 (Megatron-LM's: the iteration number, not the steps run)
    done = subprocess.run(command(tmp_path, cache, "--exit-interval", "3", "--load", checkpoints),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert stopped_line(done.stderr)[:2] == (6, "--exit-interval 3")
    assert tracked(checkpoints) == 6


def test_exit_duration_stops_every_rank_after_the_same_step_and_saves(tmp_path, cache):
    done = subprocess.run(command(tmp_path, cache, "--exit-duration-in-mins", "0.1"), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    step, reason, _, _ = stopped_line(done.stderr)
    assert reason == "--exit-duration-in-mins 0.1" and step >= 1
    assert_complete_latest(tmp_path / "checkpoints", step)


# -- the lock on a live job's output directory ---------------------------------------------

def test_a_second_job_into_a_live_jobs_output_dir_is_refused_and_a_dead_ones_lock_blocks_nothing(tmp_path, cache):
    first = start(tmp_path, cache, "--save-interval", "2")
    try:
        time.sleep(3.0)  # a checkpoint or two: a resume into the directory is refused as well
        for extra in ([], ["--load", tmp_path / "checkpoints"]):
            second = subprocess.run(command(tmp_path, cache, "--steps", "100000", *extra), capture_output=True,
                                    text=True, timeout=300)
            assert second.returncode == 2, second.stderr[-3000:]
            lines = second.stderr.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in second.stderr, lines
            assert f"--output-dir {tmp_path} is in use by a running job (pid {first.pid} on " in lines[0], lines
            assert f"kill -TERM {first.pid}" in lines[0]
        assert first.poll() is None  # the first job runs on, untouched
    finally:
        ranks = ranks_of(first)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        psutil.wait_procs(ranks, timeout=10)
    assert (tmp_path / LOCK_FILE).exists()  # left behind by the killed job
    after = subprocess.run(command(tmp_path, cache, "--steps", "2", "--overwrite"), capture_output=True, text=True,
                           timeout=300)
    assert after.returncode == 0, after.stderr[-3000:]


# -- a launched job (torchrun) -------------------------------------------------------------

def torchrun(output, cache):
    """A torchrun agent of two ranks running a long job, once its ranks train."""
    endpoint = f"localhost:{free_port()}"
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                              "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", endpoint,
                              *command(output, cache)[1:]],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    said = []
    for line in agent.stdout:
        said.append(line)
        if line.startswith("checkpoints: "):
            break
    assert said and said[-1].startswith("checkpoints: "), "".join(said)
    time.sleep(2.0)
    return agent, "".join(said)


def test_sigterm_to_every_process_of_a_torchrun_job_saves_one_agreed_step(tmp_path, cache):
    agent, said = torchrun(tmp_path, cache)
    processes = job_processes(agent.pid)
    assert len(processes) >= 3  # the agent and its two ranks
    send(processes, signal.SIGTERM)  # the ranks get it twice: torchrun forwards its own
    out = said + agent.communicate(timeout=180)[0]
    checkpoints = tmp_path / "checkpoints"
    step, reason, _, _ = stopped_line(out)
    assert reason == "SIGTERM"
    assert_complete_latest(checkpoints, step)
    assert "megatron_siamese/" not in out  # no traceback of ours (torchrun reports its own SIGTERM)
    assert not running(processes[1:])
    resumes(tmp_path, cache, checkpoints, step)


def test_ranks_of_a_torchrun_agent_killed_by_sigkill_save_and_exit(tmp_path, cache):
    agent, said = torchrun(tmp_path, cache)
    ranks = job_processes(agent.pid)[1:]
    agent.kill()  # the ranks' parent-death signal: SIGTERM
    agent.wait(timeout=30)
    out = said + agent.stdout.read()  # the ranks hold the pipe until they exit
    assert not running(ranks)
    step, reason, _, _ = stopped_line(out)
    assert reason == "SIGTERM" and "Traceback" not in out
    assert_complete_latest(tmp_path / "checkpoints", step)


def test_sigterm_to_every_task_of_a_slurm_step_saves_one_agreed_step_and_each_exits_0(tmp_path, cache):
    base = dict(os.environ, SLURM_NTASKS="2", SLURM_NNODES="1", SLURM_NODEID="0", SLURM_NODELIST="localhost",
                SLURM_STEP_ID="0", SLURM_JOB_ID="1", MASTER_PORT=str(free_port()))
    tasks = [subprocess.Popen(command(tmp_path, cache, "--tp", "2"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)})
             for rank in range(2)]
    first = tasks[0].stdout.readline()
    assert first.startswith("checkpoints: "), first + (tasks[0].stdout.read() if tasks[0].poll() is not None else "")
    time.sleep(2.0)
    for task in tasks:  # what slurmstepd does at the time limit
        task.send_signal(signal.SIGTERM)
    said = [task.communicate(timeout=180)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], said
    assert "Traceback" not in "".join(said)
    step, reason, _, _ = stopped_line(said[0])
    assert reason == "SIGTERM" and "stopped at step" not in said[1]  # rank 0 speaks for the job
    assert_complete_latest(tmp_path / "checkpoints", step)

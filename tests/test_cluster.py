"""Commands as cluster jobs run them: two torchrun agents on this machine standing in for two
nodes (c10d rendezvous on localhost), ranks started by hand with their env:// variables, and the
launcher's variables read and refused as a cluster would give them.

The jobs' ranks run Megatron (checks), but what they prove is the launch (ours and torch's): they
run once, on the first stack (the check's layouts run on every stack in test_check.py; training on
clusters is Megatron-LM's loop under torchrun: test_pretrain.py). Reading the launcher's
variables, the layouts that fit a job and the SLURM examples parsed against a stand-in srun touch
no Megatron: ``stack_independent``. Every process a test starts ends with it (tests/job_runs.py)."""

import json
import os
import subprocess
import sys

import pytest
from cli_runs import cli_here
from job_runs import jobs  # noqa: F401  (the fixture)

from megatron_siamese.check.matrix import layouts_that_fit, whole_job_layouts
from megatron_siamese.runtime.launch import free_port
from megatron_siamese.runtime.launchers import LaunchError, detect, reporter
from megatron_siamese.runtime.layout import parse_layout
from megatron_siamese.versions import ships_megatron_training

CLI = ["-m", "megatron_siamese.cli"]
pytestmark = pytest.mark.once("the launch across nodes is the subject (torch's agent, env://); the check's "
                              "layouts run on every stack in test_check.py")
# written by an earlier release (tests/data/step_layout/README.md)
STEP_LAYOUT = os.path.join(os.path.dirname(__file__), "data", "step_layout", "checkpoints")
STEP_LAYOUT_MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16"]


def agents(jobs, nnodes, nproc, args, cwds=None, per_node=None, timeout=600):
    """``nnodes`` torchrun agents of ``nproc`` ranks each, on one c10d rendezvous (``per_node``: more
    arguments for each agent's ranks); (rc, output) per agent."""
    endpoint = f"localhost:{free_port()}"
    started = []
    for node in range(nnodes):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node",
                   str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", endpoint,
                   *CLI, *map(str, args), *map(str, per_node[node] if per_node else ())]
        started.append(jobs.start(command, cwd=cwds[node] if cwds else None, merge_output=True))
    return [finished(job, timeout) for job in started]


def finished(job, timeout):
    """(rc, output) of a job, once it ended."""
    out, _ = job.finish(timeout)
    return job.returncode, out


def env_ranks(jobs, ranks, args, started=None):
    """The ``ranks`` of an env:// job on this host, started by hand (only those in ``started``)."""
    port = free_port()
    return [jobs.start([sys.executable, *CLI, *map(str, args)], merge_output=True,
                       env=env_launch(ranks, rank, port)) for rank in (range(ranks) if started is None else started)]


def env_launch(ranks, rank, port=None):
    """What an env:// launcher sets for ``rank`` of a job of ``ranks`` on one host."""
    return dict(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port or free_port()))


def env_job(jobs, ranks, args, timeout=300):
    """Such a job run to its end: (rc, output) per rank."""
    return [finished(task, timeout) for task in env_ranks(jobs, ranks, args)]


# -- reading the launcher's variables ------------------------------------------------------


@pytest.mark.stack_independent
def test_torchrun_variables_are_read_as_one_job():
    torchrun = detect(dict(TORCHELASTIC_RUN_ID="x", RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4",
                           GROUP_RANK="1", MASTER_ADDR="head", MASTER_PORT="29400",
                           SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_STEP_ID="0"))  # srun's agent: not a rank
    assert (torchrun.launcher, torchrun.rank, torchrun.world_size, torchrun.local_rank, torchrun.nnodes) == \
        ("torchrun", 5, 8, 1, 2)
    assert torchrun.environment()["RANK"] == "5" and not reporter(env_launch(8, 5))
    # srun's tasks without torchrun would each start ranks of their own: refused, saying how to launch
    with pytest.raises(LaunchError, match="srun started this process as one of 8 tasks.*torchrun"):
        detect(dict(SLURM_PROCID="0", SLURM_NTASKS="8", SLURM_STEP_ID="0"))
    # one task (srun -n 1), or the batch script itself (no step), starts its ranks here
    assert detect(dict(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_STEP_ID="0")) is None
    assert detect(dict(SLURM_PROCID="0", SLURM_NTASKS="8")) is None and detect({}) is None


@pytest.mark.stack_independent
@pytest.mark.parametrize("env, message", [
    (dict(RANK="3", WORLD_SIZE="2"), "RANK=3 is not below WORLD_SIZE=2"),
    (dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="1"), "LOCAL_RANK=1 exceeds RANK=0"),
    (dict(RANK="0", WORLD_SIZE="two"), "WORLD_SIZE='two' is not a count"),
])
def test_env_variables_that_disagree_are_refused(env, message):
    with pytest.raises(LaunchError, match=message):
        detect({"MASTER_ADDR": "head", "MASTER_PORT": "29400", **env})


@pytest.mark.stack_independent
def test_an_env_launch_without_its_rendezvous_is_refused():
    with pytest.raises(LaunchError, match="MASTER_ADDR, MASTER_PORT not set"):
        detect(dict(RANK="0", WORLD_SIZE="2"))


@pytest.mark.stack_independent
def test_all_layouts_that_fit_a_job():
    sixteen = whole_job_layouts(16)
    assert {"tp8-pp2", "tp8-pp2-vpp2-sp", "tp4-pp2-dp2", "tp2-dp8", "tp2-dp8-sp-do", "pp4-vpp2-dp4-do"} <= set(sixteen)
    assert all(parse_layout(name).world_size == 16 and parse_layout(name).tp <= 8 for name in sixteen)
    assert all(parse_layout(name).world_size <= 2 for name in layouts_that_fit(2)) and "tp2-sp" in layouts_that_fit(2)
    assert set(layouts_that_fit(4)) < set(layouts_that_fit(16))


# -- two nodes of two ranks ----------------------------------------------------------------


def test_check_on_two_nodes(tmp_path, jobs):
    report = tmp_path / "check.json"
    runs = agents(jobs, 2, 2, ["check", "--layouts", "tp2-pp2,dp2-tp2-sp,dp2-do", "--num-layers", "2",
                               "--json", report])
    assert [rc for rc, _ in runs] == [0, 0], runs
    table = "".join(out for _, out in runs)
    assert table.count("tolerance (fp32)") == 1 and "torchrun job of 4 ranks on 2 node(s)" in table
    assert "3 passed, 0 failed, 0 skipped" in table and "Traceback" not in table and "Warning" not in table
    written = json.loads(report.read_text())
    assert written["passed"] and [row["layout"] for row in written["rows"]] == ["tp2-pp2", "dp2-tp2-sp", "dp2-do"]
    assert written["launch"]["nnodes"] == 2 and all(row["status"] == "PASS" for row in written["rows"])


def test_a_failing_layout_fails_every_rank_of_the_job(jobs):
    runs = env_job(jobs, 2, ["check", "--layouts", "tp2-sp", "--num-layers", "2", "--plant-fault", "no-sp-flag"])
    assert [rc for rc, _ in runs] == [1, 1], runs
    assert "FAIL" in runs[0][1] and "layout" not in runs[1][1]  # rank 0 speaks for the job


# -- jobs that cannot be this run ------------------------------------------------------------


def test_a_job_of_the_wrong_size_is_refused_on_rank_0(tmp_path, jobs):
    runs = env_job(jobs, 2, ["check", "--layouts", "tp2,tp2-pp2"])
    assert [rc for rc, _ in runs] == [2, 2] and "layout tp2-pp2 needs 4 ranks but the launched job has 2" in runs[0][1]
    # a one-rank command under a larger job says how to launch it: refused before it joins the job
    # (in this process, as each rank of the job; the message from rank 0)
    runs = []
    for rank in range(2):
        done = cli_here("analyze", *STEP_LAYOUT_MODEL, "--load", STEP_LAYOUT, "--output-dir", tmp_path / "analysis",
                        env=env_launch(2, rank))
        runs.append((done.returncode, done.stdout + done.stderr))
    assert [rc for rc, _ in runs] == [2, 2], runs
    assert "but analyze uses 1 rank: launch 1 rank (torchrun --nproc-per-node 1)" in runs[0][1], runs
    assert runs[1][1] == ""


def test_a_rank_that_never_joins_ends_the_job_with_a_timeout(jobs):
    # two jobs at once (their own rendezvous each), one without its rank 1, one without its rank 0
    check = ["check", "--layouts", "tp2", "--distributed-timeout-minutes", "0.1"]
    without_1, without_0 = (env_ranks(jobs, 2, check, started=[rank]) for rank in (0, 1))
    (rc, out), = [finished(task, timeout=120) for task in without_1]
    assert rc == 2 and "did not meet the others within 6s" in out and "1/2 clients joined" in out, out
    assert "Traceback" not in out
    # the one missing may be rank 0: the others say so themselves
    (rc, out), = [finished(task, timeout=120) for task in without_0]
    assert rc == 2 and "megatron-siamese check: error: rank 1: rank 1 of the env job of 2 ranks" in out, out


# -- the SLURM examples ------------------------------------------------------------------------

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples", "slurm")


def submitted(script, tmp_path, **env):
    """The command an example batch script hands to srun (a stand-in srun records it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$SRUN_RECORD"\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node001\necho node002\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    record = tmp_path / f"{script}.args"
    # a batch job starts without a rendezvous or step of its own (env.sh keeps a MASTER_ADDR it is given)
    inherited = {name: value for name, value in os.environ.items()
                 if name not in ("MASTER_ADDR", "MASTER_PORT") and not name.startswith("SLURM_")}
    variables = dict(inherited, PATH=f"{bin_dir}:{os.environ['PATH']}", SRUN_RECORD=str(record),
                     SLURM_JOB_NODELIST="node[001-002]", SLURM_NNODES="2", SLURM_JOB_ID="77", **env)
    subprocess.run(["bash", os.path.join(EXAMPLES, script)], check=True, env=variables, cwd=tmp_path)
    return record.read_text().split("\0")[:-1]


@pytest.mark.stack_independent
def test_the_slurm_check_and_megatron_lm_examples_hand_commands_that_parse(tmp_path):
    from megatron_siamese.cli import build_parser, check as check_command
    from megatron_siamese.check.case import ModelCase

    check = submitted("check.sbatch", tmp_path)
    assert check[1] == "torchrun" and check[check.index("--nnodes") + 1] == "2"  # one agent per node
    cli_args = check[check.index("megatron_siamese.cli") + 1:]
    options = build_parser().parse_args(cli_args)
    assert options.layouts == "all" and options.transformer_impl == "transformer_engine" and options.dtype == "bf16"
    case = ModelCase(**{name: getattr(options, name) for name in check_command.CASE_SETTINGS + check_command.SIZES})
    assert check_command.problems(case, ["tp8-pp2", "tp4-pp2-dp2-sp", "tp2-dp8-sp-do"]) == []

    megatron_lm = submitted("pretrain_gpt_megatron_lm.sbatch", tmp_path, MEGATRON_LM=str(tmp_path), DATA="d", OUT="o")
    assert megatron_lm[1] == "torchrun" and "node001:" in megatron_lm[megatron_lm.index("--rdzv-endpoint") + 1]
    module, name = megatron_lm[megatron_lm.index("--spec") + 1: megatron_lm.index("--spec") + 3]
    import importlib

    assert hasattr(importlib.import_module(module), name)


@pytest.mark.users_stack("reads the example's flags with Megatron-LM's parser, which megatron-core >= 0.17 ships")
@pytest.mark.skipif(not ships_megatron_training(), reason="megatron-core < 0.17: no Megatron-LM parser to read it")
def test_the_slurm_pretrain_example_hands_megatron_lm_flags_to_one_torchrun_per_node(tmp_path):
    from cli_runs import megatron_lm_args

    train = submitted("pretrain.sbatch", tmp_path, OUT=str(tmp_path / "out"))
    assert train[1] == "torchrun" and train[train.index("--nnodes") + 1] == "2"
    assert train[train.index("--nproc-per-node") + 1] == "8" and "node001:" in train[train.index("--rdzv-endpoint") + 1]
    args, _ = megatron_lm_args(train[train.index("megatron_siamese.cli") + 1:])
    assert (args.tensor_model_parallel_size, args.norm, args.exit_signal_handler) == (8, "siamese", True)
    assert args.save == args.load == str(tmp_path / "out" / "checkpoints")  # a resubmission resumes

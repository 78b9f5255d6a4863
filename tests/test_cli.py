"""The command line as a user drives it: exit codes, what is printed, and the files left on disk
after bad input, reruns, broken checkpoints, killed ranks and Ctrl-C. Subprocesses (``cli``,
``running``) where the process is what is tested (its exit status and output, signals, killed
ranks, the progress bar, imports); the command's ``main`` in this process (``cli_here``) for what
it decides and does with checkpoints (refusals, resumes), on the session's ``trained_run``."""

import argparse
import contextlib
import os
import re
import shutil
import signal
import time

import psutil
import pytest
from cli_refusals import record_rank_starts, running
from cli_runs import cli, cli_here
from conftest import SMALL_RUN

from megatron_siamese.cli import build_parser
from megatron_siamese.training.args import TrainArgs
from megatron_siamese.training.checkpoint_files import TRACKER

SMALL = ["--num-layers", "2", "--hidden-size", "32", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--eval-iters", "1", "--eval-interval", "100"]
ONE_RANK = [*SMALL_RUN, "--tp", "1"]  # trained_run's settings: a resume of it changes nothing else


def train(tmp_path, cache, name, *args):
    return cli("train", *SMALL, "--cache-dir", cache, "--output-dir", tmp_path / name, *args)


def train_here(cache, output, *args):
    """``train`` with trained_run's settings, in this process."""
    return cli_here("train", *ONE_RANK, "--cache-dir", cache, "--output-dir", output, *args)


@pytest.fixture
def rank_starts(monkeypatch):
    return record_rank_starts(monkeypatch)


def final_val_loss(done) -> float:
    return float(re.search(r"val loss ([0-9.]+)", done.stdout).group(1))


def assert_refused(done, *messages):
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout
    for message in messages:
        assert message in done.stderr, done.stderr


# -- bad input ---------------------------------------------------------------------------

BAD_INPUT = {
    "warm-up over the run": (["train", "--steps", "5", "--warmup-steps", "30"], "must lie in [0, --train-iters)"),
    "no steps": (["train", "--steps", "0"], "--train-iters/--steps must be at least 1 (got 0)"),
    "negative steps": (["train", "--steps", "-5"], "must be at least 1 (got -5)"),
    "fp16": (["train", "--dtype", "fp16"], "fp16 is not supported"),
    "tp3 over 4 heads": (["train", "--tp", "3"], "--num-attention-heads 4 does not split over --tp 3"),
    "megatron's name": (["train", "--tensor-model-parallel-size", "3"], "does not split over --tp 3"),
    "pp3 over 4 layers": (["train", "--pp", "3"], "--num-layers 4 does not split over 3 pipeline stages"),
    "unknown scheme": (["train", "--norm", "foo"], "invalid choice: 'foo'"),
    "no prefix matching (--save-int is not --save-interval)": (["train", "--save-int", "5"],
                                                               "megatron-siamese train: error: unrecognized arguments: --save-int 5"),
    "a dataset file for its prefix": (["train", "--data-path", "corpus.bin"],
                                      "give the prefix its .bin and .idx share (--data-path corpus)"),
    "unknown layout": (["check", "--layouts", "tp3-foo"], "unknown part 'foo'"),
    "a layout part misspelled": (["check", "--layouts", "dp2-fsdp"], "unknown part 'fsdp' (did you mean 'fsdp2'?)"),
    "a layout that cannot be": (["check", "--layouts", "fsdp2"], "layout 'fsdp2': torch FSDP2 (fsdp2) shards over the data-parallel ranks: it needs more than one (dp2 or more)"),
    "upcycle without arguments": (["upcycle"], "required: --load, --output-dir"),
    "missing checkpoint": (["upcycle", "--load", "/nonexistent", "--output-dir", "/tmp/x"], "no such file or directory"),
}


def cli_recording_imports(*argv):
    """``cli(*argv)`` with Python's import log (-X importtime, on stderr): ``.imported`` holds the
    top-level name of every module the process imported; ``.stderr`` is what the command printed."""
    done = cli(*argv, env={"PYTHONPROFILEIMPORTTIME": "1"})
    log = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    done.stderr = "".join(line + "\n" for line in done.stderr.splitlines() if not line.startswith("import time:"))
    done.imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in log[1:]}  # log[0]: the header
    assert "megatron_siamese" in done.imported, log[:5]  # the log is there: the check below can fail
    return done


def assert_decided_before_torch_and_megatron(done):
    heavy = {"torch", "megatron"} & done.imported
    assert not heavy, f"imported {sorted(heavy)} before refusing"


@pytest.mark.stack_independent
@pytest.mark.parametrize("name", sorted(BAD_INPUT))
def test_bad_input_is_one_line_per_problem_exit_2_and_fast(name):
    argv, message = BAD_INPUT[name]
    done = cli_recording_imports(*argv)
    assert_refused(done, message)
    assert_decided_before_torch_and_megatron(done)  # fast: validated before torch or Megatron is imported


@pytest.mark.stack_independent
def test_every_problem_is_listed_at_once():
    done = cli("train", "--steps", "0", "--tp", "3", "--dtype", "fp16")
    problems = ["--steps must be at least 1", "--num-attention-heads 4 does not split over --tp 3",
                "the MLP width 512 (--ffn-hidden-size) does not split over --tp 3",
                "the vocabulary (320) does not split over --tp 3", "--dtype fp16 is not supported"]
    assert_refused(done, *problems)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == len(problems) and all(line.startswith("megatron-siamese train: error: ") for line in lines)
    assert all(sum(problem in line for line in lines) == 1 for problem in problems)  # one line per problem


@pytest.mark.parametrize("command", ["train", "check"])
def test_hybrid_model_on_megatron_core_before_0_19_is_refused_by_both_commands(command):
    from megatron_siamese.versions import installed_megatron_core, release

    if release(installed_megatron_core()) >= (0, 19, 0):
        pytest.skip("this megatron-core builds HybridModel (test_hybrid.py runs it)")
    done = cli_recording_imports(command, "--model", "hybrid")
    assert_refused(done, "--model hybrid needs megatron-core >= 0.19")
    assert_decided_before_torch_and_megatron(done)


@pytest.mark.stack_independent  # our own checks around Megatron: one stack is enough
def test_analyze_on_a_directory_that_is_no_checkpoint(tmp_path):
    assert_refused(cli("analyze", "--load", tmp_path), "is not a checkpoint")


# -- flags and help ----------------------------------------------------------------------

def subparser(name):
    if name == "train":
        from cli_runs import our_train_parser

        return our_train_parser()
    return build_parser()._subparsers._group_actions[0].choices[name]


@pytest.mark.stack_independent
def test_megatron_names_are_accepted_beside_the_short_ones():
    options = subparser("train").parse_args(
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--train-iters", "7",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--seq-length", "64", "--lr-warmup-iters", "1",
         "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--bf16", "--sequence-parallel",
         "--use-distributed-optimizer", "--num-virtual-stages-per-pipeline-rank", "2", "--disable-bias-linear"])
    assert (options.tp, options.pp, options.steps, options.micro_batch_size, options.global_batch_size,
            options.seq_length, options.warmup_steps, options.dtype, options.sp, options.distributed_optimizer,
            options.vpp, options.add_bias_linear) == (2, 2, 7, 1, 4, 64, 1, "bf16", True, True, 2, False)
    short = subparser("train").parse_args(["--tp", "2", "--pp", "2", "--steps", "7", "--warmup-steps", "1"])
    assert (short.tp, short.pp, short.steps, short.warmup_steps) == (2, 2, 7, 1)


@pytest.mark.stack_independent
@pytest.mark.parametrize("command", ["train", "check", "plan", "study", "upcycle", "analyze", "generate", "export",
                                     "import-hf", "eval"])
def test_every_flag_has_help_and_shows_its_default(command):
    parser = subparser(command)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and action.help.strip(), f"{command} {action.option_strings} has no help"
    formatter = parser.formatter_class(prog=parser.prog)
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        shown = formatter._get_help_string(action)
        # a flag that sets another value than its own (--bf16, --untie-..., --disable-bias-linear)
        # shows none: its field's default would read as the flag's; every other flag shows one, once
        sets_other_value = isinstance(action, argparse._StoreFalseAction) or (
            type(action) is argparse._StoreConstAction and not isinstance(action.const, bool))
        assert shown.count("default:") == (0 if sets_other_value else 1), (command, action.option_strings, shown)


@pytest.mark.stack_independent
def test_subcommands_list_only_their_own_flags():
    done = cli("train", "--help")
    assert done.returncode == 0 and done.stderr == ""  # no Megatron notices for a help text
    assert "--train-iters" in done.stdout and "--tensor-model-parallel-size" in done.stdout
    for command in ("upcycle", "analyze"):
        text = subparser(command).format_help()
        assert "--load" in text and "--hidden-size" in text
        assert "--train-iters" not in text and "--tensor-model-parallel-size" not in text and "--lr" not in text


@pytest.mark.stack_independent
def test_warm_up_defaults_to_a_tenth_of_the_run():
    assert [TrainArgs(steps=s).warmup for s in (300, 5, 1)] == [30, 0, 0]
    assert TrainArgs(steps=300, warmup_steps=7).warmup == 7


# -- checkpoints: never overwritten, resumed as they were, broken ones named ----------------
# On the session's trained_run (TP1, checkpoints at steps 2 and 4), in this process: what is
# tested is what the command decides and what it does with a checkpoint, not the process.

def snapshot(directory):
    return {path: os.stat(os.path.join(directory, path)).st_mtime_ns
            for path in sorted(os.listdir(directory))} | {"tracker:": open(os.path.join(directory, TRACKER)).read()}


def test_a_rerun_into_a_used_output_dir_is_refused_and_touches_nothing(tmp_path, corpus_cache, trained_run,
                                                                       rank_starts):
    output = tmp_path / "reused"
    shutil.copytree(trained_run, output)
    before = snapshot(output / "checkpoints")
    done = train_here(corpus_cache, output, "--steps", "2", "--save-interval", "2")
    assert_refused(done, "already holds another run's checkpoints (iter_0000002, iter_0000004)", "--overwrite")
    assert snapshot(output / "checkpoints") == before
    assert rank_starts == []  # refused before any rank started
    # --overwrite replaces them: nothing of the old run is left to mix with the new one
    done = train_here(corpus_cache, output, "--steps", "2", "--save-interval", "2", "--overwrite")
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(output / "checkpoints")) == ["iter_0000002", TRACKER]
    assert (output / "checkpoints" / "iter_0000002").stat().st_mtime_ns != before["iter_0000002"]
    assert rank_starts == [1]  # the run's one rank: what the refusal above did not start


def test_evaluating_a_checkpoint_as_saved_needs_no_other_flag(tmp_path, corpus_cache, trained_run):
    done = train_here(corpus_cache, tmp_path, "--steps", "4", "--load", trained_run / "checkpoints")
    assert done.returncode == 0, done.stderr
    assert f"resumed from {trained_run / 'checkpoints'} at step 4" in done.stdout
    assert "evaluated the checkpoint at step 4 (no steps left to train): val loss" in done.stdout


def test_load_takes_a_runs_directory_and_a_requeued_job_starts_from_its_empty_save_directory(tmp_path, corpus_cache,
                                                                                              trained_run):
    """Megatron-LM users write --save X --load X in a requeue script: until X holds a checkpoint the
    job starts from step 0 (one line says so), then it resumes from X. --load also takes a run's
    directory (what --output-dir made), and any other --load without a checkpoint stays an error."""
    done = train_here(corpus_cache, tmp_path / "from-run-dir", "--steps", "4", "--load", trained_run)
    assert done.returncode == 0, done.stderr
    assert f"resumed from {trained_run} at step 4" in done.stdout
    save = tmp_path / "job" / "saved"
    requeue = ("--steps", "4", "--stop-step", "2", "--save", save, "--load", save)
    first = train_here(corpus_cache, tmp_path / "job", *requeue)
    assert first.returncode == 0, first.stderr
    assert f"--load {save} holds no checkpoint yet (it is the --save directory): starting from step 0" in first.stdout
    assert sorted(os.listdir(save)) == ["iter_0000002", TRACKER]  # --save, not OUTPUT_DIR/checkpoints
    assert not (tmp_path / "job" / "checkpoints").exists()
    second = train_here(corpus_cache, tmp_path / "job", "--steps", "4", "--save", save, "--load", save)
    assert second.returncode == 0, second.stderr
    assert f"resumed from {save} at step 2" in second.stdout and "starting from step 0" not in second.stdout
    # --save alone saves at the end, as Megatron-LM's does
    assert f"checkpoints: at step 4, in {save}" in second.stdout
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004", TRACKER]
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = train_here(corpus_cache, tmp_path / "other", "--steps", "4", "--load", empty)
    assert_refused(refused, f"--load {empty} is not a checkpoint")


def test_resuming_with_another_schedule_is_refused_unless_a_flag_says_which_wins(tmp_path, corpus_cache, trained_run):
    checkpoints = trained_run / "checkpoints"
    refused = train_here(corpus_cache, tmp_path / "a", "--steps", "6", "--load", checkpoints / "iter_0000002",
                         "--lr", "0", "--min-lr", "0")
    assert_refused(refused, "another schedule", "--lr 0 (checkpoint: 0.002)", "--train-iters 6 (checkpoint: 4)",
                   "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler")
    # these settings win: a zero learning rate leaves the weights where step 2 left them
    frozen = train_here(corpus_cache, tmp_path / "b", "--steps", "6", "--load", checkpoints / "iter_0000002",
                        "--lr", "0", "--min-lr", "0", "--override-opt_param-scheduler")
    as_saved = train_here(corpus_cache, tmp_path / "c", "--steps", "2", "--load", checkpoints / "iter_0000002")
    assert frozen.returncode == 0 and as_saved.returncode == 0, frozen.stderr + as_saved.stderr
    assert "resumed from" in frozen.stdout and "at step 2" in frozen.stdout
    assert final_val_loss(frozen) == final_val_loss(as_saved)
    # the checkpoint's win: it trains on (the weights move)
    kept = train_here(corpus_cache, tmp_path / "d", "--steps", "6", "--load", checkpoints / "iter_0000002",
                      "--lr", "0", "--min-lr", "0", "--use-checkpoint-opt_param-scheduler")
    assert kept.returncode == 0, kept.stderr
    assert final_val_loss(kept) != final_val_loss(as_saved)


CORRUPTIONS = {
    "truncated shard": ("__0_0.distcp", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "is truncated"),
    "empty common.pt": ("common.pt", lambda p: p.write_bytes(b""), "is empty"),
    "garbage metadata.json": ("metadata.json", lambda p: p.write_text("{not json"), "is not valid JSON"),
    "garbage .metadata": (".metadata", lambda p: p.write_bytes(b"garbage"), "cannot be read"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_a_broken_checkpoint_is_named_with_the_steps_to_load_instead(tmp_path, corpus_cache, trained_run, name,
                                                                     rank_starts):
    filename, corrupt, what = CORRUPTIONS[name]
    if not (trained_run / "checkpoints" / "iter_0000004" / filename).exists():
        pytest.skip(f"this megatron-core writes no {filename} (from 0.19 the common state is one of the shards)")
    shutil.copytree(trained_run, tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    corrupt(checkpoints / "iter_0000004" / filename)
    for load in (checkpoints, checkpoints / "iter_0000004"):  # through the tracker, and named directly
        done = train_here(corpus_cache, tmp_path / "run", "--steps", "4", "--load", load)
        assert_refused(done, f"{checkpoints / 'iter_0000004' / filename}", what,
                       f"complete checkpoints in {checkpoints}: iter_0000002 (pass one to --load)")
    assert rank_starts == []


def ranks_of(pid: int):
    """The rank processes of a running command (children of its fork server)."""
    servers = [c for c in psutil.Process(pid).children() if "forkserver" in " ".join(c.cmdline())]
    return [rank for server in servers for rank in server.children()]


KILLED_RUN = ["--num-layers", "4", "--hidden-size", "256", "--seq-length", "32", "--micro-batch-size", "2",
              "--global-batch-size", "4", "--eval-iters", "1", "--eval-interval", "100"]


def test_a_rank_killed_mid_save_leaves_the_tracker_on_the_last_complete_checkpoint(tmp_path, corpus_cache):
    output = tmp_path / "killed"
    checkpoints = output / "checkpoints"
    killed = None
    with running("train", *KILLED_RUN, "--cache-dir", corpus_cache, "--output-dir", output, "--steps", "40",
                 "--save-interval", "2", "--no-progress") as run:
        deadline = time.monotonic() + 240
        # the event: a checkpoint directory appearing without torch's index, after one complete
        # save (the tracker); file systems notify no one, so it is looked for every 2 ms
        while killed is None and time.monotonic() < deadline and run.process.poll() is None:
            saving = [p for p in checkpoints.glob("iter_*") if not (p / ".metadata").exists()]
            if saving and (checkpoints / TRACKER).exists():
                victim = ranks_of(run.pid)[-1]
                victim.kill()
                killed = saving[0].name
            time.sleep(0.002)
        assert killed is not None, f"no save was caught in progress: {run.output('stderr')[-2000:]}"
        code, out, err = run.finish(timeout=120)
    assert code == 1 and "Traceback" not in err
    assert re.search(r"error: rank \d was killed by SIGKILL", err), err
    latest = int((checkpoints / TRACKER).read_text())
    assert f"iter_{latest:07d}" != killed and not list((checkpoints / f"iter_{latest:07d}").glob("*.distcp")) == []
    assert (checkpoints / f"iter_{latest:07d}" / ".metadata").exists()
    # what the checkpoint holds resumes (in this process: the resume, not the process, is tested)
    resumed = cli_here("train", *KILLED_RUN, "--cache-dir", corpus_cache, "--output-dir", output, "--steps", "40",
                       "--stop-step", str(latest + 2), "--load", checkpoints)
    assert resumed.returncode == 0, resumed.stderr
    assert f"at step {latest}" in resumed.stdout


# -- signals -----------------------------------------------------------------------------

ITERATION_LINE = r"\] iteration +\d+/ *\d+ \|"  # Megatron-LM's line for a step (--log-interval 1: each)


@contextlib.contextmanager
def long_run(output, cache):
    """A run of 100000 steps (to be stopped), from the moment it is a step in (it printed the
    step's line) until the block ends (then killed, whatever happened)."""
    with running("train", *SMALL, "--cache-dir", cache, "--output-dir", output, "--steps", "100000",
                 "--log-interval", "1") as run:
        assert run.wait_for("stdout", r".").startswith("checkpoints: none")  # the ranks are up
        run.wait_for("stdout", ITERATION_LINE)  # a step in
        yield run


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm-to-the-launcher"])
def test_a_stop_signal_finishes_the_step_saves_and_exits_0(tmp_path, corpus_cache, how):
    with long_run(tmp_path, corpus_cache) as run:
        if how == "ctrl-c":
            os.killpg(run.pid, signal.SIGINT)  # what a terminal sends: every process of the group
        else:
            run.process.send_signal(signal.SIGTERM)  # what a scheduler sends the job's process
        code, out, err = run.finish(timeout=120)
    assert code == 0, err[-3000:]
    assert "Traceback" not in err
    stopped = [line for line in err.splitlines() if line.startswith("stopped at step")]
    assert len(stopped) == 1, err[-3000:]
    step = int(re.search(r"stopped at step (\d+)", stopped[0]).group(1))
    checkpoints = tmp_path / "checkpoints"
    assert f"checkpoint saved to {checkpoints / f'iter_{step:07d}'}" in stopped[0]
    assert (checkpoints / TRACKER).read_text() == str(step)
    assert (checkpoints / f"iter_{step:07d}" / ".metadata").exists()


def test_a_second_ctrl_c_stops_at_once(tmp_path, corpus_cache):
    with long_run(tmp_path, corpus_cache) as run:
        os.killpg(run.pid, signal.SIGINT)
        # a second press once the launcher took the first (two signals sent before it handles
        # the first would arrive as one)
        run.wait_for("stderr", r"^SIGINT: finishing this step, then stopping \(Ctrl-C again to stop at once\)")
        os.kill(run.pid, signal.SIGINT)
        code, out, err = run.finish(timeout=60)
    assert code == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "megatron-siamese train: interrupted"


# -- output ------------------------------------------------------------------------------

def test_check_prints_its_table_and_little_else():
    done = cli("check", "--layouts", "tp2,pp2", "--num-layers", "2")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip().splitlines()) == 6  # title, tolerance, header, two rows, total
    assert done.stderr == ""


def test_a_run_with_every_parallelism_and_a_save_prints_no_warnings(tmp_path, corpus_cache):
    """Megatron's and torch's known notices (DP collectives, SP, the distributed optimizer, the
    checkpoint writer) are hidden on each stack; anything else would show here."""
    done = train(tmp_path, corpus_cache, "quiet", "--steps", "2", "--tp", "2", "--sp", "--dp", "2",
                 "--distributed-optimizer", "--save-interval", "1", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_one_progress_bar_and_where_checkpoints_go(tmp_path, corpus_cache):
    # --progress: the bar even though stdout is a pipe here (without it: Megatron-LM's log lines, test_run_log.py)
    done = train(tmp_path, corpus_cache, "bar", "--steps", "3", "--save-interval", "3", "--tp", "2", "--progress")
    assert done.returncode == 0, done.stderr
    assert len(re.findall(r"\s0%\|", done.stderr)) == 1  # rank 0's bar only, not one per TP rank
    assert f"checkpoints: every 3 steps and at step 3, in {tmp_path / 'bar' / 'checkpoints'}" in done.stdout
    # what the run says of its checkpoints (rank 0's status line), in this process
    quiet = cli_here("train", *SMALL, "--cache-dir", corpus_cache, "--output-dir", tmp_path / "quiet", "--steps", "2")
    assert "checkpoints: none (--save DIR, --save-interval N or --stop-step N saves them; Ctrl-C saves one and stops)" in quiet.stdout

"""What a run leaves for a cluster job's log and on disk: Megatron-LM's iteration and validation
lines when stdout is not a terminal (the bar when it is), metrics.jsonl, settings.json, loss.png,
TensorBoard events and wandb calls (a fake wandb package that records them). What a process
prints (its log, its terminal) and scripts/run.sh are driven as a user does (subprocesses); a
resume, whose point is the files it continues, runs in this process (``cli_here``)."""

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import pty
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_refusals import record_rank_starts
from cli_runs import cli_here

from megatron_siamese.training import run_settings
from megatron_siamese.training.args import TrainArgs
from megatron_siamese.training.run_log import console
from megatron_siamese.versions import ships_megatron_training

# where train is Megatron-LM's loop, its logs and files are Megatron's (tests/test_pretrain.py)
pytestmark = pytest.mark.skipif(ships_megatron_training(), reason="our loop's logs: tested on megatron-core 0.16.1")

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "megatron_siamese.cli"]
TINY = ["--tp", "1", "--num-layers", "2", "--hidden-size", "32", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--eval-iters", "1", "--eval-interval", "3"]
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
ITERATION_FIELDS = ["iteration", "consumed samples", "elapsed time per iteration (ms)", "throughput (tokens/s)",
                    "learning rate", "global batch size", "lm loss", "loss scale", "grad norm",
                    "number of skipped iterations", "number of nan iterations"]
ITERATION = re.compile(r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration +(\d+)/ +(\d+) \|(.*)$")
VALIDATION = re.compile(r"^ validation loss at iteration (\d+) \| lm loss value: (\S+) \| lm loss PPL: (\S+) \| $")

FAKE_WANDB = '''
import json, os

def _record(call, **fields):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as out:
        out.write(json.dumps({"call": call, **fields}) + "\\n")

def init(**kwargs):
    _record("init", kwargs=kwargs)

def log(data, step=None, commit=None):
    _record("log", data=data, step=step)

def finish():
    _record("finish")
'''


def cli(*args, env=None, timeout=300):
    done = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    return done


def train_here(*args):
    """``train`` in this process (``cli_here``), with the same check as ``cli``."""
    done = cli_here("train", *args)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    return done


def iteration_lines(stdout):
    """{step: {field: value}} of Megatron-LM's iteration lines, parsed as its log readers do."""
    found = {}
    for line in stdout.splitlines():
        match = ITERATION.match(line)
        if match:
            fields = {"iteration": f"{match.group(1)}/{match.group(2)}"}
            for part in match.group(3).split("|")[:-1]:
                key, value = part.strip().rsplit(": ", 1)
                fields[key] = value
            found[int(match.group(1))] = fields
    return found


def validation_lines(stdout):
    found = {}
    lines = stdout.splitlines()
    for i, line in enumerate(lines):
        match = VALIDATION.match(line)
        if match:
            assert set(lines[i - 1]) == {"-"} and lines[i - 1] == lines[i + 1] and len(lines[i - 1]) == len(line) + 1
            found[int(match.group(1))] = (float(match.group(2)), float(match.group(3)))
    return found


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def summary_of(directory):
    summary = json.load(open(directory / "summary.json"))
    return ({int(k): v for k, v in summary["train_losses"].items()},
            {int(k): v for k, v in summary["val_losses"].items()}, summary)


# -- a run in a batch job's log: Megatron-LM's lines, the files, TensorBoard, wandb ------

@pytest.fixture(scope="module")
def logged_run(tmp_path_factory, corpus_cache):
    """A 6-step run with stdout a pipe, no console flag, --tensorboard-dir (when the package is
    here) and --wandb-project on a fake wandb that records its calls."""
    root = tmp_path_factory.mktemp("logged")
    fake = root / "fake"
    (fake / "wandb").mkdir(parents=True)
    (fake / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    wandb_log = root / "wandb-calls.jsonl"
    tensorboard = ["--tensorboard-dir", root / "tb"] if HAS_TENSORBOARD else []
    env = {"PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")]),
           "FAKE_WANDB_LOG": str(wandb_log)}
    done = cli("train", *TINY, "--steps", "6", "--cache-dir", corpus_cache, "--output-dir", root / "run", *tensorboard,
               "--wandb-project", "siamese", "--wandb-exp-name", "tiny", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(root=root, out=root / "run", done=done, wandb=wandb_log)


def test_megatron_lm_lines_in_a_log_file(logged_run):
    done, out = logged_run["done"], logged_run["out"]
    train, val, _ = summary_of(out)
    lines = iteration_lines(done.stdout)
    assert sorted(lines) == list(range(1, 7))  # a 6-step run logs every step: at least ten lines a run
    for step, fields in lines.items():
        assert list(fields) == ITERATION_FIELDS
        assert fields["iteration"] == f"{step}/6"
        assert int(fields["consumed samples"]) == 4 * step and int(fields["global batch size"]) == 4
        assert float(fields["lm loss"]) == pytest.approx(train[step], rel=1e-6)
        assert float(fields["loss scale"]) == 1.0 and float(fields["elapsed time per iteration (ms)"]) > 0
        assert int(fields["number of skipped iterations"]) == 0 and int(fields["number of nan iterations"]) == 0
    assert float(lines[6]["learning rate"]) == pytest.approx(2e-4)  # the schedule's end: --min-lr
    validations = validation_lines(done.stdout)
    assert sorted(validations) == [3, 6]
    for step, (loss, ppl) in validations.items():
        assert loss == pytest.approx(val[step], rel=1e-6) and ppl == pytest.approx(math.exp(val[step]), rel=1e-6)
    assert "%|" not in done.stderr  # no bar in a log file
    assert f"results in {out}: settings.json, metrics.jsonl, loss.png, summary.json" in done.stdout


def test_metrics_jsonl_holds_every_step_and_evaluation(logged_run):
    out = logged_run["out"]
    train, val, _ = summary_of(out)
    entries = read_jsonl(out / "metrics.jsonl")
    steps = [e for e in entries if "loss" in e]
    evaluations = [e for e in entries if "val_loss" in e]
    assert {e["step"]: e["loss"] for e in steps} == train and [e["step"] for e in steps] == list(range(1, 7))
    assert {e["step"]: e["val_loss"] for e in evaluations} == val
    for entry in steps:
        assert entry["consumed_samples"] == 4 * entry["step"] and entry["lr"] > 0 and entry["grad_norm"] > 0
        assert entry["tokens_per_second"] == pytest.approx(4 * 32 / entry["seconds"])
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_settings_json_round_trips_to_the_run_settings(logged_run):
    out = logged_run["out"]
    args = run_settings.read(out / "settings.json")
    assert isinstance(args, TrainArgs)
    assert dataclasses.asdict(args) == json.load(open(out / "settings.json"))  # every field, as it was
    assert (args.steps, args.tp, args.hidden_size, args.output_dir, args.wandb_project) == (6, 1, 32, str(out), "siamese")
    _, _, summary = summary_of(out)
    assert json.loads(json.dumps(summary["args"])) == json.load(open(out / "settings.json"))


def test_wandb_gets_megatron_lm_scalars(logged_run):
    out = logged_run["out"]
    train, val, _ = summary_of(out)
    calls = read_jsonl(logged_run["wandb"])
    assert [c["call"] for c in calls].count("init") == 1 and calls[-1]["call"] == "finish"
    init = calls[0]["kwargs"]
    assert (init["project"], init["name"], init["dir"]) == ("siamese", "tiny", str(out / "wandb"))
    assert init["config"] == json.load(open(out / "settings.json"))
    logs = [c for c in calls if c["call"] == "log"]
    assert {c["step"]: c["data"]["lm loss"] for c in logs if "lm loss" in c["data"]} == train
    assert {c["step"]: c["data"]["lm loss validation"] for c in logs if "lm loss validation" in c["data"]} == val
    assert all({"learning-rate", "grad-norm", "batch-size"} <= set(c["data"]) for c in logs if "lm loss" in c["data"])


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="the tensorboard package is not installed")
def test_tensorboard_events_hold_megatron_lm_scalars(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, val, _ = summary_of(logged_run["out"])
    events = EventAccumulator(str(logged_run["root"] / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "lm loss vs samples", "learning-rate", "grad-norm", "batch-size", "loss-scale",
            "lm loss validation"} <= tags
    assert {e.step: e.value for e in events.Scalars("lm loss")} == pytest.approx(train, rel=1e-6)
    assert {e.step: e.value for e in events.Scalars("lm loss validation")} == pytest.approx(val, rel=1e-6)


# refused by the checks before any rank starts: in this process

def test_a_missing_wandb_is_named_before_training(tmp_path, monkeypatch):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    started = record_rank_starts(monkeypatch)
    done = train_here(*TINY, "--steps", "2", "--output-dir", tmp_path / "run", "--wandb-project", "p")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "megatron-siamese train: error: --wandb-project p needs the wandb package, which is not installed: "
        "pip install wandb (or leave the flag out)"]
    assert not (tmp_path / "run").exists() and started == []  # before training: before any rank started


@pytest.mark.skipif(HAS_TENSORBOARD, reason="the tensorboard package is installed here")
def test_a_missing_tensorboard_is_named_before_training(tmp_path, monkeypatch):
    started = record_rank_starts(monkeypatch)
    done = train_here(*TINY, "--steps", "2", "--output-dir", tmp_path / "run", "--tensorboard-dir", tmp_path / "tb")
    assert done.returncode == 2 and "pip install tensorboard" in done.stderr
    assert not (tmp_path / "run").exists() and started == []


# -- resume: the metrics file goes on, every step once -----------------------------------

def test_a_resume_appends_to_the_metrics_and_drops_the_steps_it_runs_again(tmp_path, corpus_cache):
    out = tmp_path / "run"
    first = train_here(*TINY, "--steps", "6", "--stop-step", "5", "--save-interval", "2", "--log-interval", "2",
                       "--cache-dir", corpus_cache, "--output-dir", out)
    assert first.returncode == 0, first.stderr[-3000:]
    first_train, first_val, _ = summary_of(out)
    lines = iteration_lines(first.stdout)
    assert sorted(lines) == [2, 4]  # every --log-interval steps, each the mean over its interval
    assert float(lines[4]["lm loss"]) == pytest.approx((first_train[3] + first_train[4]) / 2, rel=1e-6)
    assert sorted(first_val) == [3, 5]
    # resumed from step 4: steps 5 and on run again and replace what the first run logged of them
    second = train_here(*TINY, "--steps", "6", "--load", out / "checkpoints" / "iter_0000004", "--log-interval", "2",
                        "--cache-dir", corpus_cache, "--output-dir", out)
    assert second.returncode == 0, second.stderr[-3000:]
    second_train, second_val, _ = summary_of(out)
    assert sorted(second_train) == [5, 6]
    entries = read_jsonl(out / "metrics.jsonl")
    steps = [e["step"] for e in entries if "loss" in e]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert {e["step"]: e["loss"] for e in entries if "loss" in e} == {
        **{s: first_train[s] for s in range(1, 5)}, **second_train}
    assert [(e["step"], e["val_loss"]) for e in entries if "val_loss" in e] == [(3, first_val[3]), (6, second_val[6])]


# -- the console: which of the bar and the lines ---------------------------------------

@pytest.mark.stack_independent
def test_the_console_flags():
    def shown(terminal, **flags):
        mode = console(TrainArgs(steps=300, **flags), terminal)
        return mode.bar, mode.log_interval

    assert shown(True) == (True, None) and shown(False) == (False, 30)
    assert console(TrainArgs(steps=5000), False).log_interval == 100  # Megatron-LM's default
    assert shown(True, log_interval=7) == (False, 7) and shown(False, log_interval=7) == (False, 7)
    assert shown(False, progress=True) == (True, None) and shown(True, progress=True, log_interval=7) == (True, 7)
    assert shown(True, progress=False) == (False, None) and shown(False, progress=False) == (False, None)
    assert shown(False, progress=False, log_interval=7) == (False, 7)


def test_a_terminal_gets_the_bar_and_no_lines(tmp_path, corpus_cache):
    leader, follower = pty.openpty()
    process = subprocess.Popen([*CLI, "train", *TINY, "--steps", "3", "--cache-dir", corpus_cache, "--output-dir",
                                tmp_path / "run"], stdout=follower, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    os.close(follower)
    try:
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed: the run is done
                break
            if not chunk:
                break
            shown += chunk
        err = process.communicate(timeout=300)[1]
    finally:  # whatever happened: nothing of the run is left (its launcher's session: the fork server too)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        os.close(leader)
    assert process.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert len(re.findall(r"\s0%\|", err)) == 1 and "100%|" in err  # one bar, on stderr
    assert b" iteration " not in shown and b"validation loss" not in shown
    assert b"final train loss" in shown and (tmp_path / "run" / "metrics.jsonl").exists()

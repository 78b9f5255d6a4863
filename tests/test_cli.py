"""The command line as a user drives it: exit codes, what is printed, and what is refused and how.
Subprocesses (``cli``) where the process is what is tested (its exit status and output, its
imports); the command's ``main`` in this process (``cli_here``) for what it decides and does with
a checkpoint, on the session's ``trained_run``."""

import argparse
import shutil

import pytest
from cli_runs import cli, cli_here, record_rank_starts

from megatron_siamese.cli import build_parser


@pytest.fixture
def rank_starts(monkeypatch):
    return record_rank_starts(monkeypatch)


def assert_refused(done, *messages):
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout
    for message in messages:
        assert message in done.stderr, done.stderr


# -- bad input ---------------------------------------------------------------------------

# plan checks the model and layout settings before anything runs (train is Megatron-LM's parser)
BAD_INPUT = {
    "no micro-batch": (["plan", "--micro-batch-size", "0"], "--micro-batch-size must be at least 1 (got 0)"),
    "negative layers": (["plan", "--num-layers", "-5"], "must be at least 1 (got -5)"),
    "a model without its width": (["plan", "--num-layers", "24", "--hidden-size", "1024"],
                                  "--num-layers given, so the model is the command line's and Megatron-LM needs "
                                  "--num-attention-heads, --seq-length, --max-position-embeddings, "
                                  "--micro-batch-size with it"),
    "fp16": (["check", "--dtype", "fp16"], "fp16 is not supported"),
    "tp3 over 4 heads": (["plan", "--tp", "3"], "--num-attention-heads 4 does not split over --tp 3"),
    "megatron's name": (["plan", "--tensor-model-parallel-size", "3"], "does not split over --tp 3"),
    "pp3 over 4 layers": (["plan", "--pp", "3"], "--num-layers 4 does not split over 3 pipeline stages"),
    "unknown scheme": (["plan", "--norm", "foo"], "invalid choice: 'foo'"),
    "a flag misspelled": (["check", "--num-layer", "4"], "arguments: --num-layer 4 (--num-layer: did you mean --num-layers?)"),
    "a required flag misspelled": (["generate", "--promt", "hi", "--load", "x"],
                                   "required: --prompt (--promt: did you mean --prompt?)"),
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
def test_a_usage_error_of_plan_names_no_typo_among_the_flags_it_passes_on():
    """Megatron-LM's flags, which plan (and train) pass on to its parser, are no typos of plan's own."""
    done = cli("plan", "--norm", "foo", "--max-position-embeddings", "128", "--moe-router-dtype", "fp32")
    assert_refused(done, "argument --norm: invalid choice: 'foo'")
    assert "did you mean" not in done.stderr, done.stderr


def test_no_prefix_matching_of_flags_save_int_is_not_save_interval():
    """Refused on every stack; from 0.17 plan asks Megatron-LM's parser which flags are its own
    (which imports Megatron), before that it decides before torch or Megatron is imported."""
    from megatron_siamese.versions import ships_megatron_training

    done = cli_recording_imports("plan", "--save-int", "5")
    assert_refused(done, "megatron-siamese plan: error: unrecognized arguments: --save-int 5")
    if not ships_megatron_training():
        assert_decided_before_torch_and_megatron(done)


@pytest.mark.stack_independent
def test_every_problem_is_listed_at_once():
    done = cli("plan", "--global-batch-size", "0", "--tp", "3", "--pp", "3")
    problems = ["--global-batch-size must be at least 1", "--num-attention-heads 4 does not split over --tp 3",
                "the MLP width 320 (--ffn-hidden-size) does not split over --tp 3",  # SwiGLU: Megatron-LM's 2/3 of 4h
                "--num-layers 4 does not split over 3 pipeline stages"]  # the vocabulary: padded as Megatron-LM pads it, it splits
    assert_refused(done, *problems)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == len(problems) and all(line.startswith("megatron-siamese plan: error: ") for line in lines)
    assert all(sum(problem in line for line in lines) == 1 for problem in problems)  # one line per problem


@pytest.mark.parametrize("command", ["plan", "check"])
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
    return build_parser()._subparsers._group_actions[0].choices[name]


@pytest.mark.stack_independent
def test_megatron_names_are_accepted_beside_the_short_ones():
    options = subparser("plan").parse_args(
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--seq-length", "64",
         "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--bf16", "--sequence-parallel",
         "--use-distributed-optimizer", "--num-virtual-stages-per-pipeline-rank", "2", "--disable-bias-linear"])
    assert (options.tp, options.pp, options.micro_batch_size, options.global_batch_size,
            options.seq_length, options.dtype, options.sp, options.distributed_optimizer,
            options.vpp, options.add_bias_linear) == (2, 2, 1, 4, 64, "bf16", True, True, 2, False)
    short = subparser("plan").parse_args(["--tp", "2", "--pp", "2", "--dp", "4", "--sp"])
    assert (short.tp, short.pp, short.dp, short.sp) == (2, 2, 4, True)


@pytest.mark.stack_independent
@pytest.mark.parametrize("command", ["check", "plan", "study", "upcycle", "analyze", "generate", "export",
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
        # shows none: its field's default would read as the flag's; nor does one without a default (required,
        # or None: "(default: None)" said nothing); every other flag shows one, once
        sets_other_value = isinstance(action, argparse._StoreFalseAction) or (
            type(action) is argparse._StoreConstAction and not isinstance(action.const, bool))
        none = sets_other_value or ("default:" not in action.help and (action.required or action.default is None))
        assert shown.count("default:") == (0 if none else 1), (command, action.option_strings, shown)


@pytest.mark.stack_independent
@pytest.mark.parametrize("command", ["upcycle", "analyze"])
def test_a_checkpoints_command_leads_with_its_own_flags_not_the_models(command):
    """Its usage names the checkpoint and the output, not the 45 model flags only a checkpoint that records
    no settings needs (they filled 45 lines), and its description says when those apply."""
    help_text = subparser(command).format_help()
    usage, description = help_text.split("\n\n")[:2] if help_text.count("\n\n") else (help_text, "")
    assert usage.startswith(f"usage: megatron-siamese {command} --load CHECKPOINT") and len(usage.splitlines()) == 1
    assert "--num-layers" not in usage and "--num-layers" in help_text
    assert "checkpoint that records no settings" in " ".join(help_text.split())


@pytest.mark.stack_independent
def test_a_stopped_train_says_whether_its_ranks_saved_on_the_signal(tmp_path):
    """Only Megatron's --exit-signal-handler, on its --exit-signal (SIGTERM unless given), with --save, saves
    before the ranks stop: Ctrl-C said it did, and nothing was saved. Where it saves, the line names the
    newest checkpoint the ranks recorded."""
    import signal

    from megatron_siamese.cli.train import saving_note

    saves = " (under --exit-signal-handler each finishes its iteration and saves a checkpoint first; "
    assert saving_note(signal.SIGTERM, ["--exit-signal-handler", "--save", str(tmp_path)]) == \
        saves + f"none is recorded in {tmp_path})"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("130")
    assert saving_note(signal.SIGTERM, ["--exit-signal-handler", "--save", str(tmp_path)]) == \
        saves + f"the newest in {tmp_path}: iteration 130)"
    assert saving_note(signal.SIGUSR1, ["--exit-signal-handler", "--exit-signal", "SIGUSR1", f"--save={tmp_path}"]) \
        == saves + f"the newest in {tmp_path}: iteration 130)"
    assert saving_note(signal.SIGINT, ["--exit-signal-handler", "--save", "ckpt"]) == \
        "; no checkpoint was saved on it (--exit-signal-handler saves one on SIGTERM first)"
    # Ctrl-C: what was saved before it, and how to go on from there
    assert saving_note(signal.SIGINT, ["--save", str(tmp_path)]).endswith(
        f"; the newest checkpoint in {tmp_path} is iteration 130: add --load {tmp_path} to resume from it")
    assert saving_note(signal.SIGINT, ["--save", str(tmp_path), "--load", str(tmp_path)]).endswith(
        f"; the same command resumes from iteration 130, the newest checkpoint in {tmp_path}")
    assert saving_note(signal.SIGTERM, ["--save", "ckpt"]).startswith("; no checkpoint was saved")
    assert saving_note(signal.SIGTERM, ["--exit-signal-handler"]).endswith("; without --save nothing is saved)")


def test_subcommands_list_only_their_own_flags():
    from megatron_siamese.versions import ships_megatron_training

    done = cli("train", "--help")
    assert done.returncode == 0 and done.stderr == ""  # no Megatron notices for a help text
    assert "--nproc-per-node" in done.stdout and "--compare" in done.stdout
    if ships_megatron_training():  # then Megatron-LM's flags, ours among them
        assert "--train-iters" in done.stdout and "--tensor-model-parallel-size" in done.stdout
        assert "SiameseNorm (megatron_siamese)" in done.stdout and "--norm" in done.stdout
    else:  # and what it needs
        assert "needs megatron-core >= 0.17" in done.stdout and "--train-iters" not in done.stdout
    for command in ("upcycle", "analyze"):
        text = subparser(command).format_help()
        assert "--load" in text and "--hidden-size" in text
        assert "--train-iters" not in text and "--tensor-model-parallel-size" not in text and "--lr" not in text


# -- checkpoints: a broken one is named, with the complete ones to load instead ---------------
# On the session's trained_run (Megatron-LM's loop; checkpoints at steps 2 and 4), in this process.

CORRUPTIONS = {
    "truncated shard": ("__0_0.distcp", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "is truncated"),
    "empty common.pt": ("common.pt", lambda p: p.write_bytes(b""), "is empty"),
    "garbage metadata.json": ("metadata.json", lambda p: p.write_text("{not json"), "is not valid JSON"),
    "garbage .metadata": (".metadata", lambda p: p.write_bytes(b"garbage"), "cannot be read"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_a_broken_checkpoint_is_named_with_the_steps_to_load_instead(tmp_path, trained_run, name, rank_starts):
    filename, corrupt, what = CORRUPTIONS[name]
    if not (trained_run / "checkpoints" / "iter_0000004" / filename).exists():
        pytest.skip(f"this megatron-core writes no {filename} (from 0.19 the common state is one of the shards)")
    shutil.copytree(trained_run, tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    corrupt(checkpoints / "iter_0000004" / filename)
    for load in (checkpoints, checkpoints / "iter_0000004"):  # through the tracker, and named directly
        done = cli_here("export", "--load", load, "--output-dir", tmp_path / "hf")
        assert_refused(done, f"{checkpoints / 'iter_0000004' / filename}", what,
                       f"complete checkpoints in {checkpoints}: iter_0000002 (pass one to --load)")
    assert rank_starts == [] and not (tmp_path / "hf").exists()


# -- output ------------------------------------------------------------------------------

def test_check_prints_its_table_and_little_else():
    done = cli("check", "--layouts", "tp2,pp2", "--num-layers", "2")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip().splitlines()) == 6  # title, tolerance, header, two rows, total
    assert done.stderr == ""

"""``megatron-siamese train``: Megatron's own training loop with our layer (megatron_siamese/runtime/pretrain.py),
on CPU, under torchrun and starting its own ranks: TP, PP (with experts and multi-token prediction), DP and CP
layouts of GPTModel and a PP HybridModel train (CP's losses those of DP); a TP 2 run saved and resumed logs the
losses of the run it interrupted; what it saves, export and generate read; megatron-core 0.16.1, whose wheel has
no megatron.training, refuses runtime.pretrain by version."""

import importlib.util
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from cli_runs import train_here
from megatron_siamese.runtime.loss_curve import read_losses
from megatron_siamese.versions import installed_megatron_core


def has_megatron_training() -> bool:
    """megatron.training as the 0.17+ wheel ships it (a 0.16 Megatron-LM tree's has no argument_utils)."""
    try:
        return importlib.util.find_spec("megatron.training.argument_utils") is not None
    except ModuleNotFoundError:
        return False


HAS_TRAINING = has_megatron_training()
needs_training = pytest.mark.skipif(not HAS_TRAINING, reason="megatron-core < 0.17: no megatron.training")
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
         "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "1000"]
MOCK_DATA = ["--mock-data", "--vocab-size", "512"]
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
VALIDATION = re.compile(r"validation loss at iteration \d+ on validation set \| lm loss value: ([0-9.E+-]+)")


def pretrain(*flags, ranks=2, cache=None, expect_failure=False, launcher="here"):
    """``megatron-siamese train`` with ``flags``, its output: its ranks started as the command starts them,
    from this process (``launcher="here"``: where the launch is not the subject), by the command
    itself (``"cli"``), or as ranks of a torchrun job (``"torchrun"``)."""
    environment = {"MEGATRON_SIAMESE_CACHE": cache} if cache else {}
    if launcher == "here":
        done = train_here(*MODEL, *flags, ranks=ranks, env=environment)
    else:
        # --standalone: the rendezvous on a port the kernel picks as it listens (a port picked first was
        # taken meanwhile by another job once: EADDRINUSE)
        command = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                    "-m", "megatron_siamese.cli", "train"] if launcher == "torchrun" else
                   [sys.executable, "-m", "megatron_siamese.cli", "train", "--nproc-per-node", str(ranks)])
        done = subprocess.run([*command, *MODEL, *flags], capture_output=True, text=True, timeout=300,
                              env={**os.environ, **environment})
    output = done.stdout + done.stderr
    if expect_failure:  # True: any failure; a number: that exit status
        assert done.returncode != 0 if expect_failure is True else done.returncode == expect_failure, \
            (done.returncode, output[-6000:])
    else:
        assert done.returncode == 0, output[-6000:]
    return output


def losses(log):
    return {int(step): loss for step, loss in ITERATION.findall(log)}


@needs_training
def test_pp2_with_experts_and_multi_token_prediction_trains_in_megatrons_loop():
    """The block spec follows the flags as Megatron's own does: MoE every other layer, an MTP block."""
    # --distributed-backend given as --flag=value: not added (torchrun's ranks: the DP 2 and restart tests)
    log = pretrain("--train-iters", "2", "--distributed-backend=gloo", "--pipeline-model-parallel-size", "2",
                   "--num-layers", "4", "--num-experts", "4", "--moe-layer-freq", "2", "--mtp-num-layers", "1",
                   "--position-embedding-type", "rope", "--disable-bias-linear", *MOCK_DATA)
    assert "no GPU, so on CPU with --transformer-impl local --no-persist-layer-norm" in log
    assert "one_logger (NVIDIA's internal metrics package) is not installed, so --no-one-logger" in log
    assert "confluence.nvidia.com" not in log  # Megatron-LM's pointer to install it, inside NVIDIA only
    assert sorted(losses(log)) == [1, 2] and all(0 < float(loss) < 7 for loss in losses(log).values())
    assert "load_balancing_loss:" in log and "mtp_1 loss:" in log
    assert "PP>1 sends [s, b, 2h] between stages" in log  # our layers, not Megatron's stock ones
    assert log.count("-------------------- end of arguments") == 1
    assert log.count("train: the streams' norms and residuals on cpu: the fused C++ ops, joined by the boundary "
                     "ops\n") == 1  # said once, by rank 0


def untrained(loss: str) -> bool:
    """About the entropy of a uniform draw over the model's vocabulary: the corpus's 258 ids padded
    to Megatron's multiple of 128."""
    return abs(float(loss) - math.log(math.ceil(258 / 128) * 128)) < 0.3


@needs_training
def test_hybrid_model_pp2_trains_in_megatrons_loop(corpus_cache):
    log = pretrain("--train-iters", "2", "--num-layers", "4", "--hybrid-layer-pattern", "*-|*-",
                   "--pipeline-model-parallel-size", "2", "--position-embedding-type", "rope", "--no-fused-ops",
                   cache=corpus_cache)
    assert "PP>1 sends [s, b, 2h] between stages" in log  # our stack's layers, not Megatron's stock ones
    assert "the streams' norms and residuals on cpu: PyTorch's ops, the same function unfused (--no-fused-ops " \
           "given)" in log
    assert sorted(losses(log)) == [1, 2] and all(untrained(loss) for loss in losses(log).values())


@needs_training
def test_dp2_and_cp2_train_alike_on_the_embedded_corpus_without_data_flags(corpus_cache):
    """One global batch, no dropout: DP 2 (each rank half the samples) and CP 2 (each rank two
    chunks of every sequence, Megatron's split) must log one loss curve."""
    common = ("--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0",
              "--position-embedding-type", "rope")
    dp2 = pretrain(*common, cache=corpus_cache, launcher="torchrun")
    assert "no data source given, so the embedded corpus: --data-path " + corpus_cache in dp2
    assert "--tokenizer-type NullTokenizer --vocab-size 258 --null-tokenizer-eod-id 256" in dp2
    assert "Overriding default arguments" not in dp2  # the tokenizer given, not also defaulted
    assert sorted(losses(dp2)) == [1, 2, 3] and untrained(losses(dp2)[1])
    # and reading the corpus without mmap (a dataset flag Megatron-LM's script passes on) changes nothing
    cp2 = pretrain(*common, "--context-parallel-size", "2", "--no-mmap-bin-files", cache=corpus_cache)
    assert "mmap_bin_files=False" in cp2 and "mmap_bin_files=True" in dp2
    assert losses(cp2)[3] != losses(cp2)[1]  # it trains
    for step in (1, 2, 3):
        assert float(losses(cp2)[step]) == pytest.approx(float(losses(dp2)[step]), rel=1e-5), step
    refused = pretrain("--train-iters", "1", "--tokenizer-type=GPT2BPETokenizer", ranks=1, cache=corpus_cache,
                       expect_failure=True)
    assert "byte tokens, read with --tokenizer-type NullTokenizer --vocab-size 258" in refused
    assert "got --tokenizer-type GPT2BPETokenizer" in refused
    unfollowed = pretrain("--train-iters", "1", "--qk-l2-norm", ranks=1, cache=corpus_cache, expect_failure=True)
    assert "does not follow --qk-l2-norm yet" in unfollowed
    # a tokenizer's files without the --tokenizer-type that reads them: NullTokenizer's TypeError in Megatron-LM's
    # parser before; and NullTokenizer without --vocab-size
    for data, said in ((["--vocab-file", "vocab.json", "--merge-file", "merges.txt"], "--vocab-file, --merge-file name "
                        "a tokenizer's files, which only the --tokenizer-type that reads them uses (GPT2BPETokenizer"),
                       ([], "--tokenizer-type NullTokenizer (the default here: token ids taken as they are) needs "
                            "--vocab-size")):
        untyped = pretrain("--train-iters", "1", "--mock-data", *data, ranks=1, expect_failure=2)
        assert said in untyped and "Traceback" not in untyped, untyped[-3000:]


@needs_training
def test_the_loss_is_validated_as_megatron_lms_is():
    """Megatron's rerun state machine, told to inject a persistent fault into every validated result,
    finds it in our loss function's NaN check and stops the job (nothing would be injected unless
    the loss function asked the machine to validate the loss)."""
    log = pretrain("--train-iters", "3", "--error-injection-rate", "1", "--error-injection-type", "persistent_error",
                   *MOCK_DATA, ranks=1, expect_failure=True)
    assert "Injecting error type Persistent error" in log
    assert "message='found NaN in local forward loss calculation'" in log


@needs_training
def test_the_closing_loss_is_the_mean_megatrons_last_log_line_gives(tmp_path):
    """Megatron's log line averages the iterations since the last one; TensorBoard, which the closing line
    reads, holds each iteration's own loss (the line showed the last iteration's, beside a log line that
    said another)."""
    from megatron_siamese.runtime.pretrain import _last_logged_loss

    train = {step: 1 + 1 / step for step in range(1, 26)}  # stopped at 25: Megatron logged 11-20 last
    assert _last_logged_loss(train, 10) == f"iterations 11-20: mean lm loss {sum(train[s] for s in range(11, 21)) / 10:.4f}"
    assert _last_logged_loss(train, 1) == f"iteration 25: lm loss {train[25]:.4f}"
    assert _last_logged_loss({5: 2.0, 6: 3.0}, 100) == "iterations 5-6: mean lm loss 2.5000"  # none logged
    # --compare's table gives the same window (it gave the last iteration's loss beside that line)
    from torch.utils.tensorboard import SummaryWriter

    from megatron_siamese.runtime import scheme_comparison

    board = tmp_path / "board"
    for norm, offset in (("pre", 0.0), ("siamese", 0.5)):
        with SummaryWriter(str(board / norm)) as writer:
            for step, loss in train.items():
                writer.add_scalar("lm loss", loss + offset, step)
    rows = scheme_comparison.table(str(board), ["pre", "siamese"], 10).splitlines()
    mean = sum(train[s] for s in range(11, 21)) / 10
    assert [row.split() for row in rows[1:3]] == [["pre", "11-20", f"{mean:.4f}", "-"],
                                                  ["siamese", "11-20", f"{mean + 0.5:.4f}", "-"]], rows


@needs_training
def test_logged_activations_are_the_forward_values_not_what_the_loss_wrote_into_them(monkeypatch):
    """--save-activations-interval on CPU: its hooks' module types held TE's MagicMocks (a TypeError at the
    first logged step), and it keeps each output as ``.cpu()``, a copy from a GPU, on CPU the tensor itself,
    which the cross entropy overwrites in place (the logits became the loss's gradient)."""
    from megatron.training.activation_logging import ActivationLogger

    for name in ("TORCHDYNAMO_DISABLE", "CUDA_DEVICE_MAX_CONNECTIONS"):  # what its import sets, for later tests
        monkeypatch.setenv(name, os.environ.get(name, ""))
    from megatron_siamese.runtime import megatron_lm

    megatron_lm._activation_and_dgrad_logging_on_cpu()
    model, inputs = torch.nn.Sequential(torch.nn.Linear(4, 3)), torch.randn(2, 4)
    logger = ActivationLogger("unused")
    logger.register_activation_hooks([model])
    logits = model(inputs)
    forward = logits.detach().clone()
    with torch.no_grad():
        logits.sub_(logits.max())  # as vocab_parallel_cross_entropy does, in place
    assert torch.equal(logger._activations_state_dict["model_chunk0"]["0/output0"], forward)


@pytest.mark.stack_independent
def test_a_resume_megatron_cannot_load_is_told_what_to_change():
    """Another --lr than the checkpoint's optimizer: Megatron's load raises a ValueError of many lines (its
    parameter groups are keyed by the rates); a longer --train-iters trips its schedule's bare assert (the
    command test above). Each becomes one line with the ways on; any other failure stays itself."""
    from megatron_siamese.runtime.pretrain import resume_problem

    said = resume_problem(ValueError("Could not find parameter group with key (None, 0.005, 0.0002) in loaded "
                                     "checkpoint.\nAvailable keys:\n(None, 0.002, 0.0002)"), "ck")
    assert said.startswith("--load ck: its optimizer was saved with another --lr") and "--no-load-optim" in said
    # Megatron's words for another schedule, its warmup in samples (50 iterations' tenth x 16 sequences = 80)
    said = resume_problem(AssertionError("OptimizerParamScheduler: class input value 80.0 and checkpointvalue 48.0 "
                                         "for warmup iterations do not match"), "ck")
    assert "(warmup iterations, which Megatron's scheduler counts in samples (iterations x global batch): 80.0 from " \
        "these flags, 48.0 in the checkpoint)" in said and "--override-opt_param-scheduler" in said
    # a finished run resumed with another --eval-interval: the validation sampler's bare position check
    said = resume_problem(AssertionError("no samples left to consume: 2560, 536"), "ck")
    assert said.startswith("--load ck: its data position is past the datasets these flags make") and \
        "--eval-interval" in said
    for other in (ValueError("another"), AssertionError("another")):
        with pytest.raises(type(other), match="another"):
            resume_problem(other, "ck")


@pytest.mark.stack_independent
def test_the_loss_curve_follows_the_last_timeline(tmp_path):
    """Event files in order: a later one (a resumed run's) replaces the points from its first trained
    iteration on, one that only evaluated adds what is not there; within one, an iteration's first
    validation value (the validation set's, before the test set's under the same tag) is kept."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    def run(name, steps, validated_at, offset):
        with SummaryWriter(str(tmp_path / name)) as writer:
            for step in steps:
                writer.add_scalar("lm loss", step + offset, step)
            writer.add_scalar("lm loss validation", 100.0 + offset, validated_at)  # validation set
            writer.add_scalar("lm loss validation", -1.0, validated_at)  # then the test set
        (event,) = (tmp_path / name).iterdir()
        event.rename(tmp_path / f"events.out.tfevents.{name}")

    run("1-first", range(1, 7), validated_at=6, offset=0.0)
    run("2-resumed-from-3", range(4, 9), validated_at=8, offset=0.5)
    train, validation = read_losses(str(tmp_path))
    assert train == {step: step + (0.5 if step >= 4 else 0.0) for step in range(1, 9)}
    assert validation == {8: 100.5}  # the first run's at 6 was overtaken by the resumed run
    run("3-started-again", range(1, 3), validated_at=2, offset=0.25)
    assert read_losses(str(tmp_path)) == ({1: 1.25, 2: 2.25}, {2: 100.25})
    # a requeue with nothing left to train: its evaluation adds a point, and keeps the loop's own
    run("4-evaluated-only", range(0), validated_at=2, offset=0.75)
    run("5-evaluated-only", range(0), validated_at=3, offset=0.5)
    assert read_losses(str(tmp_path)) == ({1: 1.25, 2: 2.25}, {2: 100.25, 3: 100.5})


CLI = [sys.executable, "-m", "megatron_siamese.cli", "train"]
SCHEDULE_FLAGS = ("--micro-batch-size", "--global-batch-size", "--lr", "--log-interval", "--eval-iters", "--eval-interval")
TP2_TB = ["--tensor-model-parallel-size", "2", "--train-iters", "10", *MOCK_DATA]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each iteration's loss and the validation loss (TensorBoard's) of the TP 2 run the interrupted
    ones are compared with."""
    board = tmp_path_factory.mktemp("whole")
    pretrain(*TP2_TB, "--tensorboard-dir", str(board))
    return read_losses(str(board))


@needs_training
def test_a_requeued_run_resumes_the_run_it_interrupted_at_any_tp_and_refuses_another_scheme(tmp_path, uninterrupted):
    """TP 2 with dropout, the same command twice (a requeue: --save X --load X, X empty at first):
    saved at 4 (asynchronously, by Megatron's persistent worker: on CPU it gets the CPU shim,
    runtime/cpu_checkpoint_worker.py) and stopped, then resumed to the end: each iteration's loss in
    TensorBoard, and the validation loss, are to the bit the uninterrupted run's. The checkpoint then
    loads at TP 1 (its validation loss that of TP 2) and trains on; a run of another scheme is
    refused by name."""
    tp2 = [*TP2_TB, "--tensorboard-dir", str(tmp_path / "tb")]
    requeue = ["--save", str(tmp_path), "--load", str(tmp_path), "--save-interval", "4", "--async-save",
               "--use-persistent-ckpt-worker", "--async-strategy", "mcore"]  # Megatron's async save, as it allows it here
    first = pretrain(*tp2, *requeue, "--exit-interval", "4")
    assert "successfully loaded checkpoint" not in first and sorted(losses(first)) == [1, 2, 3, 4]
    assert re.search(r"scheduled an async checkpoint save at iteration +4 ", first)
    resumed = pretrain(*tp2, *requeue)
    assert "successfully loaded checkpoint" in resumed
    assert sorted(losses(resumed)) == [5, 6, 7, 8, 9, 10]
    # the loss curve of the whole run, stopped and resumed, from Megatron's TensorBoard events: each
    # iteration's own loss (Megatron logs the second line after a start as two iterations' mean)
    assert f"loss curve {tmp_path / 'tb' / 'loss.png'} (iteration 4:" in first
    assert f"loss curve {tmp_path / 'tb' / 'loss.png'} (iteration 10:" in resumed
    assert (tmp_path / "tb" / "loss.png").read_bytes().startswith(b"\x89PNG")
    train, validation = read_losses(str(tmp_path / "tb"))
    assert (train, validation) == uninterrupted and sorted(validation) == [10]
    assert validation[10] == pytest.approx(float(VALIDATION.findall(resumed)[-1]), rel=1e-6)  # not the test set's
    assert train[5] == pytest.approx(float(losses(resumed)[5]), rel=1e-6)
    # TP 2's checkpoint at TP 1: the same weights (the validation loss), and training goes on
    tp1 = ["--tensor-model-parallel-size", "1", *MOCK_DATA, "--load", str(tmp_path)]
    evaluated = pretrain(*tp1, "--train-iters", "10", "--skip-train", ranks=1)
    assert float(VALIDATION.findall(evaluated)[0]) == pytest.approx(float(VALIDATION.findall(resumed)[0]), rel=1e-5)
    # trained on, its model read from the checkpoint (Megatron-LM's --use-checkpoint-args: no model flags,
    # none of the embedded job's), the schedule overridden (Megatron's flag)
    schedule = [word for flag in zip(MODEL[::2], MODEL[1::2]) if flag[0] in SCHEDULE_FLAGS for word in flag]
    longer = train_here(*tp1, "--use-checkpoint-args", *schedule, "--train-iters", "12",
                        "--override-opt_param-scheduler", ranks=1)
    assert longer.returncode == 0, longer.stdout[-3000:]
    assert "--use-checkpoint-args given, so nothing of the embedded default job" in longer.stdout
    assert sorted(losses(longer.stdout)) == [11, 12]
    refused = pretrain(*tp1, "--train-iters", "12", "--norm", "pre", ranks=1, expect_failure=True)
    assert (f"--load {tmp_path} holds another model than this run builds (--norm siamese -> pre; checkpoint -> this "
            "run)") in refused


@needs_training
def test_an_upcycled_checkpoint_evaluates_as_pre_norm_and_trains_on_in_megatrons_loop(tmp_path, corpus_cache):
    """The route docs/research.md gives from a Pre-Norm run to SiameseNorm, on Megatron-LM's loop:
    it trains Pre-Norm, upcycle writes a model-only checkpoint computing the same function, and the
    loop evaluates that (the Pre-Norm model's validation loss, far from a uniform guess) and trains
    it on. Megatron-LM's loader asks such a checkpoint for an optimizer state (KeyError
    'optimizer'): the run gives itself --no-load-optim, and says so."""
    corpus = ["--tensor-model-parallel-size", "1", "--train-iters", "20"]
    pre = tmp_path / "pre"
    trained_pre = pretrain(*corpus, "--norm", "pre", "--lr", "1e-2", "--save", str(pre), "--save-interval", "20",
                           ranks=1, cache=corpus_cache)
    pre_loss = float(VALIDATION.findall(trained_pre)[0])  # after its last step: the weights it saved
    assert pre_loss < math.log(512) - 1  # trained: a model that lost its weights would not be near it
    loaded_as_is = pretrain(*corpus, "--load", str(pre), ranks=1, cache=corpus_cache, expect_failure=True)
    assert f"a Pre-Norm checkpoint becomes an equivalent SiameseNorm one through `megatron-siamese upcycle --load " \
        f"{pre} --output-dir DIR`" in loaded_as_is  # the way on, where SiameseNorm is refused its weights
    upcycled = subprocess.run([sys.executable, "-m", "megatron_siamese.cli", "upcycle", "--load", str(pre),
                               "--output-dir", str(tmp_path / "up")], capture_output=True, text=True, timeout=300)
    assert upcycled.returncode == 0, upcycled.stderr[-3000:]
    checkpoint = str(tmp_path / "up" / "checkpoints")
    from megatron_siamese.inference.session import read_checkpoint

    assert read_checkpoint(checkpoint).vocab_size == read_checkpoint(str(pre)).vocab_size == 384  # Megatron's padding
    evaluated = pretrain(*corpus, "--load", checkpoint, "--skip-train", ranks=1, cache=corpus_cache)
    assert float(VALIDATION.findall(evaluated)[0]) == pytest.approx(pre_loss, rel=2e-3)
    trained = pretrain(*corpus, "--load", checkpoint, "--save", str(tmp_path / "siamese"), "--save-interval", "20",
                       ranks=1, cache=corpus_cache)
    assert (f"--load {checkpoint} holds model weights only (upcycle, import-hf), so --no-load-optim: a fresh "
            "optimizer from its weights") in trained
    assert sorted(losses(trained)) == list(range(1, 21)) and (tmp_path / "siamese" / "iter_0000020").is_dir()


def interrupted(command, when: str, action, log_file) -> tuple:
    """``command`` run until its output has a line matching ``when``, then ``action(process)``; its exit
    status and output. The output goes to a file, not a pipe: a SIGKILLed rank's helpers (its data
    loader's workers, Megatron's checkpoint worker) outlive it and would hold a pipe open; they are
    of the command's process group, which is killed at the end."""
    import time

    with open(log_file, "w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not re.search(when, open(log_file).read()):
            assert process.poll() is None and time.monotonic() < deadline, open(log_file).read()[-3000:]
            time.sleep(0.05)
        action(process)
        return process.wait(timeout=240), open(log_file).read()
    finally:
        try:
            os.killpg(process.pid, 9)
        except ProcessLookupError:
            pass


@needs_training
def test_sigterm_saves_under_the_exit_signal_handler_and_the_resume_is_bitwise_the_uninterrupted_run(
        tmp_path, uninterrupted):
    """SIGTERM to the command's process group (as a scheduler or `timeout` sends it: to the launcher, the
    server its ranks fork from, the ranks and their data loaders alike): every rank finishes its iteration
    and saves (Megatron's --exit-signal-handler); the same command resumes, and each iteration's loss in
    TensorBoard is, to the bit, the uninterrupted run's."""
    import signal
    command = [*CLI, *MODEL, *TP2_TB, "--tensorboard-dir", str(tmp_path / "tb"), "--save", str(tmp_path / "ckpt"),
               "--load", str(tmp_path / "ckpt"), "--save-interval", "100", "--exit-signal-handler"]
    signalled = []
    status, log = interrupted(command, r"iteration\s+3/",
                              lambda process: signalled.append(time.monotonic()) or os.killpg(process.pid, signal.SIGTERM),
                              tmp_path / "log")
    assert status == 128 + signal.SIGTERM, log[-3000:]
    # the ranks end once saved (cli/train.py, end_on_the_signal_soon): not killed by torch's agent 30 s on
    assert time.monotonic() - signalled[0] < 25
    assert "megatron-siamese train: stopped by SIGTERM, which every rank was sent" in log
    assert "Traceback" not in log, log[-3000:]
    saved = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= saved < 10 and sorted(losses(log)) == list(range(1, saved + 1))
    # the seconds before the agent's line said, and the checkpoint it ends on named
    assert "megatron-siamese train: SIGTERM noted; the loop has ended (saving first, with --save)" in log
    assert f"the newest in {tmp_path / 'ckpt'}: iteration {saved})" in log
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and sorted(losses(resumed.stdout)) == list(range(saved + 1, 11))
    stopped_and_resumed, _ = read_losses(str(tmp_path / "tb"))
    assert stopped_and_resumed == uninterrupted[0] and sorted(uninterrupted[0]) == list(range(1, 11))


@needs_training
def test_a_rank_killed_under_torchrun_max_restarts_is_restarted_and_resumes_bitwise(tmp_path, uninterrupted):
    """torchrun --max-restarts 1, TP 2, a checkpoint every 4 iterations (asynchronously, Megatron's
    persistent worker): rank 1 SIGKILLed after iteration 6, once the save at 4 is recorded. torchrun stops
    rank 0, starts both again,
    and they resume from iteration 4 (--load X) to 10; every iteration's loss in TensorBoard is the
    uninterrupted run's, to the bit. Each attempt rendezvouses in a store of its own
    (runtime/pretrain_load.py, restart_store): in torchrun's one store for all attempts, the restarted ranks read
    the dead ones' gloo addresses and failed ("Connection refused" in connectFullMesh) or hung."""
    import psutil

    def kill_rank_1(process):
        # once the save at 4 is recorded (an async save is, a few iterations later under load): killed
        # before, the restart finds no checkpoint recorded, as Megatron-LM's loader reads it
        deadline = time.monotonic() + 120
        while not (tracker.exists() and tracker.read_text().strip() == "4"):
            assert time.monotonic() < deadline, "the save at iteration 4 was never recorded"
            time.sleep(0.05)
        ranks = [child for child in psutil.Process(process.pid).children() if "megatron_siamese" in
                 " ".join(child.cmdline())]
        next(rank for rank in ranks if rank.environ().get("LOCAL_RANK") == "1").kill()

    checkpoints = str(tmp_path / "ckpt")
    tracker = tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", "-m", "megatron_siamese.cli", "train", *MODEL, *TP2_TB, "--tensorboard-dir",
               str(tmp_path / "tb"), "--save", checkpoints, "--load", checkpoints, "--save-interval", "4",
               "--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore"]
    status, log = interrupted(command, r"iteration\s+6/", kill_rank_1, tmp_path / "log")
    assert status == 0, log[-3000:]
    steps = [int(step) for step, _ in ITERATION.findall(log)]
    killed_after = len(steps) - 6  # the first attempt's last iteration (6 unless the save was recorded later)
    assert killed_after >= 6 and steps == [*range(1, killed_after + 1), *range(5, 11)], steps
    # the killed rank's helpers die with it: the checkpoint writer's queue manager (a fork of the
    # rank) and the persistent worker with its fork server were left running for good
    time.sleep(2)
    assert orphans_of_this_test() == []
    restarted, _ = read_losses(str(tmp_path / "tb"))
    assert restarted == uninterrupted[0]


def orphans_of_this_test():
    """Processes this test started (they inherit its PYTEST_CURRENT_TEST) that outlived their parents."""
    import psutil

    this = os.environ["PYTEST_CURRENT_TEST"].split()[0]
    found = []
    for process in psutil.process_iter():
        try:
            if process.ppid() == 1 and process.environ().get("PYTEST_CURRENT_TEST", "").split()[:1] == [this]:
                found.append(" ".join(process.cmdline())[:200])
        except psutil.Error:  # gone meanwhile, or not ours to read
            pass
    return found


@needs_training
def test_what_it_trains_export_and_generate_read_by_its_flags(tmp_path, corpus_cache):
    """Started without torchrun, TP 2 on the embedded corpus: the checkpoint's args (Megatron-LM's, with
    our --norm) describe the model to the commands that load it, at Megatron's TP-padded vocabulary;
    export checks the exported model's logits against the checkpoint's itself."""
    from megatron_siamese.inference.session import read_checkpoint

    saved = tmp_path / "checkpoints"
    log = pretrain("--tensor-model-parallel-size", "2", "--train-iters", "2", "--norm", "siamese", "--save",
                   str(saved), "--save-interval", "2", cache=corpus_cache)
    assert "megatron-siamese train: 2 ranks on this host (torchrun --standalone --nproc-per-node 2)" in log
    assert sorted(losses(log)) == [1, 2]
    checkpoint = read_checkpoint(str(saved))
    assert (checkpoint.step, checkpoint.settings.norm, checkpoint.settings.num_layers) == (2, "siamese", 2)
    assert checkpoint.vocab_size == 512  # 258 padded to a multiple of 128 x TP 2, as Megatron-LM pads
    # resumed with another schedule: Megatron's bare assert on loading it, said in one line with the ways on
    longer = pretrain("--tensor-model-parallel-size", "2", "--train-iters", "4", "--load", str(saved),
                      cache=corpus_cache, expect_failure=2)
    assert ("was saved with another learning-rate schedule than these flags give (total number of iterations, which "
            "Megatron's scheduler counts in samples (iterations x global batch): 16 from these flags, 8 in the "
            "checkpoint): give the flags it was saved with, or add --override-opt_param-scheduler") in longer \
        and "Traceback" not in longer, longer[-3000:]
    cli = [sys.executable, "-m", "megatron_siamese.cli"]
    exported = subprocess.run([*cli, "export", "--load", str(saved), "--output-dir", str(tmp_path / "hf")],
                              capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stderr[-2000:]
    generated = subprocess.run([*cli, "generate", "--load", str(saved), "--prompt", "In the beginning",
                                "--max-new-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert generated.returncode == 0 and "In the beginning" in generated.stdout, generated.stderr[-2000:]
    # a layout refused at the checkpoint's vocabulary, not our own loop's 320
    from megatron_siamese.inference.generate import generate
    from megatron_siamese.runtime.layout import Layout
    from megatron_siamese.runtime.registry import ConfigError

    with pytest.raises(ConfigError, match=r"the vocabulary \(512\) does not split over --tp 3: .*\(1, 2, 4, 8, 16"):
        generate(str(saved), ["In"], layout=Layout(tp=3))


@needs_training
def test_a_user_is_told_our_flags_and_megatrons_refusals_in_one_line(tmp_path):
    """--help lists Megatron-LM's flags and ours; a flag check Megatron-LM writes as a bare assert is
    quoted, and a scheme's option given to another scheme is refused by name."""
    cli = [sys.executable, "-m", "megatron_siamese.cli", "train"]
    shown = subprocess.run([*cli, "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "--tensor-model-parallel-size" in shown.stdout and "SiameseNorm (megatron_siamese):" in shown.stdout
    assert "--norm {siamese,siamese-layer,siamese-hybrid,pre,post,hybridnorm,mixln}" in shown.stdout
    refused = pretrain("--train-iters", "1", "--save", str(tmp_path), ranks=1, expect_failure=2,
                       cache=str(tmp_path / "cache"))
    assert "Megatron-LM refuses these flags: `assert args.save_interval is not None` (arguments.py:" in refused
    assert "exited with status" not in refused and "Traceback" not in refused
    renamed = pretrain("--tp", "1", "--steps", "3", "--tensor-model-paralel-size", "1", ranks=2, expect_failure=2,
                       launcher="cli")  # said once, by rank 0
    assert renamed.count("megatron-siamese train: error: unrecognized arguments: --tp 1 --steps 3 "
                         "--tensor-model-paralel-size 1 (in Megatron-LM's flags: --tp is --tensor-model-parallel-size; "
                         "--steps is --train-iters) (--tensor-model-paralel-size: did you mean --tensor-model-parallel-size?)") == 1, renamed
    # each problem a line, said together: a scheme's option on another, a --load that is not there (a typo
    # Megatron-LM's loop would train from random on)
    mismatched = pretrain("--norm", "post", "--mix-ln-alpha", "0.5", "--load", str(tmp_path / "ckpt"), "--save",
                          str(tmp_path / "saved"), "--save-interval", "5", *MOCK_DATA, ranks=1, expect_failure=True)
    assert "--mix-ln-alpha applies to --norm mixln, not --norm post: drop it" in mismatched
    assert f"train: --load {tmp_path / 'ckpt'} does not exist (Megatron-LM's loop would start from random)" in mismatched
    assert "end of arguments" not in mismatched  # Megatron-LM's dump of them comes once they are accepted
    # rank 0 says it though another rank exits first (rank 1 or 2 did at PP 3, and nothing was said)
    indivisible = pretrain("--pipeline-model-parallel-size", "3", "--num-layers", "4", *MOCK_DATA, ranks=3,
                           expect_failure=2)
    assert "Number of layers should be divisible by the pipeline-model-parallel size" in indivisible, indivisible
    # Megatron's TransformerConfig refuses it as the model provider would build it: once, not a traceback a rank
    split_heads = pretrain("--tensor-model-parallel-size", "3", *MOCK_DATA, ranks=3, expect_failure=2)
    assert "train: Megatron refuses the model these flags describe: num_attention_heads (4) must be a multiple " \
           "of tensor_model_parallel_size (3)" in split_heads and "Traceback" not in split_heads, split_heads[-3000:]
    # not a TypeError in torch's Adam, or in Megatron-LM's count of evaluations
    unset = train_here(*[word for flag in zip(MODEL[::2], MODEL[1::2]) if flag[0] not in ("--lr", "--eval-interval")
                         for word in flag], *MOCK_DATA, ranks=1)
    assert unset.returncode == 2 and "Traceback" not in unset.stdout, unset.stdout[-3000:]
    assert "--lr: Megatron-LM's loop needs it and has no default; give it (the embedded job's, which model flags such " \
           "as --num-layers leave out, is --lr 2e-3)" in unset.stdout
    assert "--eval-interval: Megatron-LM's loop needs it" in unset.stdout


@needs_training
def test_compare_runs_each_scheme_with_the_same_flags_and_tables_their_losses(tmp_path):
    """--compare pre,siamese: two runs, each with its own events (and checkpoints under --save), the
    table's last losses those each run logged, both curves in one PNG."""
    board = tmp_path / "tb"
    log = pretrain("--compare", "pre,siamese", "--train-iters", "3", "--tensorboard-dir", str(board), "--save",
                   str(tmp_path / "ckpt"), "--save-interval", "3", *MOCK_DATA, ranks=1, launcher="cli")
    runs = log.split("megatron-siamese train --compare: --norm ")[1:]
    assert [run.split(" ", 1)[0] for run in runs] == ["pre", "siamese"]
    table = {norm: (train, validation) for norm, train, validation in
             re.findall(r"^(pre|siamese) +3 +([0-9.]+) +([0-9.]+)$", log, re.M)}
    logged = [losses(run)[3] for run in runs]  # iteration 3's own (Megatron's second line after a start is two's mean)
    assert [float(table[norm][0]) for norm in ("pre", "siamese")] == [pytest.approx(float(loss), abs=1e-4)
                                                                          for loss in logged]
    assert logged[0] != logged[1]  # two models
    assert [("streams' norms" in run) for run in runs] == [False, True]  # Pre-Norm has one stream
    assert (board / "compare.png").read_bytes().startswith(b"\x89PNG")
    assert {path.name for path in (tmp_path / "ckpt").iterdir()} == {"pre", "siamese"}
    refused = pretrain("--compare", "pre", "--norm", "pre", ranks=1, launcher="cli", expect_failure=True)
    assert "--compare pre: name two schemes or more" in refused and "--compare sets --norm for each run" in refused


@needs_training
def test_run_sh_leaves_each_run_in_a_new_directory(tmp_path, corpus_cache):
    """The README's main job, twice, with tiny flags: two run directories, each with its checkpoints,
    TensorBoard events and loss curve, and its log; TP 2 unless the command line says otherwise. In a
    copy of the repository's scripts whose setup step is done (the venv's command runs this
    interpreter on this tree)."""
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(root / "scripts" / "run.sh", repo / "scripts" / "run.sh")
    (repo / "scripts" / "setup.sh").write_text("echo .venv\n")  # set up already
    command = repo / ".venv" / "bin" / "megatron-siamese"
    command.parent.mkdir(parents=True)
    command.write_text(f"#!/bin/sh\nexec {sys.executable} -m megatron_siamese.cli \"$@\"\n")
    command.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "MEGATRON_SIAMESE_CACHE": corpus_cache}
    runs = []
    for flags in ([], ["--tensor-model-parallel-size", "1", "--save-interval", "1"]):
        done = subprocess.run(["bash", str(repo / "scripts" / "run.sh"), *MODEL, "--train-iters", "2", *flags],
                              capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:]
        where = repo / re.search(r"^run directory: (runs/\S+)$", done.stdout, re.M).group(1)
        assert sorted(losses(done.stdout)) == [1, 2] and f"loss curve {where.relative_to(repo)}/tensorboard/loss.png" \
            in done.stdout
        assert (where / "train.log").read_text() == done.stdout  # stdout and stderr, as the terminal showed them
        assert (where / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
        runs.append((where, done.stdout))
    (first, first_log), (second, second_log) = runs
    assert first != second and sorted(os.listdir(repo / "runs")) == sorted([first.name, second.name])
    assert "tensor-model-parallel size: 2" in first_log and "tensor-model-parallel size: 1" in second_log
    assert sorted(os.listdir(first / "checkpoints")) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert sorted(os.listdir(second / "checkpoints")) == ["iter_0000001", "iter_0000002",
                                                          "latest_checkpointed_iteration.txt"]


@pytest.mark.skipif(HAS_TRAINING, reason="this megatron-core ships megatron.training")
def test_without_megatron_training_it_is_refused_by_the_version_it_needs():
    process = subprocess.run([sys.executable, "-m", "megatron_siamese.runtime.pretrain", "--num-layers", "2"],
                             capture_output=True, text=True, timeout=120)
    assert process.returncode != 0
    assert "needs megatron-core >= 0.17" in process.stderr and "pip install 'megatron-core==0.19.2'" in process.stderr
    command = subprocess.run([sys.executable, "-m", "megatron_siamese.cli", "train", "--num-layers", "2"],
                             capture_output=True, text=True, timeout=120)
    assert command.returncode == 2 and "Traceback" not in command.stderr
    assert command.stderr.strip().splitlines() == [
        "megatron-siamese train: error: megatron-siamese train runs Megatron-LM's own training loop, which needs "
        "megatron-core >= 0.17 (its wheel ships Megatron-LM's training loop; 0.19.2 is tested); this environment has "
        f"megatron-core {installed_megatron_core()}. Upgrade it: pip install 'megatron-core==0.19.2' (Python >= 3.12; "
        "in this repository, bash scripts/setup.sh mcore019 makes .venv-mcore019)."]

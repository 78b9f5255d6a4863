"""Megatron's own training loop with our layer (megatron_siamese/runtime/pretrain.py), under torchrun on CPU:
TP, PP (with experts and multi-token prediction), DP and CP layouts of GPTModel and a PP HybridModel
train (CP's losses those of DP); a TP 2 run saved and resumed logs the losses of the run it
interrupted; megatron-core 0.16.1, whose wheel has no megatron.training, refuses it by version."""

import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest

from megatron_siamese.runtime.launch import free_port
from megatron_siamese.runtime.loss_curve import read_losses


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


def pretrain(*flags, ranks=2, cache=None, expect_failure=False):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
               str(free_port()), "-m", "megatron_siamese.runtime.pretrain", *MODEL, *flags]
    environment = dict(os.environ, **({"MEGATRON_SIAMESE_CACHE": cache} if cache else {}))
    process = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)
    if expect_failure:
        assert process.returncode != 0
        return process.stdout + process.stderr
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    return process.stdout


def losses(log):
    return {int(step): loss for step, loss in ITERATION.findall(log)}


@needs_training
def test_pp2_with_experts_and_multi_token_prediction_trains_in_megatrons_loop():
    """The block spec follows the flags as Megatron's own does: MoE every other layer, an MTP block."""
    log = pretrain("--train-iters", "2", "--distributed-backend=gloo", "--pipeline-model-parallel-size", "2",
                   "--num-layers", "4", "--num-experts", "4", "--moe-layer-freq", "2", "--mtp-num-layers", "1",
                   "--position-embedding-type", "rope", "--disable-bias-linear", *MOCK_DATA)  # --distributed-backend given as --flag=value: not added
    assert "no GPU, so on CPU with --transformer-impl local --no-persist-layer-norm" in log
    assert sorted(losses(log)) == [1, 2] and all(0 < float(loss) < 7 for loss in losses(log).values())
    assert "load_balancing_loss:" in log and "mtp_1 loss:" in log
    assert "PP>1 sends [s, b, 2h] between stages" in log  # our layers, not Megatron's stock ones


def untrained(loss: str) -> bool:
    """About the entropy of a uniform draw over the model's vocabulary: the corpus's 258 ids padded
    to Megatron's multiple of 128."""
    return abs(float(loss) - math.log(math.ceil(258 / 128) * 128)) < 0.3


@needs_training
def test_hybrid_model_pp2_trains_in_megatrons_loop(corpus_cache):
    log = pretrain("--train-iters", "2", "--num-layers", "4", "--hybrid-layer-pattern", "*-|*-",
                   "--pipeline-model-parallel-size", "2", "--position-embedding-type", "rope", cache=corpus_cache)
    assert "PP>1 sends [s, b, 2h] between stages" in log  # our stack's layers, not Megatron's stock ones
    assert sorted(losses(log)) == [1, 2] and all(untrained(loss) for loss in losses(log).values())


@needs_training
def test_dp2_and_cp2_train_alike_on_the_embedded_corpus_without_data_flags(corpus_cache):
    """One global batch, no dropout: DP 2 (each rank half the samples) and CP 2 (each rank two
    chunks of every sequence, Megatron's split) must log one loss curve."""
    common = ("--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0",
              "--position-embedding-type", "rope")
    dp2 = pretrain(*common, cache=corpus_cache)
    assert "no data source given, so the embedded corpus: --data-path " + corpus_cache in dp2
    assert "--tokenizer-type NullTokenizer --vocab-size 258 --null-tokenizer-eod-id 256" in dp2
    assert sorted(losses(dp2)) == [1, 2, 3] and untrained(losses(dp2)[1])
    # and reading the corpus without mmap (a dataset flag Megatron-LM's script passes on) changes nothing
    cp2 = pretrain(*common, "--context-parallel-size", "2", "--no-mmap-bin-files", cache=corpus_cache)
    assert "mmap_bin_files=False" in cp2 and "mmap_bin_files=True" in dp2
    assert losses(cp2)[3] != losses(cp2)[1]  # it trains
    for step in (1, 2, 3):
        assert float(losses(cp2)[step]) == pytest.approx(float(losses(dp2)[step]), rel=1e-5), step
    refused = pretrain("--train-iters", "1", "--tokenizer-type=GPT2BPETokenizer", cache=corpus_cache,
                       expect_failure=True)
    assert "byte tokens, read with --tokenizer-type NullTokenizer --vocab-size 258" in refused
    assert "got --tokenizer-type GPT2BPETokenizer" in refused
    unfollowed = pretrain("--train-iters", "1", "--qk-l2-norm", ranks=1, cache=corpus_cache, expect_failure=True)
    assert "does not follow --qk-l2-norm yet" in unfollowed


@needs_training
def test_each_ranks_loss_is_validated_as_megatron_lms_is():
    """Megatron's rerun state machine, told to inject a persistent fault into every validated result,
    finds it in our loss function's NaN check and stops the job (nothing would be injected unless
    the loss function asked the machine to validate the loss)."""
    log = pretrain("--train-iters", "3", "--error-injection-rate", "1", "--error-injection-type", "persistent_error",
                   *MOCK_DATA, expect_failure=True)
    assert "Injecting error type Persistent error" in log
    assert "message='found NaN in local forward loss calculation'" in log


@pytest.mark.stack_independent
def test_the_loss_curve_follows_the_last_timeline(tmp_path):
    """Event files in order: a later one (a resumed run's) replaces the points from its first
    iteration on; within one, an iteration's first validation value (the validation set's, before
    the test set's under the same tag) is kept."""
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


@needs_training
def test_a_resumed_run_logs_the_losses_of_the_run_it_interrupted(tmp_path):
    """TP 2 with dropout: saved at 4 and stopped, resumed to 8. Megatron logs the second line after
    any start as the mean of two iterations (its loss sums are not reset at the first line), so
    iteration 6 is left out of the comparison."""
    tp2 = ["--tensor-model-parallel-size", "2", "--train-iters", "8", *MOCK_DATA]
    whole = pretrain(*tp2)
    board = ["--tensorboard-dir", str(tmp_path / "tb")]
    first = pretrain(*tp2, *board, "--save", str(tmp_path), "--save-interval", "4", "--exit-interval", "4")
    resumed = pretrain(*tp2, *board, "--save", str(tmp_path), "--load", str(tmp_path), "--save-interval", "4")
    assert "successfully loaded checkpoint" in resumed
    assert sorted(losses(resumed)) == [5, 6, 7, 8]
    for step in (5, 7, 8):
        assert losses(resumed)[step] == losses(whole)[step], step
    assert VALIDATION.findall(resumed) == VALIDATION.findall(whole)
    # the loss curve of the whole run, stopped and resumed, from Megatron's TensorBoard events: each
    # iteration's own loss (the first logged line of each start is one iteration's alone)
    assert f"loss curve {tmp_path / 'tb' / 'loss.png'} (iteration 4:" in first
    assert f"loss curve {tmp_path / 'tb' / 'loss.png'} (iteration 8:" in resumed
    train, validation = read_losses(str(tmp_path / "tb"))
    assert sorted(train) == list(range(1, 9)) and sorted(validation) == [8]
    assert validation[8] == pytest.approx(float(VALIDATION.findall(resumed)[-1]), rel=1e-6)  # not the test set's
    for step in (1, 5):
        assert train[step] == pytest.approx(float(losses(whole if step == 1 else resumed)[step]), rel=1e-6)
    assert (tmp_path / "tb" / "loss.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.skipif(HAS_TRAINING, reason="this megatron-core ships megatron.training")
def test_without_megatron_training_it_is_refused_by_the_version_it_needs():
    process = subprocess.run([sys.executable, "-m", "megatron_siamese.runtime.pretrain", "--num-layers", "2"],
                             capture_output=True, text=True, timeout=120)
    assert process.returncode != 0
    assert "needs megatron-core >= 0.17" in process.stderr and "megatron-siamese train" in process.stderr

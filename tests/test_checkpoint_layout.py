"""Megatron-LM's checkpoint layout, driven as a user does (subprocesses of the CLI, files on disk):
what the trainer writes, that an earlier release's ``step_<N>``/``latest`` checkpoint still
resumes and analyzes, and, with MEGATRON_LM naming a Megatron-LM work tree, that checkpoints move
both ways between this trainer and Megatron-LM's own ``pretrain_gpt.py``; with MEGATRON_LM_HYBRID
naming a core_v0.19 tree, between ``--model hybrid`` and its ``pretrain_hybrid.py``
(docs/megatron-lm.md)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runs import cli_here, our_loop_only
from megatron_siamese.training.checkpoint_files import TRACKER
from megatron_siamese.versions import installed_megatron_core, release

CLI = [sys.executable, "-m", "megatron_siamese.cli"]
REPO = Path(__file__).resolve().parent.parent
# written by an earlier release (tests/data/step_layout/README.md says how, and what it logged)
STEP_LAYOUT = REPO / "tests" / "data" / "step_layout" / "checkpoints"
STEP_LAYOUT_MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16"]
STEP_LAYOUT_RUN = [*STEP_LAYOUT_MODEL, "--tp", "1", "--micro-batch-size", "4", "--global-batch-size", "8",
                   "--train-iters", "4", "--lr-warmup-iters", "1", "--eval-interval", "2", "--eval-iters", "1",
                   "--no-progress"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def cli(*args, timeout=600, **kwargs):
    our_loop_only(args)
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout, **kwargs)


def assert_ok(done):
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert "Traceback" not in done.stdout + done.stderr


def summary(output) -> dict:
    return json.loads((Path(output) / "summary.json").read_text())


def test_an_earlier_release_checkpoint_resumes_where_it_stopped(tmp_path, cache):
    old = tmp_path / "old"
    shutil.copytree(STEP_LAYOUT, old)
    done = cli("train", *STEP_LAYOUT_RUN, "--cache-dir", cache, "--output-dir", tmp_path / "run",
               "--save-interval", "2", "--load", old)
    assert_ok(done)
    resumed = summary(tmp_path / "run")
    assert resumed["resumed_from"] == 2 and sorted(resumed["train_losses"]) == ["3", "4"]
    # the losses of the run it was cut from: the same command uninterrupted, on this stack
    assert_ok(cli_here("train", *STEP_LAYOUT_RUN, "--cache-dir", cache, "--output-dir", tmp_path / "uninterrupted"))
    uninterrupted = summary(tmp_path / "uninterrupted")["train_losses"]
    assert sorted(uninterrupted) == ["1", "2", "3", "4"]
    assert resumed["train_losses"] == pytest.approx({step: uninterrupted[step] for step in ("3", "4")}, rel=1e-6)
    # the new checkpoint is in Megatron-LM's layout; the old one is left as it was
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["iter_0000004", TRACKER]
    assert (checkpoints / TRACKER).read_text() == "4"
    assert sorted(os.listdir(old)) == ["latest", "step_2"]
    # with the common state Megatron-LM's load_checkpoint reads
    from megatron_siamese.training.checkpoint_files import common_state

    common = common_state(str(checkpoints / "iter_0000004"))
    args = common["args"]
    assert (common["iteration"], common["checkpoint_version"]) == (4, 3.0)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == (1, 1, 1)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.padded_vocab_size) == (1, 16, 2, 320)
    assert args.no_save_rng and not args.no_save_optim and args.consumed_train_samples == 4 * 8
    assert common["opt_param_scheduler"]["num_steps"] == 4 * 8  # samples, as Megatron-LM's loop counts them
    assert common["content_metadata"] == {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}

    # an output directory holding the old layout is another run's, and --overwrite clears it all
    reused = tmp_path / "reused"
    shutil.copytree(STEP_LAYOUT, reused / "checkpoints")
    refused = cli("train", *STEP_LAYOUT_RUN, "--cache-dir", cache, "--output-dir", reused, "--save-interval", "2")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "already holds another run's checkpoints (step_2)" in refused.stderr
    done = cli("train", *STEP_LAYOUT_RUN, "--cache-dir", cache, "--output-dir", reused, "--train-iters", "2",
               "--save-interval", "2", "--overwrite")
    assert_ok(done)
    assert sorted(os.listdir(reused / "checkpoints")) == ["iter_0000002", TRACKER]


def test_analyze_takes_the_checkpoints_schedule(tmp_path, cache):
    # the checkpoint was trained with 1 warm-up step of 4: analyze's defaults (300 steps, 30 warm-up)
    # must not be checked against it (Megatron's scheduler asserted "warmup iterations do not match")
    done = cli("analyze", *STEP_LAYOUT_MODEL, "--load", STEP_LAYOUT, "--cache-dir", cache,
               "--output-dir", tmp_path / "analysis")
    assert_ok(done)
    assert "effective depth" in done.stdout
    assert sorted(p.name for p in (tmp_path / "analysis").glob("*.png")) == [
        "contribution.png", "depth.png", "logit_lens.png", "magnitude.png", "pruning.png"]


# -- both ways with Megatron-LM's pretrain_gpt.py ------------------------------------------

MEGATRON_LM = os.environ.get("MEGATRON_LM", "")
needs_megatron_lm = pytest.mark.skipif(
    not os.path.isfile(os.path.join(MEGATRON_LM, "pretrain_gpt.py")),
    reason="set MEGATRON_LM to a Megatron-LM work tree (tag core_v0.16.1 with megatron-core 0.16.1, and the "
           "packages docs/megatron-lm.md lists on PYTHONPATH) to resume checkpoints in its pretrain_gpt.py",
)
# one model, in both programs' flags (Megatron-LM sizes a SwiGLU MLP its own way: give the width)
SIZES = dict(layers=2, hidden=32, heads=2, ffn=128, seq=32, micro=4, batch=8, iters=8, warmup=1, lr=2e-3,
             min_lr=2e-4, weight_decay=0.1)
OURS = ["--norm", "siamese-layer", "--tp", "1", "--num-layers", SIZES["layers"], "--hidden-size", SIZES["hidden"],
        "--num-attention-heads", SIZES["heads"], "--ffn-hidden-size", SIZES["ffn"], "--seq-length", SIZES["seq"],
        "--micro-batch-size", SIZES["micro"], "--global-batch-size", SIZES["batch"], "--train-iters", SIZES["iters"],
        "--lr-warmup-iters", SIZES["warmup"], "--lr", SIZES["lr"], "--min-lr", SIZES["min_lr"],
        "--weight-decay", SIZES["weight_decay"], "--eval-interval", 100, "--eval-iters", 2,
        "--no-progress", "--log-interval", 1]


def pretrain_gpt(checkpoints, data_prefix, *extra):
    """Megatron-LM's pretrain_gpt.py on one CPU process with our --spec, saving to and loading
    from ``checkpoints``; returns the completed process."""
    return megatron_lm(MEGATRON_LM, "pretrain_gpt.py", ["--spec", "megatron_siamese.specs", "siamese_layer_spec",
                                                        "--num-layers", SIZES["layers"]], checkpoints, data_prefix, *extra)


def megatron_lm(tree, script, model, checkpoints, data_prefix, *extra, ranks=1):
    """Megatron-LM's ``script`` in ``tree`` on ``ranks`` CPU processes, the model named by
    ``model`` (its --spec and layers) and SIZES; returns the completed process."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", ranks,
        "-m", "megatron_siamese.runtime.megatron_lm", script, *model, "--distributed-backend", "gloo",
        "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        "--hidden-size", SIZES["hidden"], "--num-attention-heads", SIZES["heads"],
        "--ffn-hidden-size", SIZES["ffn"], "--seq-length", SIZES["seq"], "--max-position-embeddings", SIZES["seq"],
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--micro-batch-size", SIZES["micro"], "--global-batch-size", SIZES["batch"], "--train-iters", SIZES["iters"],
        "--lr", SIZES["lr"], "--min-lr", SIZES["min_lr"], "--lr-warmup-iters", SIZES["warmup"],
        "--lr-decay-style", "cosine", "--weight-decay", SIZES["weight_decay"], "--clip-grad", "1.0",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--seed", "1234",
        # our byte vocabulary (258 ids) padded to 320, as the trainer pads it
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "257", "--make-vocab-size-divisible-by", "64",
        "--data-path", data_prefix, "--split", "98,2,0", "--num-workers", "0",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "2",
        "--ckpt-format", "torch_dist", "--save", checkpoints, "--load", checkpoints, "--save-interval", "1000", *extra,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TORCHDYNAMO_DISABLE": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return subprocess.run(list(map(str, command)), cwd=tree, env=env, capture_output=True, text=True,
                          timeout=900)


def megatron_lm_iterations(log: str) -> dict:
    """{iteration: (learning rate, lm loss, grad norm)} from Megatron-LM's log lines."""
    found = re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?learning rate: ([0-9.E+-]+) \|.*?lm loss: ([0-9.E+-]+) \|"
                        r".*?grad norm: ([0-9.]+) \|", log)
    return {int(m.group(1)): tuple(float(v) for v in m.group(2, 3, 4)) for m in found}


def our_iterations(log: str) -> dict:
    """{step: (learning rate, loss, grad norm)}: the trainer's --log-interval lines are Megatron-LM's."""
    return megatron_lm_iterations(log)


def assert_same_steps(theirs: dict, ours: dict, steps, loss_steps):
    for step in steps:
        (lr, loss, norm), (our_lr, our_loss, our_norm) = theirs[step], ours[step]
        assert lr == pytest.approx(our_lr, rel=1e-6), (step, theirs, ours)
        assert norm == pytest.approx(our_norm, abs=1e-3), (step, theirs, ours)
        if step in loss_steps:
            assert loss == pytest.approx(our_loss, abs=1e-4), (step, theirs, ours)


@pytest.fixture(scope="module")
def corpus(cache):
    from megatron_siamese.data.corpus import embedded_corpus

    return embedded_corpus(cache)


def megatron_lm_resumes_ours(tmp_path, cache, ours, run_megatron_lm):
    """Ours saves at 4; Megatron-LM resumes it and continues as our uninterrupted run does.
    Returns its output, our uninterrupted run's as its ``uninterrupted``."""
    uninterrupted = cli("train", *ours, "--cache-dir", cache, "--output-dir", tmp_path / "ours")
    stopped = cli("train", *ours, "--cache-dir", cache, "--output-dir", tmp_path / "stopped", "--stop-step", 4)
    assert_ok(uninterrupted)
    assert_ok(stopped)
    checkpoints = tmp_path / "stopped" / "checkpoints"
    done = run_megatron_lm(checkpoints)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    assert f"successfully loaded checkpoint from {checkpoints}" in done.stdout and "at iteration 4" in done.stdout
    theirs = megatron_lm_iterations(done.stdout)
    assert sorted(theirs) == [5, 6, 7, 8]  # it continued from iteration 4
    # the same weights, optimizer state, schedule and data: learning rates and gradient norms at
    # every iteration, and the losses; Megatron-LM's logged loss of the second iteration after
    # its resume differs (its own checkpoints too: docs/megatron-lm.md) while its gradient norm
    # and every later loss match, so that one log value is compared loosely
    assert_same_steps(theirs, our_iterations(uninterrupted.stdout), [5, 6, 7, 8], loss_steps=[5, 7, 8])
    assert theirs[6][1] == pytest.approx(our_iterations(uninterrupted.stdout)[6][1], rel=0.02)
    assert (checkpoints / TRACKER).read_text().strip() == "8"  # Megatron-LM saved at the end, beside ours
    done.uninterrupted = uninterrupted
    return done


def ours_resumes_megatron_lm(tmp_path, cache, ours, run_megatron_lm):
    """Megatron-LM saves at 4 and 8; ours resumes at 4 and continues as it did (its optimizer
    and schedule came back too)."""
    checkpoints = tmp_path / "megatron-lm"
    done = run_megatron_lm(checkpoints, "--save-interval", 4)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    theirs = megatron_lm_iterations(done.stdout)
    assert sorted(os.listdir(checkpoints)) == ["iter_0000004", "iter_0000008", TRACKER]
    resumed = cli("train", *ours, "--cache-dir", cache, "--output-dir", tmp_path / "ours",
                  "--load", checkpoints / "iter_0000004")
    assert_ok(resumed)
    assert f"resumed from {checkpoints / 'iter_0000004'} at step 4" in resumed.stdout
    assert_same_steps(theirs, our_iterations(resumed.stdout), [5, 6, 7, 8], loss_steps=[5, 6, 7, 8])
    return checkpoints


# the same model with an MoE MLP in every layer: Megatron-LM's flags are ours
MOE = ["--num-experts", 4, "--moe-router-topk", 2, "--moe-aux-loss-coeff", 0.01, "--moe-z-loss-coeff", 0.001,
       "--moe-token-dispatcher-type", "alltoall"]


@needs_megatron_lm
def test_pretrain_gpt_resumes_an_moe_checkpoint_of_the_trainer(tmp_path, cache, corpus):
    """The MoE spec object (--spec megatron_siamese.specs siamese_moe_layer_spec) in Megatron-LM's
    own pretrain_gpt.py: it resumes our MoE checkpoint and continues exactly as our run does."""
    ours = [*OURS, *MOE]  # --norm siamese-layer: the spec object Megatron-LM imports, the MoE one here
    done = megatron_lm_resumes_ours(
        tmp_path, cache, ours,
        lambda checkpoints: megatron_lm(MEGATRON_LM, "pretrain_gpt.py",
                                        ["--spec", "megatron_siamese.specs", "siamese_moe_layer_spec",
                                         "--num-layers", SIZES["layers"], *MOE], checkpoints, corpus))
    assert "load_balancing_loss" in done.stdout  # Megatron-LM's own router statistics of our MoE layers


@needs_megatron_lm
def test_pretrain_gpt_resumes_a_qk_norm_checkpoint_of_the_trainer(tmp_path, cache, corpus):
    """--qk-layernorm with the spec object (--spec megatron_siamese.specs siamese_layer_spec): its
    QK-norm follows Megatron-LM's flag, and it resumes our QK-norm checkpoint exactly."""
    megatron_lm_resumes_ours(tmp_path, cache, [*OURS, "--qk-layernorm"],
                             lambda checkpoints: pretrain_gpt(checkpoints, corpus, "--qk-layernorm"))


@needs_megatron_lm
def test_pretrain_gpt_resumes_a_checkpoint_of_the_trainer(tmp_path, cache, corpus):
    megatron_lm_resumes_ours(tmp_path, cache, OURS, lambda checkpoints: pretrain_gpt(checkpoints, corpus))


@needs_megatron_lm
def test_the_trainer_resumes_a_checkpoint_of_pretrain_gpt(tmp_path, cache, corpus):
    checkpoints = ours_resumes_megatron_lm(tmp_path, cache, OURS,
                                           lambda checkpoints, *extra: pretrain_gpt(checkpoints, corpus, *extra))
    # through its tracker file: its last checkpoint, evaluated as saved
    evaluated = cli("train", *OURS, "--cache-dir", cache, "--output-dir", tmp_path / "evaluated", "--load", checkpoints)
    assert_ok(evaluated)
    assert "evaluated the checkpoint at step 8" in evaluated.stdout


# DeepSeek-class: multi-latent attention (queries through their own latent, latent norms), one
# multi-token prediction layer; Megatron-LM's flags are ours
MLA = ["--multi-latent-attention", "--q-lora-rank", 16, "--kv-lora-rank", 16, "--qk-head-dim", 8,
       "--qk-pos-emb-head-dim", 8, "--v-head-dim", 8, "--qk-layernorm"]
MTP = ["--mtp-num-layers", 1]


@needs_megatron_lm
def test_pretrain_gpt_at_cp2_is_its_cp1_run(tmp_path, corpus):
    """Our spec in Megatron-LM's script under --context-parallel-size 2 (the package's CP
    attention): every iteration's loss and gradient norm those of the same run at CP 1 (the CPU
    runner keeps the jit warm-up's random draws out of the weights' initialisation)."""
    model = ["--spec", "megatron_siamese.specs", "siamese_layer_spec", "--num-layers", SIZES["layers"]]
    one = megatron_lm(MEGATRON_LM, "pretrain_gpt.py", model, tmp_path / "cp1", corpus)
    two = megatron_lm(MEGATRON_LM, "pretrain_gpt.py", model, tmp_path / "cp2", corpus,
                      "--context-parallel-size", "2", ranks=2)
    assert_ok(one), assert_ok(two)
    theirs, ours = megatron_lm_iterations(two.stdout + two.stderr), megatron_lm_iterations(one.stdout + one.stderr)
    assert sorted(theirs) == list(range(1, SIZES["iters"] + 1))
    assert_same_steps(theirs, ours, theirs, theirs)


def with_mtp_spec_fix(tree, directory: Path) -> Path:
    """``tree`` as ``directory`` of links, but its gpt_builders.py defining ``use_te`` before
    ``--spec`` is read: core_v0.16.1's defines it only without --spec and its multi-token
    prediction branch reads it, so --spec with --mtp-num-layers stops with UnboundLocalError
    (docs/megatron-lm.md gives the line; core_v0.19.0's pretrain_gpt.py builds through
    GPTModelConfig instead, which has no such gap)."""
    directory.mkdir()
    for entry in os.listdir(tree):
        if entry != "gpt_builders.py":
            os.symlink(os.path.join(tree, entry), directory / entry)
    source = Path(tree, "gpt_builders.py").read_text()
    fixed, count = re.subn(r"^(\s*)if args\.spec is not None:",
                           lambda m: f'{m.group(1)}use_te = args.transformer_impl == "transformer_engine"\n{m.group(0)}',
                           source, count=1, flags=re.M)
    assert count == 1, "gpt_builders.py has changed: see whether --spec with --mtp-num-layers still needs the fix"
    (directory / "gpt_builders.py").write_text(fixed)
    return directory


def mtp_losses(log: str) -> dict:
    """{iteration: mtp_1 loss} from Megatron-LM's (and the trainer's) log lines."""
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?\| mtp_1 loss: ([0-9.E+-]+) \|", log)}


@needs_megatron_lm
def test_pretrain_gpt_resumes_an_mtp_checkpoint_of_the_trainer(tmp_path, cache, corpus):
    """--mtp-num-layers with the spec object: Megatron-LM adds its stock MTP layer after our
    decoder, as the trainer does; it resumes our checkpoint and continues exactly as our run does,
    MTP loss included; core_v0.16.1's builder only with the one-line fix (``with_mtp_spec_fix``).
    (Not with MLA on CPU: Megatron-LM builds the MTP layer from its stock local spec, whose core
    attention cannot take MLA's head sizes; TE's can.)"""
    unfixed = pretrain_gpt(tmp_path / "unfixed", corpus, *MTP)
    tree = MEGATRON_LM
    if unfixed.returncode != 0:  # core_v0.16.1's gpt_builders.py
        assert "UnboundLocalError" in unfixed.stdout + unfixed.stderr and "'use_te'" in unfixed.stdout + unfixed.stderr
        tree = with_mtp_spec_fix(MEGATRON_LM, tmp_path / "megatron-lm")
    done = megatron_lm_resumes_ours(
        tmp_path, cache, [*OURS, *MTP],
        lambda checkpoints: megatron_lm(tree, "pretrain_gpt.py", ["--spec", "megatron_siamese.specs",
                                                                  "siamese_layer_spec", "--num-layers",
                                                                  SIZES["layers"], *MTP], checkpoints, corpus))
    theirs, ours = mtp_losses(done.stdout), mtp_losses(done.uninterrupted.stdout)
    assert sorted(theirs) == [5, 6, 7, 8] and sorted(ours) == [1, 2, 3, 4, 5, 6, 7, 8]
    for iteration in (5, 7, 8):  # iteration 6 loosely, as its lm loss (megatron_lm_resumes_ours)
        assert theirs[iteration] == pytest.approx(ours[iteration], abs=1e-4), (iteration, theirs, ours)
    assert theirs[6] == pytest.approx(ours[6], rel=0.02)


@needs_megatron_lm
def test_pretrain_gpt_resumes_an_mla_checkpoint_of_the_trainer(tmp_path, cache, corpus):
    """--multi-latent-attention with the spec object, which builds MLA where the config asks:
    it resumes our MLA checkpoint and continues exactly as our run does."""
    megatron_lm_resumes_ours(tmp_path, cache, [*OURS, *MLA], lambda checkpoints: pretrain_gpt(checkpoints, corpus, *MLA))


# -- both ways with Megatron-LM's pretrain_hybrid.py (HybridModel, megatron-core >= 0.19) ----

MEGATRON_LM_HYBRID = os.environ.get("MEGATRON_LM_HYBRID", "")
needs_pretrain_hybrid = pytest.mark.skipif(
    not os.path.isfile(os.path.join(MEGATRON_LM_HYBRID, "pretrain_hybrid.py"))
    or release(installed_megatron_core()) < (0, 19, 0),
    reason="set MEGATRON_LM_HYBRID to a Megatron-LM work tree (tag core_v0.19.0, and the packages "
           "docs/megatron-lm.md lists on PYTHONPATH) and run on megatron-core >= 0.19 (HybridModel) to resume "
           "checkpoints in its pretrain_hybrid.py",
)
PATTERN = "*-*-"  # HybridModel layers: the 2 GPT layers' attention and MLP sublayers
HYBRID = ["--model", "hybrid", "--norm", "siamese", "--hybrid-layer-pattern", PATTERN,
          *OURS[OURS.index("--tp"):OURS.index("--num-layers")], *OURS[OURS.index("--hidden-size"):]]


def pretrain_hybrid(checkpoints, data_prefix, *extra):
    """Megatron-LM's pretrain_hybrid.py on one CPU process with our stack spec (local modules)."""
    return megatron_lm(MEGATRON_LM_HYBRID, "pretrain_hybrid.py",
                       ["--spec", "megatron_siamese.hybrid", "siamese_hybrid_stack_spec",
                        "--hybrid-layer-pattern", PATTERN, "--num-layers", len(PATTERN)],
                       checkpoints, data_prefix, *extra)


@needs_pretrain_hybrid
def test_pretrain_hybrid_resumes_a_checkpoint_of_the_trainer(tmp_path, cache, corpus):
    done = megatron_lm_resumes_ours(tmp_path, cache, HYBRID, lambda checkpoints: pretrain_hybrid(checkpoints, corpus))
    # loaded as the HybridModel it is, not translated as a GPT's (its args carry the pattern)
    assert "loading a GPT checkpoint into the hybrid model" not in done.stdout


@needs_pretrain_hybrid
def test_the_trainer_resumes_a_checkpoint_of_pretrain_hybrid(tmp_path, cache, corpus):
    # its optimizer and schedule come back (a GPT checkpoint's would start both afresh)
    ours_resumes_megatron_lm(tmp_path, cache, HYBRID,
                             lambda checkpoints, *extra: pretrain_hybrid(checkpoints, corpus, *extra))

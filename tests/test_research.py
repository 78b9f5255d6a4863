"""Research tools: Pre-Norm upcycling, stream analysis, the study's pieces."""

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
from saved_models import save_random

from megatron_siamese.models import build_gpt_chunks
from megatron_siamese.data.addition import exact_match_accuracy, line, split
from megatron_siamese.research.upcycle import upcycled_state
from megatron_siamese.check.step import ModelCase, case_config, microbatches
from megatron_siamese.runtime.layout import Layout
from megatron_siamese.check.sharding import seed_parameters
from megatron_siamese.runtime.launch import launch
from megatron_siamese.training.args import TrainArgs
from megatron_siamese.versions import ships_megatron_training


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_upcycled_model_computes_the_pre_norm_function(megatron_single_rank, normalization, zero_centered):
    case = ModelCase(normalization=normalization, zero_centered_gamma=zero_centered)
    # a tiny eps: normalizing twice then differs from once only by rounding (module docstring)
    config = dataclasses.replace(case_config(case, Layout()), layernorm_epsilon=1e-12)
    (pre,) = build_gpt_chunks(config, "pre", case.vocab_size, case.seq_length)
    (siamese,) = build_gpt_chunks(config, "siamese", case.vocab_size, case.seq_length)
    seed_parameters([pre], case.seed, 0, 1, zero_centered)
    siamese.load_state_dict(upcycled_state(pre.state_dict(), siamese.state_dict(), zero_centered))
    batch = microbatches(case)[0]
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    expected = pre(*args)
    torch.testing.assert_close(siamese(*args), expected, rtol=1e-5, atol=1e-5 * float(expected.detach().abs().max()))


def test_upcycling_refuses_weights_it_cannot_place(megatron_single_rank):
    config = case_config(ModelCase(), Layout())
    (siamese,) = build_gpt_chunks(config, "siamese", 128, 16)
    state = dict(siamese.state_dict())
    state["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.ones(8)
    with pytest.raises(ValueError, match="no SiameseNorm place"):
        upcycled_state(state, siamese.state_dict(), False)


def mtp_losses_of(model, tokens, monkeypatch):
    """Each MTP depth's per-token loss as GPTModel hands it to MTPLossAutoScaler (the depth's
    masked cross-entropy, scaled alike in two models of the same flags), and the main loss."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    attach, found = MTPLossAutoScaler.apply, []

    def recording(hidden, mtp_loss):
        found.append(mtp_loss.detach())
        return attach(hidden, mtp_loss)

    monkeypatch.setattr(MTPLossAutoScaler, "apply", recording)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1]).expand_as(inputs)
    causal = torch.ones(inputs.shape[1], inputs.shape[1], dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        main = model(inputs, positions, causal, labels=labels)
    monkeypatch.setattr(MTPLossAutoScaler, "apply", attach)
    return found, main


def test_upcycled_model_computes_the_pre_norm_mtp_losses(megatron_single_rank, monkeypatch):
    """Two MTP layers carried over: the main and each depth's per-token loss are Pre-Norm's (a tiny eps)."""
    case = ModelCase(zero_centered_gamma=True, mtp_num_layers=2)
    config = dataclasses.replace(case_config(case, Layout()), layernorm_epsilon=1e-12)
    (pre,) = build_gpt_chunks(config, "pre", case.vocab_size, case.seq_length)
    (siamese,) = build_gpt_chunks(config, "siamese", case.vocab_size, case.seq_length)
    seed_parameters([pre], case.seed, 0, 1, True)
    siamese.load_state_dict(upcycled_state(pre.state_dict(), siamese.state_dict(), True))
    batch = microbatches(case)[0]
    tokens = torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1)
    expected_mtp, expected = mtp_losses_of(pre, tokens, monkeypatch)
    mtp, main = mtp_losses_of(siamese, tokens, monkeypatch)
    assert len(mtp) == len(expected_mtp) == 2
    for actual, wanted in zip([main, *mtp], [expected, *expected_mtp]):
        torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-5 * float(wanted.abs().max()))
    # planted: the last MTP layer's weights not carried over
    seed_parameters([siamese.mtp.layers[-1]], case.seed + 1, 0, 1, True)
    assert (mtp_losses_of(siamese, tokens, monkeypatch)[0][-1] - expected_mtp[-1]).abs().max() > 1e-3 * float(
        expected_mtp[-1].abs().max())


@pytest.mark.parametrize("held, asked, says", [(1, None, "give --mtp-num-layers 1"), (1, 2, "give --mtp-num-layers 1"),
                                               (None, 1, "drop --mtp-num-layers")])
def test_upcycling_refuses_another_number_of_mtp_layers(megatron_single_rank, held, asked, says):
    def state(norm, mtp_num_layers):
        config = case_config(ModelCase(mtp_num_layers=mtp_num_layers), Layout())
        return build_gpt_chunks(config, norm, 128, 16)[0].state_dict()

    with pytest.raises(ValueError, match=f"holds {held or 0} multi-token prediction layers?, the flags describe "
                                         f"{asked or 0}: {says}"):
        upcycled_state(state("pre", held), state("siamese", asked), False)


TINY = dict(num_layers=4, hidden_size=64, seq_length=64, micro_batch_size=4,
            global_batch_size=8, tp=1,
            init_method_std=0.2)  # far from a uniform guess: a wrong upcycled function shows in its loss


def pre_norm_checkpoint(args, directory) -> str:
    """A Pre-Norm model of ``args``' size, seeded, saved as a checkpoint (one rank); its directory."""
    launch(save_random, 1, dataclasses.replace(args, norm="pre", tp=1, pp=1), str(directory), 8)
    return str(directory)


def test_upcycle_command_and_analysis_on_trained_checkpoints(tmp_path, corpus_cache, monkeypatch, capsys):
    from megatron_siamese.inference import session
    from megatron_siamese.research.analysis import analyze, format_tables
    from megatron_siamese.research.upcycle import upcycle

    args = TrainArgs(**TINY, cache_dir=corpus_cache, output_dir=str(tmp_path / "upcycled"))
    pre = pre_norm_checkpoint(args, tmp_path / "pre" / "checkpoints")
    from megatron_siamese.training.checkpoint_files import CheckpointError

    with pytest.raises(CheckpointError, match=r"another model than the flags describe \(--num-layers"):
        upcycle(dataclasses.replace(args, num_layers=args.num_layers + 2), pre)
    with pytest.raises(CheckpointError, match=r"another model than the flags describe \(--mtp-num-layers unset -> 1"):
        upcycle(dataclasses.replace(args, mtp_num_layers=1), pre)
    with monkeypatch.context() as unrecorded:  # Megatron-LM's checkpoint records no settings: its tensors tell
        read = session.read_checkpoint
        unrecorded.setattr(session, "read_checkpoint", lambda path: dataclasses.replace(read(path), settings=None))
        with pytest.raises(CheckpointError, match="holds 0 multi-token prediction layers, the flags describe 1: "
                                                  "drop --mtp-num-layers"):
            upcycle(dataclasses.replace(args, mtp_num_layers=1), pre)
    path = upcycle(args, pre)
    assert path.endswith("iter_0000000")  # a new model: its step 0
    # analyze given the checkpoints the wrong way round: said before any rank starts (it was a rank's failure
    # naming flags no one gave)
    from megatron_siamese.cli import main as cli_main

    upcycled = str(tmp_path / "upcycled" / "checkpoints")
    assert cli_main(["analyze", "--load", pre]) == 2
    assert cli_main(["analyze", "--load", upcycled, "--compare-load", upcycled]) == 2
    refused = capsys.readouterr().err
    assert "holds a pre model: analyze reads a siamese one (--compare-load takes the stock Pre-Norm one" in refused
    assert f"--compare-load {upcycled} holds a siamese model: it takes the stock Pre-Norm checkpoint" in refused
    results = analyze(dataclasses.replace(args, load=str(tmp_path / "upcycled" / "checkpoints"),
                                          output_dir=str(tmp_path / "analysis")), compare_load=pre)
    # at step 0 the X branch is off: its share is zero and the merge decodes exactly like y
    assert max(results["siamese"]["x_share_weights"]) == 0.0
    assert results["siamese"]["logit_lens"]["merge"][-1] == pytest.approx(results["siamese"]["logit_lens"]["y"][-1])
    # ... and the upcycled model's validation loss is the Pre-Norm one up to the norm epsilon, far
    # from the uniform guess (so a wrong function would show)
    base = results["pre"]["depth"]["base"][0]
    assert results["siamese"]["depth"]["base"][0] == pytest.approx(base, rel=2e-3)
    assert abs(base - math.log(320)) > 0.5
    table = format_tables(results)
    assert "effective depth" in table and "drop last 1/4:" in table and "2/4:" in table
    for name in ("contribution.png", "logit_lens.png", "magnitude.png", "depth.png", "pruning.png"):
        assert (tmp_path / "analysis" / name).stat().st_size > 5_000


def test_upcycle_carries_the_mtp_layers(tmp_path, corpus_cache, monkeypatch):
    """A Pre-Norm checkpoint trained with MTP upcycles with its MTP layers' weights as they are and
    the same MTP losses (up to the eps effect); into another number of MTP layers it is refused,
    also when the checkpoint records no settings (Megatron-LM's: its tensors tell)."""
    from conftest import single_rank

    from megatron_siamese.inference import session
    from megatron_siamese.research.upcycle import upcycle
    from megatron_siamese.training.checkpoint_files import CheckpointError

    smallest = dict(TINY, mtp_num_layers=1)
    args = TrainArgs(**smallest, cache_dir=corpus_cache, output_dir=str(tmp_path / "upcycled"))
    pre_checkpoint = pre_norm_checkpoint(args, tmp_path / "pre" / "checkpoints")
    with pytest.raises(CheckpointError, match=r"another model than the flags describe \(--mtp-num-layers 1 -> unset"):
        upcycle(dataclasses.replace(args, mtp_num_layers=None), pre_checkpoint)
    with monkeypatch.context() as unrecorded:  # Megatron-LM's checkpoint records no settings: its tensors tell
        read = session.read_checkpoint
        unrecorded.setattr(session, "read_checkpoint", lambda path: dataclasses.replace(read(path), settings=None))
        for flags in (None, 2):
            with pytest.raises(CheckpointError, match="it holds 1 multi-token prediction layer, the flags describe "
                                                      f"{flags or 0}: give --mtp-num-layers 1"):
                upcycle(dataclasses.replace(args, mtp_num_layers=flags), pre_checkpoint)
    upcycled = upcycle(args, pre_checkpoint)

    text = b"In the beginning God created the heaven and the earth. And the earth was without form, and void."
    tokens = torch.tensor([list(text[:args.seq_length + 1])])
    with single_rank():
        pre, siamese = session.open_session(pre_checkpoint), session.open_session(upcycled)
        try:
            assert siamese.settings.norm == "siamese" and siamese.settings.mtp_num_layers == 1
            pre_state, siamese_state = pre.chunks[0].state_dict(), siamese.chunks[0].state_dict()
            mtp_weights = [name for name in pre_state if name.startswith("mtp.") and "_extra_state" not in name]
            assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight"} <= set(mtp_weights)
            for name in mtp_weights:
                torch.testing.assert_close(siamese_state[name], pre_state[name], rtol=0, atol=0, msg=name)
            (expected,), expected_main = mtp_losses_of(pre.chunks[0], tokens, monkeypatch)
            (actual,), main = mtp_losses_of(siamese.chunks[0], tokens, monkeypatch)
            # the eps effect: each normalization of a normalized vector moves it ~eps / variance
            torch.testing.assert_close(actual.sum(), expected.sum(), rtol=2e-3, atol=0)
            torch.testing.assert_close(main.mean(), expected_main.mean(), rtol=2e-3, atol=0)
            # planted: the MTP layer's input projection not carried over (left as initialized)
            with torch.no_grad():
                projection = siamese.chunks[0].mtp.layers[0].eh_proj.weight
                std = args.init_method_std  # initialized as the saved one was, from another seed
                projection.copy_(std * torch.randn(projection.shape, generator=torch.Generator().manual_seed(7)))
            (planted,), _ = mtp_losses_of(siamese.chunks[0], tokens, monkeypatch)
            # token by token (their sums agree to about 2% for two random projections)
            assert float((planted - expected).abs().max() / expected.abs().max()) > 0.1
            assert float((actual - expected).abs().max() / expected.abs().max()) < 1e-2
        finally:
            siamese.close()
            pre.close()


def test_addition_problems_and_scoring():
    train_set, test_set = split(digits=3, train_count=500, test_count=50, seed=1)
    assert not set(train_set) & set(test_set)
    assert line(347, 58) == "347+58=405\n"

    class Oracle(torch.nn.Module):
        """Emits the right digits: scores 1.0 with the same decoding loop the study uses."""

        def __init__(self):
            super().__init__()
            self.anchor = torch.nn.Parameter(torch.zeros(1))

        def forward(self, tokens, positions, mask):
            from megatron_siamese.data.corpus import ByteTokenizer

            logits = torch.full((*tokens.shape, 320), -1e9)
            tokenizer = ByteTokenizer()
            for row, ids in enumerate(tokens.tolist()):
                text = tokenizer.detokenize(ids).split("\n")[-1]
                if not text:  # answered: keep closing lines
                    logits[row, -1, ord("\n")] = 0.0
                    continue
                problem, _, done = text.partition("=")
                a, b = (int(v) for v in problem.split("+"))
                answer = f"{a + b}\n"
                logits[row, -1, ord(answer[len(done)] if len(done) < len(answer) else "\n")] = 0.0
            return logits

    assert exact_match_accuracy(Oracle(), digits=3, count=40, seed=1) == 1.0
    # the reversed task scores against reversed sums: the forward-writing oracle fails it
    assert line(347, 58, reverse=True) == "347+58=504\n"
    assert exact_match_accuracy(Oracle(), reverse=True, digits=3, count=40, seed=1) < 0.5


STUDY_MODEL = ("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
               "--max-position-embeddings", "64", "--normalization", "LayerNorm", "--swiglu", "--disable-bias-linear",
               "--position-embedding-type", "rope", "--micro-batch-size", "8", "--global-batch-size", "8",
               "--lr-decay-style", "cosine", "--eval-iters", "2")


@pytest.mark.skipif(not ships_megatron_training(), reason="megatron-core < 0.17: no Megatron-LM loop to run")
def test_study_reports_losses_divergence_spikes_and_accuracy(tmp_path):
    """The study on Megatron-LM's loop: every run of the grid, its losses from its TensorBoard
    events, lr 1e3 reported diverged (not a crash), the addition runs scored from their checkpoints."""
    from megatron_siamese.research.study import StudyPlan, run_study, tables

    plan = StudyPlan(output_dir=str(tmp_path / "study"), cache_dir=str(tmp_path / "cache"),
                     schemes=("pre", "ablation"), learning_rates=(1e-3, 1e3), seeds=(1,), steps=6, eval_interval=6,
                     warmup_steps=2, short_warmup_steps=1, short_warmup_schemes=("pre",),
                     short_warmup_learning_rates=(1e-3, 1e3), short_warmup_seeds=(1,), arithmetic_steps=4,
                     arithmetic_seeds=(1,), arithmetic_schemes=("pre", "siamese"), model_flags=STUDY_MODEL)
    study = run_study(plan, echo=lambda line: None)
    assert len(study["runs"]) == 2 * 2 + 2 + 2  # two arms x two rates, pre again at warmup 1, addition
    # each run is the model its arm names: Megatron-LM printed the arguments it ran with
    ablation_log = (tmp_path / "study" / "lm-ablation-lr0.001-seed1-warmup2" / "train.log").read_text()
    for setting, value in (("norm", "siamese-hybrid"), ("siamese_input_norm", "False"),
                           ("siamese_depth_scale", "False"), ("train_iters", "6"), ("lr", "0.001")):
        assert re.search(rf"^\s*{setting} \.+ {re.escape(value)}$", ablation_log, re.M), setting
    for key, run in study["runs"].items():
        assert sorted(map(int, run["train_losses"])) == list(range(1, 7 if key.startswith("lm|") else 5))
    table = tables(study)
    panels = table.split("### Warmup ")[1:]
    assert [panel.split(" ")[0] for panel in panels] == ["2", "1"]
    for panel, arms in zip(panels, [("pre", "ablation"), ("pre",)]):
        rows = {line.split("|")[1].strip(): line for line in panel.split("\n\n")[1].splitlines()[2:]}
        assert sorted(rows) == sorted(arms)
        for arm in arms:
            ordinary, aggressive = rows[arm].split("|")[2:4]
            assert "diverged" not in ordinary and "diverged" in aggressive  # lr 1e3 blows up
    # the addition runs are scored on the 500 held-out problems, the LM runs not at all ...
    accuracy = {key.split("|")[1]: r["accuracy"] for key, r in study["runs"].items()
                if key.startswith("addition-reversed|")}
    assert sorted(accuracy) == ["pre", "siamese"]
    assert all(abs(a * 500 - round(a * 500)) < 1e-9 for a in accuracy.values())
    assert all(r["accuracy"] is None for key, r in study["runs"].items() if key.startswith("lm|"))
    # ... and the addition table reports exactly those scores
    addition = table.split("held-out problems")[1].split("\n\n")[1]
    addition_rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in addition.splitlines()[2:]}
    assert addition_rows == {scheme: f"{a:.3f}" for scheme, a in accuracy.items()}
    assert (tmp_path / "study" / "study_curves.png").stat().st_size > 5_000
    assert (tmp_path / "study" / "results.md").read_text() == table
    with pytest.raises(ValueError, match="unknown schemes"):
        run_study(dataclasses.replace(plan, schemes=("pre", "postnorm")))


@pytest.mark.skipif(not ships_megatron_training(), reason="megatron-core < 0.17: no Megatron-LM loop to run")
@pytest.mark.parametrize("lost", [False, True], ids=["delivered", "raised where it is lost"])
def test_ctrl_c_stops_the_study_and_starts_no_further_run(tmp_path, corpus_cache, monkeypatch, lost):
    """Ctrl-C reaches study's main thread, its runs' agents running on the pool's threads: no further run
    starts, the running runs' ranks are sent SIGINT (their agents are not told), and it says what finished.
    It waited for good before, for runs that ended without a result. Python's own KeyboardInterrupt, raised
    wherever the main thread stands, was once raised in a weakref callback, which swallowed it (CI run au):
    the handler's exception lost is the second case, which the study went on through."""
    import signal
    import threading
    import time

    from megatron_siamese.research import study

    started, interrupted, said = [], [], []

    def train_run(plan, job):
        started.append(job.key)
        if len(started) == 1:
            time.sleep(0.2)  # the runs under way
            if lost:  # the SIGINT handler run where what it raises goes nowhere
                try:
                    signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
                except KeyboardInterrupt:
                    pass
            else:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # Ctrl-C, to this process only
        time.sleep(0.5)
        return study.RunResult([], {1: 5.0}, {1: 5.0})

    monkeypatch.setattr(study, "train_run", train_run)
    monkeypatch.setattr(study, "_interrupt_running_ranks", lambda: interrupted.append(len(started)))
    plan = study.StudyPlan(output_dir=str(tmp_path / "study"), cache_dir=corpus_cache)
    with pytest.raises(KeyboardInterrupt):
        study.run_study(plan, echo=said.append)
    assert len(started) == plan.workers < len(study.jobs_of(plan)) and interrupted == [plan.workers]
    assert said[-1].startswith(f"stopped: {plan.workers} runs had finished")  # those under way, ended
    assert not (tmp_path / "study" / "study.json").exists()


@pytest.mark.skipif(not ships_megatron_training(), reason="megatron-core < 0.17: no Megatron-LM loop to run")
def test_study_says_what_it_runs_first_and_its_flags_reach_every_panel(tmp_path, corpus_cache, monkeypatch, capsys):
    """Its first line counts the runs and says where they go and what each run's line means; --seeds is every
    language-modelling panel's (the short-warmup panel its first), --arithmetic-train-iters 0 runs no addition;
    a mean of one seed is no "± 0.000". (It said nothing for the first runs' 100 s, ran 3 addition seeds
    whatever --seeds said, and refused 0.)"""
    from megatron_siamese.cli import main
    from megatron_siamese.research import study

    ran = []

    def train_run(plan, job):
        ran.append(job)
        return study.RunResult([], {1: 5.0}, {1: 1.0 + job.seed / 10})

    monkeypatch.setattr(study, "train_run", train_run)
    assert main(["study", "--schemes", "pre,siamese", "--learning-rates", "1e-3", "--seeds", "7",
                 "--arithmetic-train-iters", "0", "--output-dir", str(tmp_path / "study"),
                 "--cache-dir", corpus_cache]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"study: {len(ran)} runs ({len(ran)} language modelling, 0 addition), 2 at a time")
    assert {job.task for job in ran} == {"lm"} and {job.seed for job in ran} == {7}
    assert {job.warmup for job in ran} == {50, 10}  # both panels
    results = (tmp_path / "study" / "results.md").read_text()
    assert "| pre | 1.700 |" in results and "±" not in results.split("###")[1] and "held-out" not in results


@pytest.mark.skipif(ships_megatron_training(), reason="megatron-core >= 0.17 runs the study")
def test_study_is_refused_without_megatron_lms_loop(tmp_path):
    from megatron_siamese.research.study import StudyPlan, run_study
    from megatron_siamese.runtime.registry import ConfigError

    with pytest.raises(ConfigError, match=r"megatron-siamese study runs Megatron-LM's own training loop, which needs "
                                          r"megatron-core >= 0\.17 .*has megatron-core 0\.16\.1"):
        run_study(StudyPlan(output_dir=str(tmp_path / "study")))
    assert not (tmp_path / "study").exists()


@pytest.mark.stack_independent
def test_a_loss_spike_is_a_rise_above_the_lowest_loss_so_far():
    from megatron_siamese.research.study import SPIKE_MARGIN, spikes

    losses = {1: 5.8, 2: 4.0, 3: 3.1, 4: 3.0 + SPIKE_MARGIN + 0.5, 5: 6.0, 6: 3.2, 7: 3.1, 8: float("nan"), 9: 2.9}
    assert spikes(losses) == [4, 8]  # one spike over steps 4-5, then a non-finite loss
    assert spikes({1: 5.8, 2: 4.0, 3: 3.0 + SPIKE_MARGIN}) == []  # within the margin: noise


# written by an earlier release (tests/data/step_layout/README.md says how, and what it logged)
STEP_LAYOUT = Path(__file__).resolve().parent / "data" / "step_layout" / "checkpoints"
STEP_LAYOUT_MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16"]


def test_analyze_reads_an_earlier_release_checkpoint_whatever_its_schedule(tmp_path, corpus_cache):
    # the checkpoint was trained with 1 warm-up step of 4: analyze's defaults (300 steps, 30 warm-up)
    # must not be checked against it (Megatron's scheduler asserted "warmup iterations do not match")
    from cli_runs import cli

    done = cli("analyze", *STEP_LAYOUT_MODEL, "--load", STEP_LAYOUT, "--cache-dir", corpus_cache,
               "--output-dir", tmp_path / "analysis")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "effective depth" in done.stdout
    assert sorted(p.name for p in (tmp_path / "analysis").glob("*.png")) == [
        "contribution.png", "depth.png", "logit_lens.png", "magnitude.png", "pruning.png"]

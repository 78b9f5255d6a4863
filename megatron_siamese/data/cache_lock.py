"""One builder at a time in a data cache directory that concurrent jobs share.

An indexed dataset is not written atomically, and another job maps it once both files exist ("mmap
length is greater than file size" mid-write). So a corpus is built under an exclusive ``flock`` on
``<cache_dir>/LOCK_FILE``, looking again once held: a second job waits, then reads whole files.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Iterator

LOCK_FILE = ".megatron-siamese-build.lock"


@contextlib.contextmanager
def building(cache_dir: str) -> Iterator[None]:
    """Hold ``cache_dir``'s build lock for the block (waiting for another job's build to end)."""
    os.makedirs(cache_dir, exist_ok=True)
    fd = os.open(os.path.join(cache_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without flock (ENOLCK): unguarded, as Megatron itself is
            pass
        yield
    finally:
        os.close(fd)  # drops the lock

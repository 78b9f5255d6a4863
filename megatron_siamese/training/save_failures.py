"""What a failed checkpoint save says: a full disk in one line naming the tracker's last complete
checkpoint (rank 0 removes the partial directory), any other error as it was."""

from __future__ import annotations

import errno
import os
import shutil
import time
from typing import Optional

from megatron_siamese.training.checkpoint_files import TRACKER, CheckpointError, resolve


def failed(error: BaseException, directory: str, name: str, rank0: bool) -> BaseException:
    """A CheckpointError for a full disk (rank 0 removes the partial directory), else ``error``.

    Rank 0 coordinates torch's writer and holds every rank's write errors; the others only learn
    that the save failed, so they give rank 0's one line a moment to be the one reported.
    """
    full = disk_full(error, directory)
    if rank0:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    elif full is None:
        time.sleep(3.0)
        return CheckpointError(f"saving {name} to {directory} failed on another rank (rank 0 says why)")
    if full is None:
        return error
    try:
        kept = os.path.basename(resolve(directory))
    except CheckpointError:
        kept = None
    return CheckpointError(f"disk full while saving {name} to {directory}: {full}; "
                           + (f"{TRACKER} still names {kept}" if kept else "no complete checkpoint was saved before")
                           + ": free space, then resume with --load (or save elsewhere: --output-dir)")


def disk_full(error: BaseException, directory: str) -> Optional[str]:
    """What says the disk is full: an ENOSPC anywhere in ``error`` (torch's writer wraps each
    rank's), or (almost) no space left on the device (e.g. torch.save's "unexpected pos")."""
    seen, pending = set(), [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return f"{os.strerror(errno.ENOSPC)} ({current.filename or directory})"
        if "No space left on device" in str(current):
            return f"{os.strerror(errno.ENOSPC)} ({directory})"
        pending += [current.__cause__, current.__context__]
        pending += [failure[0] if isinstance(failure, tuple) else failure
                    for failure in (getattr(current, "failures", None) or {}).values()]
    try:  # megatron-core 0.19's writer keeps only the error's class: the device then says it
        free = shutil.disk_usage(directory).free
    except OSError:
        return None
    return f"{os.strerror(errno.ENOSPC)} ({free} bytes free)" if free < 16 * 2**20 else None

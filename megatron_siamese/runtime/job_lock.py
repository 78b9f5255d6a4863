"""One live job per output directory: a lock file the process speaking for the job holds.

``hold(directory)`` takes an exclusive ``fcntl.flock`` on ``directory/LOCK_FILE`` for as long
as the returned lock stays open, and writes who holds it (pid, host, start time, command).
A second job asking for the same directory gets ``InUse`` at once, naming the first. The
kernel drops the lock when its holder dies, however it dies (``kill -9`` too), so a dead
job's lock file blocks nothing: the next job takes it over. On a shared file system the lock
is as good as its ``flock`` (NFSv4 and Lustre with ``flock`` mounts hold it across nodes).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from typing import Optional

LOCK_FILE = ".megatron-siamese.lock"


class InUse(RuntimeError):
    """Another live job holds the directory; the message names it and says what to do."""


class Lock:
    def __init__(self, fd: int, path: str, made_directory: bool):
        self.fd, self.path, self.made_directory = fd, path, made_directory

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock; the file may stay
            self.fd = None

    def abandon(self) -> None:
        """Release for a job that never started (its settings were refused): its lock file goes,
        and the directory too if the lock made it and nothing else is in it."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)  # while still held: no other job is between the unlink and the close
        except OSError:
            pass
        self.release()
        if self.made_directory:
            try:
                os.rmdir(os.path.dirname(self.path))
            except OSError:
                pass  # not empty (or gone): left as it is

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def hold(directory: str, flag: str = "--output-dir") -> Optional[Lock]:
    """Lock ``directory`` for this job (None when the directory cannot be made or written: the
    checks before the first step say so in their words). Raises ``InUse`` when a live job
    holds it."""
    path = os.path.join(directory, LOCK_FILE)
    made_directory = not os.path.isdir(directory)
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = _holder(fd)
        os.close(fd)
        since = f", since {who['started']}" if who.get("started") else ""
        pid = who.get("pid", "?")
        raise InUse(f"{flag} {directory} is in use by a running job (pid {pid} on {who.get('host', '?')}{since}): "
                    f"wait for it to end, stop it (kill -TERM {pid} saves a checkpoint and exits), or choose "
                    f"another {flag}") from None
    except OSError:  # a file system without flock: no lock rather than no run
        os.close(fd)
        return None
    record = dict(pid=os.getpid(), host=socket.gethostname(), started=time.strftime("%Y-%m-%d %H:%M:%S"),
                  command=" ".join(sys.argv))
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
    except OSError:
        pass  # held all the same; only the name of the holder is missing
    return Lock(fd, path, made_directory)

"""A full disk for tests, in every process of a run (this directory on PYTHONPATH).

With ``MEGATRON_SIAMESE_TEST_ENOSPC=<text>``, ``os.fsync`` of a checkpoint shard file whose path
contains the text fails with ENOSPC, as a full disk fails a write (Megatron's torch_dist writer
fsyncs every shard file it wrote)."""

import os

_PART = os.environ.get("MEGATRON_SIAMESE_TEST_ENOSPC")
if _PART:
    import errno

    _fsync = os.fsync

    def _full_disk_fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith(".distcp") and _PART in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return _fsync(fd)

    os.fsync = _full_disk_fsync

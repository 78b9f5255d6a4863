"""A full disk for tests, in every process of a run (this directory on PYTHONPATH).

With ``MEGATRON_SIAMESE_TEST_ENOSPC=<text>``, ``os.fsync`` of a checkpoint shard file whose path
contains the text fails with ENOSPC, as a full disk fails a write (Megatron's torch_dist writer
fsyncs every shard file it wrote), and from then on ``os.statvfs`` reports no free space (megatron-core
0.19's writer keeps only the error's class, so a full disk is recognized by its free space)."""

import os

_PART = os.environ.get("MEGATRON_SIAMESE_TEST_ENOSPC")
if _PART:
    import errno

    _fsync, _statvfs = os.fsync, os.statvfs
    _full = []  # once a write failed, the device also reports no space left, as a full one does

    def _full_disk_fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith(".distcp") and _PART in path:
            _full.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return _fsync(fd)

    def _full_disk_statvfs(path):
        found = _statvfs(path)
        if not _full:
            return found
        return os.statvfs_result((found.f_bsize, found.f_frsize, found.f_blocks, 0, 0, found.f_files,
                                  found.f_ffree, found.f_favail, found.f_flag, found.f_namemax))

    os.fsync, os.statvfs = _full_disk_fsync, _full_disk_statvfs

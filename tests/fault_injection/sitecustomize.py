"""Faults for tests, in every process of a run (this directory on PYTHONPATH): a full disk, a hung rank.

With ``MEGATRON_SIAMESE_TEST_ENOSPC=<text>``, ``os.fsync`` of a checkpoint shard file whose path
contains the text fails with ENOSPC, as a full disk fails a write (Megatron's torch_dist writer
fsyncs every shard file it wrote), and from then on ``os.statvfs`` reports no free space (megatron-core
0.19's writer keeps only the error's class, so a full disk is recognized by its free space).

With ``MEGATRON_SIAMESE_TEST_HANG=<rank>:<n>``, that rank of the job sleeps inside its n-th call
of ``torch.distributed.all_reduce`` and never returns: a rank that hangs inside a step, while the
others wait for it in that collective. Every other rank drops the wrapper at its first call.

With ``MEGATRON_SIAMESE_TEST_SLOW_SAVE=<text>``, ``os.fsync`` of a checkpoint shard file whose
path contains the text never returns: a checkpoint writer still writing when the job is killed.

With ``MEGATRON_SIAMESE_TEST_READS=<file>``, every read of a torch_dist checkpoint's shards
(torch's ``FileSystemReader.read_data``) appends "<rank> <bytes>" to that file: what each rank
read of the shard files (rank -1: a process outside the job's groups)."""

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

_SLOW = os.environ.get("MEGATRON_SIAMESE_TEST_SLOW_SAVE")
if _SLOW:
    import time

    _plain_fsync = os.fsync

    def _fsync_that_never_ends(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        while path.endswith(".distcp") and _SLOW in path:
            time.sleep(60)
        return _plain_fsync(fd)

    os.fsync = _fsync_that_never_ends

_HANG = os.environ.get("MEGATRON_SIAMESE_TEST_HANG")
if _HANG:
    import time

    import torch.distributed

    _hung_rank, _hung_call = (int(part) for part in _HANG.split(":"))
    _all_reduce, _calls = torch.distributed.all_reduce, []

    def _all_reduce_that_hangs(*args, **kwargs):
        if torch.distributed.get_rank() != _hung_rank:
            torch.distributed.all_reduce = _all_reduce  # this rank never hangs: out of its stacks
            return _all_reduce(*args, **kwargs)
        _calls.append(None)
        if len(_calls) == _hung_call:
            while True:
                time.sleep(60)
        return _all_reduce(*args, **kwargs)

    torch.distributed.all_reduce = _all_reduce_that_hangs

_READS = os.environ.get("MEGATRON_SIAMESE_TEST_READS")
if _READS:
    import torch.distributed
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    _read_data = FileSystemReader.read_data

    def _counted_read_data(self, plan, planner):
        read = sum(self.storage_data[item.storage_index].length for item in plan.items)
        with open(_READS, "a") as log:
            # -1: a process outside the job (the launcher reading a checkpoint's settings before the ranks start)
            log.write(f"{torch.distributed.get_rank() if torch.distributed.is_initialized() else -1} {read}\n")
        return _read_data(self, plan, planner)

    FileSystemReader.read_data = _counted_read_data

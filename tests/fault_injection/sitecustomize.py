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

With ``MEGATRON_SIAMESE_TEST_USE_AFTER_FREE=<rank>``, after that rank's first
``torch.distributed.all_reduce`` its result is also copied (memmove) into a staging buffer that was
freed just before, as a collective that finishes after its buffer was released writes
(scripts/sanitize.sh must report it, with either tool).

With ``MEGATRON_SIAMESE_TEST_UNWAITED=<file>``, every asynchronous collective a rank issues
(``async_op=True``, or a coalescing manager's ``async_ops=True``) is tracked until something waits
on it, and when the rank tears down Megatron's process groups (the end of a checked layout) it
appends "<rank> <count>" to that file, the count of those never waited on; with
``MEGATRON_SIAMESE_TEST_LEAVE_ONE=1`` too, each rank also issues one all-reduce it never waits on
(the control: the count can be other than 0).

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

_FREED = os.environ.get("MEGATRON_SIAMESE_TEST_USE_AFTER_FREE")
if _FREED:
    import ctypes

    import torch.distributed

    _freeing_rank, _reducing = int(_FREED), torch.distributed.all_reduce

    def _all_reduce_then_write_into_freed_memory(tensor, *args, **kwargs):
        reduced = _reducing(tensor, *args, **kwargs)
        if torch.distributed.get_rank() == _freeing_rank:
            torch.distributed.all_reduce = _reducing  # once
            staging = torch.empty_like(tensor)
            address, nbytes = staging.data_ptr(), staging.numel() * staging.element_size()
            del staging  # freed: the result lands in it anyway, as from a collective that finished too late
            ctypes.memmove(address, tensor.data_ptr(), nbytes)
        return reduced

    torch.distributed.all_reduce = _all_reduce_then_write_into_freed_memory

_UNWAITED = os.environ.get("MEGATRON_SIAMESE_TEST_UNWAITED")
if _UNWAITED:
    import contextlib
    import functools

    import torch
    import torch.distributed

    _issued = []  # [work, waited]
    _Work = torch._C._distributed_c10d.Work
    _wait = _Work.wait

    def _track(work):
        if isinstance(work, _Work) and type(work).__name__ != "_IllegalWork":
            _issued.append([work, False])
        return work

    def _waited(self, *args, **kwargs):
        for entry in _issued:
            if entry[0] is self:
                entry[1] = True
        return _wait(self, *args, **kwargs)

    _Work.wait = _waited

    def _tracked(collective):
        @functools.wraps(collective)
        def issue(*args, **kwargs):
            return _track(collective(*args, **kwargs))
        return issue

    for _name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather", "broadcast"):
        setattr(torch.distributed, _name, _tracked(getattr(torch.distributed, _name)))
    _coalescing = torch.distributed._coalescing_manager

    @contextlib.contextmanager
    def _tracked_coalescing(group=None, device=None, async_ops=False):
        with _coalescing(group, device, async_ops) as manager:
            yield manager
        for work in manager.works if async_ops else ():
            _track(work)

    torch.distributed._coalescing_manager = _tracked_coalescing

    import megatron.core.parallel_state as _parallel_state

    _destroy = _parallel_state.destroy_model_parallel

    def _destroy_and_count(*args, **kwargs):
        if os.environ.get("MEGATRON_SIAMESE_TEST_LEAVE_ONE"):
            torch.distributed.all_reduce(torch.zeros(1), async_op=True)
        with open(_UNWAITED, "a") as log:
            log.write(f"{torch.distributed.get_rank()} {sum(not waited for _, waited in _issued)}\n")
        _issued.clear()
        return _destroy(*args, **kwargs)

    _parallel_state.destroy_model_parallel = _destroy_and_count

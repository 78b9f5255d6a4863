"""Faults for tests, in every process of a run (this directory on PYTHONPATH): memory written
after it was freed, collectives nobody waits on.

With ``MEGATRON_SIAMESE_TEST_USE_AFTER_FREE=<rank>``, after that rank's first
``torch.distributed.all_reduce`` its result is also copied (memmove) into a staging buffer that was
freed just before, as a collective that finishes after its buffer was released writes
(scripts/sanitize.sh must report it, with either tool).

With ``MEGATRON_SIAMESE_TEST_UNWAITED=<file>``, every asynchronous collective a rank issues
(``async_op=True``, or a coalescing manager's ``async_ops=True``) is tracked until something waits
on it, and when the rank tears down Megatron's process groups (the end of a checked layout) it
appends "<rank> <count> <issued>" to that file, the count of those never waited on and of all it issued; with
``MEGATRON_SIAMESE_TEST_LEAVE_ONE=1`` too, each rank also issues one all-reduce it never waits on
(the control: the count can be other than 0).
"""

import os

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
            log.write(f"{torch.distributed.get_rank()} {sum(not waited for _, waited in _issued)} {len(_issued)}\n")
        _issued.clear()
        return _destroy(*args, **kwargs)

    _parallel_state.destroy_model_parallel = _destroy_and_count

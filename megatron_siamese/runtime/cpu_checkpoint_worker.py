"""Megatron's persistent checkpoint worker on CPU (``--async-save --use-persistent-ckpt-worker``).

The worker's first act is ``torch.cuda.set_device(rank % torch.cuda.device_count())``: with no GPU it
divides by zero, dies, and the ranks wait for their saves forever. ``install`` points its entry at
``async_loop`` here, which gives the worker the CPU shim and one device, the CPU, and has it end with its
rank rather than on a stop signal sent to the job's process group.
"""

from __future__ import annotations

_megatrons_loop = None  # PersistentAsyncCaller.async_loop before install() (a forked worker inherits it)


def async_loop(*args, **kwargs):
    import os

    # out of the job's process group, first (its imports take seconds): a stop signal sent to the whole group
    # (a scheduler's, Ctrl-C) killed it before the save its rank, under --exit-signal-handler, was finishing,
    # and the rank waited for that save forever. It ends with its rank, or when Megatron closes it.
    os.setpgid(0, 0)
    import multiprocessing

    import torch

    from megatron_siamese.runtime import cpu_shim, orphans

    # ends with its rank (the process that asked for it): its fork server lives as long as it does
    # (it holds the server's keep-alive pipe), so neither would end otherwise
    rank = multiprocessing.parent_process()
    if rank is not None:
        orphans.watch(rank.pid)

    cpu_shim.install()
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *args, **kwargs: None
    if _megatrons_loop is not None:
        return _megatrons_loop(*args, **kwargs)
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    return PersistentAsyncCaller.async_loop(*args, **kwargs)  # a spawned worker: Megatron's, unpatched there


def install() -> None:
    global _megatrons_loop
    try:
        from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller
    except ImportError:  # a megatron-core without the persistent worker
        return
    if _megatrons_loop is None:
        _megatrons_loop = PersistentAsyncCaller.async_loop
        PersistentAsyncCaller.async_loop = staticmethod(async_loop)

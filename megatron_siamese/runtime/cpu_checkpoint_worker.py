"""Megatron's asynchronous checkpoint saves on CPU (``--async-save``).

A save stages the state in host memory (``FileSystemWriterAsync.preload_tensors``, a copy from the GPU) and
the rank trains on while a worker writes it. On the CPU ``.to("cpu")`` is the tensor itself: the worker
wrote the live state, and an optimizer step taken during the write went into the checkpoint (a run resumed
from it was not the uninterrupted one); and handing a live CPU tensor to the persistent worker moves its
memory into shared memory, under the rank's feet. ``install`` has the rank stage copies before any worker
sees the state (``stage_copies``), which is the wait the rank has on a GPU too.

Its persistent worker (``--use-persistent-ckpt-worker``) first calls
``torch.cuda.set_device(rank % torch.cuda.device_count())``: with no GPU it divides by zero, dies, and the
ranks wait for their saves forever. ``install`` points its entry at
``async_loop`` here, which gives the worker the CPU shim and one device, the CPU, and has it end with its
rank rather than on a stop signal sent to the job's process group.
"""

from __future__ import annotations

_megatrons_loop = None  # PersistentAsyncCaller.async_loop before install() (a forked worker inherits it)
_megatrons_save_function_and_args = None  # FileSystemWriterAsync's, before install()


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


def stage_copies(write_buckets):
    """What ``FileSystemWriterAsync.preload_tensors`` stages, each tensor a copy, as its copy from the GPU is."""
    return [(file_name, storage_key, (bytes_data, [(item, tensor.to("cpu", copy=True)) for item, tensor in tensors]))
            for file_name, storage_key, (bytes_data, tensors) in write_buckets]


def staged_save_function_and_args(writer):
    """``FileSystemWriterAsync.get_save_function_and_args`` with the state staged now, by the rank: no preload
    left for a worker (its arguments' second is the write buckets, which Megatron's preload replaces)."""
    save, _, args = _megatrons_save_function_and_args(writer)
    return (save, None, args) if save is None else (save, None, [args[0], stage_copies(args[1]), *args[2:]])


def install() -> None:
    global _megatrons_loop, _megatrons_save_function_and_args
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    if _megatrons_save_function_and_args is None:
        _megatrons_save_function_and_args = FileSystemWriterAsync.get_save_function_and_args
        FileSystemWriterAsync.get_save_function_and_args = staged_save_function_and_args
    try:
        from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller
    except ImportError:  # a megatron-core without the persistent worker
        return
    if _megatrons_loop is None:
        _megatrons_loop = PersistentAsyncCaller.async_loop
        PersistentAsyncCaller.async_loop = staticmethod(async_loop)

"""The CPU shim leaves torch's device contexts working, during and after it (transformers loads
models under ``with torch.device("meta")``; export and eval load them in processes that ran
Megatron through the shim)."""

import subprocess
import sys

import pytest


# the first device context of a fresh process opened while the shim is installed: torch then
# builds its set of factory functions, which must hold the real factories, not the shim's wrappers
FIRST_CONTEXT_UNDER_THE_SHIM = """
import torch
from megatron_siamese.runtime import cpu_shim
cpu_shim.install()
with torch.device("meta"):
    during = torch.arange(3).device.type
cpu_shim.uninstall()
with torch.device("meta"):
    after = torch.arange(3).device.type
print(during, after)
"""


def test_device_context_applies_while_and_after_the_shim_is_installed():
    result = subprocess.run([sys.executable, "-c", FIRST_CONTEXT_UNDER_THE_SHIM], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["meta", "meta"]


@pytest.mark.stack_independent
def test_the_persistent_checkpoint_worker_leaves_the_jobs_process_group():
    """Megatron's persistent checkpoint worker (--async-save --use-persistent-ckpt-worker) on the shim: a stop
    signal sent to the job's process group (a scheduler's) killed it, importing, before the save its rank was
    finishing under --exit-signal-handler, and the rank waited forever. It leaves the group first, and ends
    when Megatron closes it."""
    import multiprocessing
    import os
    import time

    from megatron_siamese.runtime import cpu_checkpoint_worker

    context = multiprocessing.get_context("fork")
    requests, preloads, completions = context.JoinableQueue(), context.JoinableQueue(), context.Queue()
    worker = context.Process(target=cpu_checkpoint_worker.async_loop, args=(0, requests, preloads, completions))
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while os.getpgid(worker.pid) != worker.pid and time.monotonic() < deadline and worker.is_alive():
            time.sleep(0.05)
        assert os.getpgid(worker.pid) == worker.pid != os.getpgrp()
    finally:
        requests.put("DONE")  # Megatron's close()
        worker.join(60)
    assert worker.exitcode == 0



def test_an_async_save_writes_the_state_it_was_given_while_the_rank_trains_on(monkeypatch):
    """Megatron's async save stages the state in host memory (FileSystemWriterAsync's preload, a copy from the
    GPU) and the rank trains on while its worker writes. On the CPU ``.to("cpu")`` was the tensor itself: an
    optimizer step taken during the write went into the checkpoint, and a run resumed from it left the
    uninterrupted one (test_pretrain's killed rank, under CI's load); and handing the live tensor to the
    persistent worker moved its memory into shared memory. The rank stages copies, and no preload is left."""
    import torch
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron_siamese.runtime import cpu_checkpoint_worker

    cpu_checkpoint_worker.install()
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args: 0)
    writer = FileSystemWriterAsync("unused")
    weight = torch.ones(4)
    writer.write_buckets, writer.results_queue = [("file", "key", ([], [("item", weight)]))], None
    _, preload, (_, [(_, _, (_, [(_, staged)]))], _) = writer.get_save_function_and_args()
    weight.add_(1)  # the next optimizer step, taken while the worker writes
    assert preload is None and torch.equal(staged, torch.ones(4))

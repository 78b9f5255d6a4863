"""The multi-process launcher reports rank failures instead of hanging."""

import os
import time

import pytest

from megatron_siamese.runtime.launch import RankFailed, _context, launch


def _rank_and_world():
    import torch

    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def _raise_on_rank_one():
    import torch

    if torch.distributed.get_rank() == 1:
        raise ValueError("planted failure")
    return "ok"


def _report_cuda_refused(connection):
    import torch

    connection.send(torch.cuda._is_in_bad_fork())


def _die_without_reporting():
    os._exit(3)  # as a crash or a killed process would: no traceback, no result


def _print_then_die_on_rank_one():
    import torch

    if torch.distributed.get_rank() == 1:
        print("last words of rank 1", flush=True)
        os._exit(3)
    return "ok"


def test_launch_returns_results_in_rank_order():
    assert launch(_rank_and_world, 2) == [(0, 2), (1, 2)]


def test_a_raising_rank_fails_the_launch_with_its_traceback():
    with pytest.raises(RankFailed, match="planted failure"):
        launch(_raise_on_rank_one, 2, timeout_s=60)


def test_a_rank_that_dies_silently_fails_fast():
    start = time.monotonic()
    with pytest.raises(RankFailed, match="exited with code 3"):
        launch(_die_without_reporting, 2, timeout_s=120)
    assert time.monotonic() - start < 60  # not the timeout


def test_a_quiet_rank_s_output_is_in_its_failure_and_its_log_is_not_left_behind(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with pytest.raises(RankFailed, match="exited with code 3") as failure:
        launch(_print_then_die_on_rank_one, 2, timeout_s=120, quiet_ranks=(1,))
    assert "last words of rank 1" in failure.value.details
    assert launch(_rank_and_world, 2, quiet_ranks=(0, 1)) == [(0, 2), (1, 2)]
    assert list(tmp_path.iterdir()) == []


def test_nccl_ranks_are_processes_that_may_start_cuda():
    """The fork server's imports ask torch.cuda.is_available(); on a CUDA build of torch that
    forbids CUDA in every process forked from it, so NCCL ranks must start another way."""
    import torch

    def refused(backend):
        # a Process as the launcher starts ranks (not a Pool: the fork server ignores the stop
        # signals, so its children ignore the SIGTERM a Pool's exit ends its workers with)
        context = _context(backend)
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(target=_report_cuda_refused, args=(writer,))
        process.start()
        writer.close()
        try:
            return reader.recv()
        finally:
            process.join(timeout=60)

    assert refused("nccl") is False
    if torch.version.cuda:  # the trap is real where torch is a CUDA build (the 0.19 / Python 3.12 stack)
        assert refused("gloo") is True


def _close_then_raise_on_rank_one():
    """Rank 1 leaves the job (its connections close) and fails a moment later: rank 0, waiting
    on it, fails first, on the broken connection."""
    import torch

    if torch.distributed.get_rank() == 1:
        torch.distributed.destroy_process_group()
        time.sleep(3)
        raise ValueError("the planted cause")
    torch.distributed.barrier()
    return "ok"


def test_the_failure_reported_is_the_cause_not_a_peer_s_broken_connection():
    with pytest.raises(RankFailed) as failure:
        launch(_close_then_raise_on_rank_one, 2, timeout_s=120)
    assert str(failure.value).startswith("rank 1 of 2 failed: ValueError: the planted cause"), failure.value


def _close_the_store_on_rank_zero():
    """Rank 0, which hosts the job's rendezvous store, closes it and waits, alive and silent;
    rank 1, waiting on the store, loses its connection."""
    import gc

    import torch

    from megatron_siamese.runtime import launch as launched

    store = launched._job["store"]
    if torch.distributed.get_rank() == 0:
        torch.distributed.destroy_process_group()
        launched._job.clear()
        del store
        gc.collect()
        time.sleep(60)
    store.get("a key nobody sets")


def test_a_lost_store_connection_with_no_cause_found_says_so_with_every_rank_s_state(monkeypatch):
    monkeypatch.setattr("megatron_siamese.runtime.launch.PEER_REPORT_WAIT_S", 2.0)
    with pytest.raises(RankFailed) as failure:
        launch(_close_the_store_on_rank_zero, 2, timeout_s=120)
    summary = str(failure.value)
    assert summary.startswith("rank 1 of 2 failed: DistNetworkError: ") and "Connection was likely closed" in summary
    assert summary.endswith("(no rank died or reported another error within 2 s; still running: ranks 0)"), summary
    assert "-- rank 0: no report" in failure.value.details
    assert "(the job's rendezvous store: 127.0.0.1:" in failure.value.details

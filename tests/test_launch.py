"""The multi-process launcher reports rank failures instead of hanging."""

import os
import time

import pytest

from megatron_siamese.runtime.launch import RankFailed, ephemeral_ports, free_port, launch, start_method, start_rank_server

pytestmark = pytest.mark.once("the launch is ours and torch's; every multi-rank test starts its ranks through it on "
                              "every stack")


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


def _segfault_in_a_named_function_on_rank_one():
    import ctypes

    import torch

    if torch.distributed.get_rank() == 1:
        ctypes.string_at(0)  # reads address 0: SIGSEGV, as a crash in a native library would
    return "ok"


def test_launch_returns_results_in_rank_order_and_gives_back_the_callers_signal_handlers():
    """torch's agent, run in this process, sets its own handlers for SIGINT and SIGTERM: Ctrl-C
    after a launch must still be KeyboardInterrupt."""
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    assert launch(_rank_and_world, 2) == [(0, 2), (1, 2)]
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_raising_rank_fails_the_launch_with_its_traceback():
    with pytest.raises(RankFailed, match="planted failure"):
        launch(_raise_on_rank_one, 2, timeout_s=60)


def test_a_rank_that_dies_silently_fails_fast():
    start = time.monotonic()
    with pytest.raises(RankFailed, match="exited with code 3"):
        launch(_die_without_reporting, 2, timeout_s=120)
    assert time.monotonic() - start < 60  # not the timeout


def test_a_quiet_rank_s_output_is_in_its_failure_and_its_log_is_not_left_behind(tmp_path, monkeypatch):
    start_rank_server()  # before the temp dir moves: the fork server's own directory is not the logs'
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with pytest.raises(RankFailed, match="exited with code 3") as failure:
        launch(_print_then_die_on_rank_one, 2, timeout_s=120, quiet_ranks=(1,))
    assert "last words of rank 1" in failure.value.details
    assert launch(_rank_and_world, 2, quiet_ranks=(0, 1)) == [(0, 2), (1, 2)]
    assert list(tmp_path.iterdir()) == []


def test_a_crashed_rank_s_python_stack_is_in_its_failure():
    """A rank killed by SIGSEGV (a native crash: torch, gloo, a kernel) leaves no traceback of
    its own; faulthandler's dump of its Python stack says where it was."""
    with pytest.raises(RankFailed, match="killed by SIGSEGV") as failure:
        launch(_segfault_in_a_named_function_on_rank_one, 2, timeout_s=120, quiet_ranks=(0, 1))
    assert "Segmentation fault" in failure.value.details
    assert "_segfault_in_a_named_function_on_rank_one" in failure.value.details


def test_nccl_ranks_are_processes_that_may_start_cuda():
    """The fork server's imports ask torch.cuda.is_available(); on a CUDA build of torch that
    forbids CUDA in every process forked from it, so NCCL ranks must start another way."""
    import multiprocessing

    import torch

    def refused(backend):
        context = multiprocessing.get_context(start_method(backend))
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


def _slow_to_finish_forming_on_rank_zero():
    """Rank 0 finishes ``init_process_group`` 2 s after its connections are made (as a rank
    starved of CPU does); every rank says when it returned from ``on_first_ranks``, rank 0 when
    its group was formed."""
    import torch

    from megatron_siamese.runtime import job as launched

    formed = []
    if torch.distributed.get_rank() == 0:
        real = torch.distributed.init_process_group

        def slow(*args, **kwargs):
            real(*args, **kwargs)
            time.sleep(2.0)
            formed.append(time.time())

        torch.distributed.init_process_group = slow
    launched.on_first_ranks(1, lambda: None)
    returned = time.time()
    torch.distributed.barrier()  # the job's world, re-formed
    return formed[-1] if formed else returned


def test_on_first_ranks_returns_on_every_rank_only_once_every_rank_has_formed_the_world_again():
    """Otherwise a rank that goes on to re-form the groups again (the check, one layout after
    another) closes connections a slower rank is still completing (gloo: "Connection closed by
    peer" in connectFullMesh, seen on CI)."""
    rank0_formed, rank1_returned = launch(_slow_to_finish_forming_on_rank_zero, 2, timeout_s=120)
    assert rank1_returned >= rank0_formed


def _the_launchers_listening_ports(launcher_pid):
    import psutil

    return int(os.environ["MASTER_PORT"]), [c.laddr.port for c in psutil.Process(launcher_pid).net_connections("tcp")
                                             if c.status == psutil.CONN_LISTEN]


def test_the_rendezvous_store_is_served_by_the_launcher_on_a_port_it_holds():
    """Not a free port handed to rank 0 to bind later: another job could take it in between."""
    (port, listening), _ = launch(_the_launchers_listening_ports, 2, os.getpid(), timeout_s=120)
    assert port in listening


def _world_cannot_form_again_on_rank_one():
    from megatron_siamese.runtime import job as launched

    real = launched._init_group

    def failing(size, tag):
        if tag.startswith("world/") and launched.joined().rank == 1:
            raise RuntimeError("planted: connectFullMesh failed")
        real(size, tag)

    launched._init_group = failing
    launched.on_first_ranks(1, lambda: None)


def test_a_group_that_cannot_form_again_is_the_jobs_error_not_the_functions():
    with pytest.raises(RankFailed, match="rank 1 of 2 failed: RegroupError: the job's first 2 ranks could not form "
                                         r"their process group again \(RuntimeError: planted: connectFullMesh"):
        launch(_world_cannot_form_again_on_rank_one, 2, timeout_s=30)


def test_a_free_port_for_a_later_server_is_outside_the_kernels_ephemeral_range():
    """torchrun's --rdzv-endpoint and MASTER_PORT are picked before their server binds them: a port
    from the ephemeral range can meanwhile be given to any socket bound to 0 (another job's gloo
    listener), which torchrun's agents then reach ("Connection reset by peer")."""
    import socket

    low, high = ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports), (ports, low, high)
    for port in ports:  # each is free: a server can bind it
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))



def _hang_on_rank_one():
    """Rank 0 waits in a barrier; rank 1 never comes (it sleeps inside the same watched unit)."""
    import torch

    from megatron_siamese.runtime.hangs import watched

    with watched("the planted hang"):
        if torch.distributed.get_rank() == 1:
            time.sleep(120)
        torch.distributed.barrier()


def test_a_hung_rank_is_named_and_its_stack_is_in_the_failure():
    """The rank that timed out names the one that never came; that rank, still running when torch's
    agent stopped the job, left where it hung in its output (faulthandler's dump at the timeout)."""
    start = time.monotonic()
    with pytest.raises(RankFailed) as failure:
        launch(_hang_on_rank_one, 2, timeout_s=6, quiet_ranks=(0, 1))
    assert time.monotonic() - start < 60
    assert str(failure.value).startswith("rank 0 of 2 failed: CollectiveTimeout: "), failure.value
    assert "in the planted hang" in str(failure.value) and "rank 1 of 2 never reached it" in str(failure.value)
    hung = failure.value.details.split("-- rank 1: ", 1)[1]
    assert hung.startswith("still running when the job stopped") and "Timeout (0:00:06)!" in hung, hung
    assert "_hang_on_rank_one" in hung


def _interrupted_on_rank_one():
    import torch

    if torch.distributed.get_rank() == 1:
        raise KeyboardInterrupt  # what Ctrl-C raises in a rank
    return "ok"


def test_a_rank_ended_by_ctrl_c_ends_the_launch_whose_agent_was_not_signalled():
    """study runs its agents on threads, where torch's agent sets no signal handlers: a rank Ctrl-C ended
    exited with status 0 and no result (torch's worker wrapper swallows KeyboardInterrupt), and such an
    agent waited for that result for good. The rank exits 130."""
    import threading

    failures = []

    def run():
        try:
            launch(_interrupted_on_rank_one, 2, timeout_s=60)
        except RankFailed as failure:
            failures.append(str(failure))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the agent still waits for the interrupted rank"
    assert len(failures) == 1 and "KeyboardInterrupt" in failures[0], failures


def _sleep_after_saying_so(started_dir):
    import torch

    open(os.path.join(started_dir, f"rank{torch.distributed.get_rank()}"), "w").close()
    time.sleep(120)


def test_ctrl_c_stops_the_launch_and_its_ranks_within_seconds(tmp_path):
    """SIGINT to the command's process group: the launcher's agent passes it on, and the ranks end
    on it, not on the agent's SIGKILL 30 s later, even when the command was started with SIGINT
    ignored (in the background by a script: `cmd &`), which its fork server and ranks inherit."""
    import signal
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from megatron_siamese.runtime.launch import launch, start_rank_server\n"
            "from test_launch import _sleep_after_saying_so\n"
            "if __name__ == '__main__':\n"
            "    start_rank_server()  # as the check does: the fork server inherits this process's dispositions\n"
            "    launch(_sleep_after_saying_so, 2, sys.argv[2])\n")
    process = subprocess.Popen([sys.executable, "-c", code, os.path.dirname(__file__), str(tmp_path)],
                               start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(list(tmp_path.iterdir())) == 2, process.communicate(timeout=5)[0] if process.poll() is not None else ""
        os.killpg(process.pid, signal.SIGINT)
        stopped = time.monotonic()
        output, _ = process.communicate(timeout=60)
        assert time.monotonic() - stopped < 10, output
        assert "KeyboardInterrupt" in output and process.returncode != 0, output
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)

"""What a refused command must look like, and the long commands the tests start and stop, for
the tests that drive the command line (test_cli.py, test_checkpoint_errors.py,
test_data_checks.py, test_run_log.py)."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator, List

CLI = [sys.executable, "-m", "megatron_siamese.cli"]


def assert_one_line_refusal(done, *messages):
    """Exit 2, no traceback, one error line, holding each of ``messages``; returns ``done``."""
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, done.stderr
    for message in messages:
        assert message in errors[0], errors[0]
    return done


def record_rank_starts(monkeypatch) -> List[int]:
    """From now until the test ends, every start of ranks in this process (``launch.launch``, which
    every command's ``run_job`` goes through when no launcher started this process), as the
    number of ranks started: for a test that claims ``cli_here`` refused before any rank started."""
    from megatron_siamese.runtime import launch

    started: List[int] = []
    real = launch.launch

    def recorded(fn, world_size, *args, **kwargs):
        started.append(world_size)
        return real(fn, world_size, *args, **kwargs)

    monkeypatch.setattr(launch, "launch", recorded)
    return started


class Running:
    """A command running as a user runs it, in a session of its own (a signal to its process group
    reaches its launcher and the launcher's helpers, never pytest), its output read as it comes
    (a full pipe never blocks it): ``wait_for`` a line, then ``finish``."""

    def __init__(self, *args, **popen):
        self.process = subprocess.Popen([*CLI, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, start_new_session=True, **popen)
        self.pid = self.process.pid
        self._read = {"stdout": [], "stderr": []}
        self._lines = {"stdout": queue.Queue(), "stderr": queue.Queue()}
        self._readers = [threading.Thread(target=self._reader, args=(name,), daemon=True) for name in self._read]
        for reader in self._readers:
            reader.start()

    def _reader(self, name: str) -> None:
        for line in getattr(self.process, name):
            self._read[name].append(line)
            self._lines[name].put(line)
        self._lines[name].put(None)  # the end of the stream

    def output(self, name: str) -> str:
        return "".join(self._read[name])

    def wait_for(self, name: str, pattern: str, timeout: float = 300) -> str:
        """The next line of stream ``name`` that matches ``pattern`` (re.search), once it is printed;
        fails if the stream ends or ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines[name].get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} on {name} within {timeout:.0f}s:\n"
                                     f"{self.output('stderr')[-3000:]}") from None
            if line is None:
                raise AssertionError(f"{name} ended without a line matching {pattern!r} (exit status "
                                     f"{self.process.wait()}):\n{self.output('stderr')[-3000:]}")
            if re.search(pattern, line):
                return line

    def finish(self, timeout: float = 120):
        """Wait for the command to end: (its exit status, all it printed on stdout, on stderr)."""
        code = self.process.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=30)
        return code, self.output("stdout"), self.output("stderr")

    def kill(self) -> None:
        """Kill every process of its session still there (the launcher, its fork server; the ranks
        die with the fork server), whatever state it is in."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        self.process.wait()
        for reader in self._readers:
            reader.join(timeout=30)


@contextlib.contextmanager
def running(*args, **popen) -> Iterator[Running]:
    """``Running(*args)``, killed with its whole session when the block ends, whatever happens in it."""
    run = Running(*args, **popen)
    try:
        yield run
    finally:
        run.kill()

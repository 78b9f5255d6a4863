"""Jobs a test starts as a user or a scheduler does (real processes: launchers, torchrun agents,
srun tasks), waited on by events and ended whatever happens.

``Jobs`` (a test's ``jobs`` fixture) starts each command in a session of its own, with a mark in
its environment that every process it starts inherits (ranks, fork servers, helpers, torchrun's
workers, orphans re-parented to init). ``Job`` reads its output on threads as it comes (a pipe
never fills, however long the run) and waits for a line (``wait_for``): the event a test acts
on, instead of a sleep. When the test ends, every process carrying its mark is killed (SIGKILL:
stopped ones too). A test that waited for every process it started fails when any of theirs
is still running 15 s later: processes left behind are a bug of the command, not the test's.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
import uuid
from typing import Dict, List, Optional

import psutil
import pytest

MARK = "MEGATRON_SIAMESE_TEST_JOB"
LEFT_BEHIND_S = 15  # how long the processes of a finished job may take to follow it


class Job:
    """A started command; ``pid``, ``returncode``, ``lines(stream)`` and the waits below."""

    def __init__(self, popen: subprocess.Popen):
        self.popen, self.pid = popen, popen.pid
        self._lines: Dict[str, List[str]] = {"stdout": [], "stderr": []}
        self._changed = threading.Condition()
        self._readers, self._streams = [], []
        for name in ("stdout", "stderr"):
            stream = getattr(popen, name)
            if stream is not None:
                reader = threading.Thread(target=self._read, args=(name, stream), daemon=True)
                reader.start()
                self._readers.append(reader)
                self._streams.append(stream)

    def close(self) -> None:
        """Its pipes, once read to the end (its writers are gone)."""
        for stream, reader in zip(self._streams, self._readers):
            reader.join(timeout=5)
            if not reader.is_alive():
                stream.close()

    def _read(self, name: str, stream) -> None:
        for line in stream:
            with self._changed:
                self._lines[name].append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def returncode(self) -> Optional[int]:
        return self.popen.poll()

    def lines(self, stream: str = "stdout") -> List[str]:
        with self._changed:
            return list(self._lines[stream])

    def said(self) -> str:
        return "".join(self.lines("stdout")) + "".join(self.lines("stderr"))

    def wait_for(self, pattern: str, stream: str = "stdout", timeout: float = 300) -> re.Match:
        """The first line of ``stream`` matching ``pattern`` (re.search), once it is printed; fails
        the test if the command ends (or ``timeout`` passes) without printing one."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self._lines[stream]:
                    found = re.search(pattern, line)
                    if found:
                        return found
                ended = self.popen.poll() is not None and not any(r.is_alive() for r in self._readers)
                if ended or time.monotonic() > deadline:
                    why = f"it exited {self.popen.poll()}" if ended else f"none in {timeout:.0f} s"
                    pytest.fail(f"no line matching {pattern!r} ({why}):\n{self.said()[-4000:]}")
                self._changed.wait(timeout=1.0)

    def wait(self, timeout: float) -> int:
        """The exit status, once the process ended (subprocess.TimeoutExpired after ``timeout``)."""
        return self.popen.wait(timeout=timeout)

    def finish(self, timeout: float = 300):
        """(stdout, stderr) once the process ended and its output is read to the end (whoever
        else held its pipes, its ranks, has closed them too)."""
        self.popen.wait(timeout=timeout)
        deadline = time.monotonic() + LEFT_BEHIND_S
        for reader in self._readers:
            reader.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not any(r.is_alive() for r in self._readers), \
            f"pid {self.pid} exited {self.popen.returncode}, but a process it started still holds its output"
        return "".join(self.lines("stdout")), "".join(self.lines("stderr"))

    def send_signal(self, signum: int) -> None:
        self.popen.send_signal(signum)

    def kill(self) -> None:
        self.popen.kill()


class Jobs:
    """The processes one test started (see the module's docstring)."""

    def __init__(self):
        self.mark = uuid.uuid4().hex
        self.started: List[Job] = []

    def start(self, command, env: Optional[Dict[str, str]] = None, merge_output: bool = False, **options) -> Job:
        """``command`` in a session of its own; its stdout and stderr (one stream with
        ``merge_output``) read as they come."""
        popen = subprocess.Popen([str(part) for part in command], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT if merge_output else subprocess.PIPE, text=True,
                                 env={**os.environ, **(env or {}), MARK: self.mark}, start_new_session=True, **options)
        job = Job(popen)
        self.started.append(job)
        return job

    def run(self, command, timeout: float = 300, **options) -> subprocess.CompletedProcess:
        """``command`` run to its end: what ``subprocess.run(capture_output=True)`` gives."""
        job = self.start(command, **options)
        out, err = job.finish(timeout)
        return subprocess.CompletedProcess(command, job.returncode, out, err)

    def processes(self) -> List[psutil.Process]:
        """Every process still running that one of this test's commands started (or is one)."""
        found = []
        for process in psutil.process_iter():
            try:
                if process.environ().get(MARK) == self.mark and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return found

    def end(self) -> None:
        """Kill whatever is left; fail if the test waited for its commands and something they
        started outlived them."""
        waited = all(job.popen.poll() is not None for job in self.started)
        left = self.processes()
        if waited and left:
            _, left = psutil.wait_procs(left, timeout=LEFT_BEHIND_S)
            left = [p for p in left if _running(p)]
            described = [_describe(p) for p in left]
        for process in left:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=30)
        for job in self.started:
            if job.popen.poll() is None:
                job.popen.kill()
            job.popen.wait(timeout=30)
            job.close()
        if waited and left:
            pytest.fail(f"processes left behind {LEFT_BEHIND_S} s after the commands that started them ended "
                        f"(killed now): {described}")


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(process: psutil.Process) -> str:
    try:
        return f"pid {process.pid}: {' '.join(process.cmdline())[-160:]}"
    except psutil.Error:
        return f"pid {process.pid}"


def descendants(pid: int) -> List[psutil.Process]:
    """A process and all its descendants: what a scheduler signals at a time limit."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def running(processes) -> List[psutil.Process]:
    """Those still running (a zombie has exited: its parent has not reaped it yet)."""
    return [process for process in processes if _running(process)]


@pytest.fixture
def jobs():
    """This test's started commands (``Jobs``), all ended when it ends."""
    started = Jobs()
    try:
        yield started
    finally:
        started.end()

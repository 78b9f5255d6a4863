"""Running the command line in tests, two ways.

``cli`` runs it as a user does: a new interpreter (``python -m megatron_siamese.cli``), its exit
status, its output, its processes (the launcher, the fork server its ranks come from). Tests of
signals, exit statuses, the launcher, lock files and what the process prints around its work
(notices, the progress bar, log lines) use it.

``cli_here`` runs the same ``main(argv)`` in this process: what the command decides and does
(refusals before any rank starts, resumes, checkpoint contents) without an interpreter start,
and with ranks forked from this process's fork server, which imported torch and Megatron once
for the session instead of once per command. It returns what ``cli`` returns: the exit status
``main`` gives ``sys.exit``, and what the command printed. Its ``env`` reaches the command but
not its ranks: they are forked from the fork server, which keeps the environment it started
with, so a test whose ranks must see a variable uses ``cli``.

``train_here`` is ``train``'s own way to start its ranks (``start_ranks``) called from this process:
where the launch is not the subject, a training run costs its ranks' training, not their imports.
Its ``env`` reaches the ranks, and their output comes back.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

CLI = [sys.executable, "-m", "megatron_siamese.cli"]


def cli(*args, env: Optional[Dict[str, str]] = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The command in its own process; ``.seconds`` is how long it took."""
    start = time.monotonic()
    done = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    done.seconds = time.monotonic() - start
    return done


@contextlib.contextmanager
def _environment(env: Dict[str, Optional[str]]):
    """``env`` set in this process for the block (None: unset), each of its variables as it was after."""
    saved = {name: os.environ.get(name) for name in env}
    _set(env)
    try:
        yield
    finally:
        _set(saved)


def _set(env: Dict[str, Optional[str]]) -> None:
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def cli_here(*args, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """The command's ``main(argv)`` in this process: ``.returncode`` (what it would exit with),
    ``.stdout``, ``.stderr`` and ``.seconds``, as ``cli`` gives them."""
    from megatron_siamese.cli import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    with _environment(env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:  # argparse's refusals
            code = stop.code if isinstance(stop.code, int) else 1
    done = subprocess.CompletedProcess(["megatron-siamese", *argv], code, out.getvalue(), err.getvalue())
    done.seconds = time.monotonic() - start
    return done


def train_here(*flags, ranks: int, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``megatron-siamese train --nproc-per-node RANKS FLAGS`` without the command's own parsing
    (``--compare``, ``--help``): ``.returncode`` (what it would exit with), ``.stdout`` (its ranks'
    output, through a file) and ``.stderr`` (what the command said about them)."""
    import tempfile

    from megatron_siamese.cli.train import start_ranks

    argv = [str(a) for a in flags]
    err = io.StringIO()
    start = time.monotonic()
    # what start_ranks sets for its ranks, not for the session's later subprocesses
    kept = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "PYTHONWARNINGS")}
    with _environment(kept), tempfile.NamedTemporaryFile("r", suffix=".log") as log, contextlib.redirect_stderr(err):
        code = start_ranks(ranks, argv, log=log.name, environment=env)
        out = log.read()
    done = subprocess.CompletedProcess(["megatron-siamese", "train", "--nproc-per-node", str(ranks), *argv], code,
                                       out, err.getvalue())
    done.seconds = time.monotonic() - start
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


def megatron_lm_args(argv):
    """``megatron-siamese train``'s flags (``argv`` from ``train`` on) as Megatron-LM's parser, ours in
    it, reads them (megatron-core >= 0.17), without our launch flag; and that flag's value."""
    from megatron_siamese.runtime.pretrain import megatron_parser

    assert argv[0] == "train", argv
    flags, ranks = list(argv[1:]), None
    if "--nproc-per-node" in flags:
        at = flags.index("--nproc-per-node")
        ranks = int(flags[at + 1])
        del flags[at:at + 2]
    return megatron_parser().parse_args(flags), ranks

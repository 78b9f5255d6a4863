"""Imported first by the rank fork server (``launch.py``): hides the known notices in that
process before it imports torch and Megatron, so its imports print nothing a rank would not,
and selects matplotlib's file-only backend before the server imports pyplot for rank 0's
``loss.png``. When its launcher has gone, the server ends without tearing its imports down."""

import atexit
import os
import sys

from megatron_siamese.runtime.quiet import silence_known_notices

silence_known_notices()
os.environ.setdefault("MPLBACKEND", "Agg")

_SERVER = os.getpid()


@atexit.register
def _end_without_teardown() -> None:
    # the interpreter's teardown of torch and Megatron took a CPU-second or more, in a process left
    # running after its launcher had exited. Skipped: that teardown, and the atexit functions registered
    # before this one (multiprocessing's finalizers: the server holds no temporary directory of its own,
    # its launcher's is removed by the launcher). Its ranks end by os._exit, which runs no atexit function,
    # and a process they fork is another pid.
    if os.getpid() == _SERVER:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(0)

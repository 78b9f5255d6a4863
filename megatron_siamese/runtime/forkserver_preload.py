"""Imported first by the rank fork server (``launch.py``): hides the known notices in that
process before it imports torch and Megatron, so its imports print nothing a rank would not,
ignores the stop signals a process group gets, and selects matplotlib's file-only backend
before the server imports pyplot for rank 0's ``loss.png``. When its launcher has gone, the
server ends without tearing its imports down."""

import atexit
import os
import signal
import sys

from megatron_siamese.runtime.quiet import silence_known_notices

silence_known_notices()
os.environ.setdefault("MPLBACKEND", "Agg")
# a stop signal sent to the whole process group (a scheduler's, `timeout`'s; Ctrl-C the server ignores
# already) ended the server, and with it the agent's wait for the ranks it had forked: the agent returned
# at once and the ranks, seeing their launcher gone, died before --exit-signal-handler's save. The server
# ends when its launcher does; its ranks take these signals' default handling back (launch.py)
for _stop in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(_stop, signal.SIG_IGN)

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

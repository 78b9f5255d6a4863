"""Put on PYTHONPATH by tests/conftest.py while a test marked ``stack_independent`` runs: every
Python process the test starts records here whether it imported megatron (the file named by
MEGATRON_SIAMESE_TEST_IMPORT_LOG gets one line per process that did), so a test that touches
Megatron cannot stay on one stack of a run over several."""

import os
import sys

_LOG = os.environ.get("MEGATRON_SIAMESE_TEST_IMPORT_LOG")


class _Recorder:
    """A meta-path finder that notes the first import of megatron and steps aside."""

    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            sys.meta_path.remove(self)
            with open(_LOG, "a") as log:
                log.write(f"pid {os.getpid()}: {' '.join(sys.argv)[:300]}\n")
        return None


if _LOG:
    sys.meta_path.insert(0, _Recorder())

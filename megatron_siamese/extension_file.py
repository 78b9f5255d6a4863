"""``MEGATRON_SIAMESE_EXTENSION=<file>``: the package's C++ extension (``megatron_siamese._C``) is
loaded from that file instead of the one built beside the package. scripts/sanitize.sh points it at
a build with AddressSanitizer, so that every memory access of the kernels is checked in every rank."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

ENV_VAR = "MEGATRON_SIAMESE_EXTENSION"
MODULE = "megatron_siamese._C"


class _ExtensionFile(importlib.abc.MetaPathFinder):
    def __init__(self, path: str):
        self.path = path

    def find_spec(self, fullname, path=None, target=None):
        if fullname != MODULE:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, self.path)
        return importlib.util.spec_from_file_location(fullname, self.path, loader=loader)


def install() -> None:
    """Load the extension from ``$MEGATRON_SIAMESE_EXTENSION`` when it is set (a missing file is an error)."""
    path = os.environ.get(ENV_VAR)
    if not path or any(isinstance(finder, _ExtensionFile) for finder in sys.meta_path):
        return
    if not os.path.isfile(path):
        raise ImportError(f"{ENV_VAR}={path}: no such file; unset it to load the extension built with the package")
    sys.meta_path.insert(0, _ExtensionFile(os.path.abspath(path)))

"""When a C++ extension built on one machine can be loaded on another, and which sources it is of.

    python bench/gpu/kit_abi.py abi            # this interpreter's torch ABI facts, as JSON
    python bench/gpu/kit_abi.py source-hash    # hash of what megatron_siamese._C is compiled from

A torch extension links against libtorch's C++ symbols, so it loads where the torch binary is
the same build: same version (with its CUDA suffix), same git commit, same CUDA version, same
C++ ABI flag, same Python minor version and processor. kit.sh records these facts next to
each prebuilt extension; run.sh uses the prebuilt one only when the lent machine's facts are
equal, and builds from source otherwise (the same code, compiled there).
"""

from __future__ import annotations

import ast
import hashlib
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What megatron_siamese._C is compiled from: csrc/, and setup.py's functions that choose its
# sources and flags (the rest of setup.py, e.g. dependency pins, does not change the binary).
SOURCE_DIR, SOURCE_SUFFIXES = "csrc", (".cpp", ".cu", ".h", ".cuh", ".hpp")
SETUP_FUNCTIONS = ("extension_modules", "build_ext_class")


def torch_abi() -> dict:
    import torch

    return {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "machine": platform.machine(),
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "torch_cuda": torch.version.cuda,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
    }


def abi_mismatch(recorded: dict, here: dict) -> list:
    """The facts that differ, as 'key: recorded != here' strings (empty when loadable)."""
    return [f"{key}: {recorded.get(key)!r} != {here.get(key)!r}" for key in sorted(set(recorded) | set(here))
            if recorded.get(key) != here.get(key)]


def setup_build_code(setup_py: str) -> str:
    """The source of setup.py's extension-building functions; the whole file unless it has all of
    them by those names (then any change to it counts)."""
    tree = ast.parse(setup_py)
    parts = [ast.get_source_segment(setup_py, node) for node in tree.body
             if isinstance(node, ast.FunctionDef) and node.name in SETUP_FUNCTIONS]
    return "\n".join(parts) if len(parts) == len(SETUP_FUNCTIONS) else setup_py


def source_hash(root: Path = ROOT) -> str:
    digest = hashlib.sha256(setup_build_code((root / "setup.py").read_text()).encode())
    for file in sorted(p for p in (root / SOURCE_DIR).rglob("*") if p.suffix in SOURCE_SUFFIXES):
        digest.update(b"\0" + str(file.relative_to(root)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:16]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["abi"]:
        print(json.dumps(torch_abi(), sort_keys=True))
    elif argv == ["source-hash"]:
        print(source_hash())
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

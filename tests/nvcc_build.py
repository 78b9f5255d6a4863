"""nvcc over the extension's CUDA sources with torch's headers and flags, as the package build
compiles them, for tests on a machine without a GPU. A CPU wheel of torch ships the CUDA headers
but not the one header its CMake build generates for CUDA builds: written into ``workdir``."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path
from typing import List

import torch
import torch.utils.cpp_extension as cpp_extension

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def nvcc() -> str:
    found = shutil.which("nvcc")
    if found is None:
        import pytest

        pytest.fail("nvcc is not on PATH: the CUDA kernels must compile in CI")
    return found


def torch_cuda_command(source: str, output: Path, workdir: Path, *nvcc_flags: str, stage: str = "-c") -> List[str]:
    """The nvcc command compiling csrc/``source`` into ``output`` with ``nvcc_flags`` (architectures,
    --resource-usage, ...). ``stage`` "-fatbin": the device code alone (ptxas's figures without the
    host compiler's pass over torch's headers, which is nearly half the time)."""
    shim = workdir / "include" / "c10" / "cuda" / "impl"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return [
        nvcc(), "-std=c++20", "-O3", *nvcc_flags, stage, str(CSRC / source), "-o", str(output),
        f"-I{workdir / 'include'}", *(f"-I{p}" for p in cpp_extension.include_paths()),
        f"-I{sysconfig.get_paths()['include']}", *cpp_extension.COMMON_NVCC_FLAGS,
        "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-Xcompiler", "-fPIC",
    ]

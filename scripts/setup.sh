#!/usr/bin/env bash
# Creates .venv (once) with the tested CPU stack and this package installed editable.
# Safe to run repeatedly: it reinstalls (and rebuilds the C++ extension) only when
# requirements-cpu.txt, setup.py or csrc/ changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.megatron_siamese-installed
want=$(cat requirements-cpu.txt setup.py csrc/* | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned: this machine's CPU wheel is on local disk; anything else pulls CUDA wheels
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -r requirements-cpu.txt
  # no build isolation: the C++ extension builds against the torch installed above
  .venv/bin/python -m pip install -q --no-build-isolation -e .
  echo "$want" > "$stamp"
fi

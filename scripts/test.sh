#!/usr/bin/env bash
# The whole test suite on CPU, on both tested Megatron-Core stacks (several gloo processes per
# parallel test): megatron-core 0.16.1 / Python 3.11, then 0.19.2 / Python 3.12. Each stack
# sets up its own virtual environment on first use (scripts/setup.sh).
#
#   bash scripts/test.sh                      # both stacks (what CI runs)
#   STACKS=mcore016 bash scripts/test.sh -k hybrid   # one stack; extra args go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
# tests marked stack_independent run on the first stack only; the standalone nvcc compile is
# left to the mcore019 build when it is in the run (tests/conftest.py, test_cuda_compile.py)
export MEGATRON_SIAMESE_TEST_STACKS=${STACKS:-mcore016 mcore019}
for stack in $MEGATRON_SIAMESE_TEST_STACKS; do
  export MEGATRON_SIAMESE_TEST_STACK=$stack
  venv=$(bash scripts/setup.sh "$stack")
  "$venv/bin/python" - <<'PY'
import sys
from importlib.metadata import version
print(f"== Python {sys.version.split()[0]}, torch {version('torch')}, megatron-core {version('megatron-core')}", flush=True)
PY
  "$venv/bin/python" -m pytest "$@" || status=$?
done
exit $status

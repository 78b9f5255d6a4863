#!/usr/bin/env bash
# The whole test suite on CPU (several gloo processes per parallel test). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"

#!/usr/bin/env bash
# The main job on its embedded default: a small SiameseNorm GPT pretrained with TP=2 on CPU
# (gloo) on the embedded King James Bible corpus; prints progress and the validation loss.
# Extra flags go to `megatron-siamese train` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
exec .venv/bin/megatron-siamese train "$@"

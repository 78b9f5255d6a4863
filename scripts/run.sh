#!/usr/bin/env bash
# The main job on its embedded default: a small SiameseNorm GPT pretrained with TP=2 on CPU
# (gloo) on the embedded King James Bible corpus. Each run gets a new directory,
# runs/<date>-<time>/ (unless --output-dir names one), says which, and leaves there its
# settings.json, metrics.jsonl, loss.png, summary.json and checkpoints (every 100 steps and
# the final one): rerun it any number of times. Extra flags go to `megatron-siamese train`
# (see --help); a flag given here wins over the defaults below (e.g. --save-interval 50).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
defaults=(--save-interval 100)
named=
for arg in "$@"; do
  case "$arg" in --output-dir|--output-dir=*) named=1 ;; esac
done
if [ -z "$named" ]; then
  mkdir -p runs
  stamp=runs/$(date +%Y%m%d-%H%M%S)
  run=$stamp
  n=1
  until mkdir "$run" 2>/dev/null; do  # runs started in the same second: -2, -3, ...
    n=$((n + 1))
    run=$stamp-$n
    [ "$n" -le 100 ] || { echo "scripts/run.sh: cannot create a run directory under $PWD/runs" >&2; exit 1; }
  done
  echo "run directory: $run"
  defaults+=(--output-dir "$run")
fi
exec .venv/bin/megatron-siamese train "${defaults[@]}" "$@"

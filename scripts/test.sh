#!/usr/bin/env bash
# The whole test suite on CPU, on both tested Megatron-Core stacks (several gloo processes per
# parallel test): megatron-core 0.16.1 / Python 3.11 and 0.19.2 / Python 3.12. Each stack sets
# up its own virtual environment on first use (scripts/setup.sh).
#
#   bash scripts/test.sh                               # both stacks (what CI runs)
#   STACKS=mcore016 bash scripts/test.sh -k hybrid     # one stack, everything on it; extra args go to pytest
#   TEST_PARALLEL=0 bash scripts/test.sh               # the stacks one after the other
#
# The stacks run side by side (TEST_PARALLEL=1, the default): each sets up and then tests in its
# own process, into its own log (printed whole when it ends) and its own pytest temp directory,
# with the machine's cores shared out between them (OMP_NUM_THREADS, unless it is set).
# A test marked stack_independent runs on the first stack only (tests/conftest.py says which
# may be). Each stack's log ends with its 20 slowest tests (pytest's --durations=20, unless
# PYTEST_ADDOPTS asks for other durations). The run starts by timing a fixed Python workload
# (scripts/machine_speed.py) and ends with how busy the machine's CPUs were and how much time the
# host took from them, so that a slow run can be told from a slow machine (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a stacks <<< "${STACKS:-mcore016 mcore019}"
export MEGATRON_SIAMESE_TEST_STACKS="${stacks[*]}"
parallel=${TEST_PARALLEL:-1}
work=${TEST_WORK_DIR:-${TMPDIR:-/tmp}/megatron-siamese-tests}
mkdir -p "$work"
durations=(--durations=20)
case " ${PYTEST_ADDOPTS:-} " in *" --durations"*) durations=() ;; esac

stack_run() {  # one stack: its environment, then the suite; its exit status is pytest's
  local stack=$1 start=$SECONDS venv
  export MEGATRON_SIAMESE_TEST_STACK=$stack
  venv=$(bash scripts/setup.sh "$stack")
  echo "== $stack: environment ready after $((SECONDS - start)) s"
  "$venv/bin/python" - <<'PY'
import sys
from importlib.metadata import version
print(f"== Python {sys.version.split()[0]}, torch {version('torch')}, megatron-core {version('megatron-core')}", flush=True)
PY
  "$venv/bin/python" -m pytest --basetemp="$work/$stack" "${durations[@]}" "${@:2}"
}

cores() {  # the CPUs this run may use (nproc alone answers OMP_NUM_THREADS, which the stacks get below)
  env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc
}

cpu_ticks() {  # the machine's CPU time so far, in ticks: busy, idle, stolen by the host (Linux; else nothing)
  local _ user nice system idle iowait irq softirq steal
  [ -r /proc/stat ] || return 0
  read -r _ user nice system idle iowait irq softirq steal _ < /proc/stat
  echo "$((user + nice + system + irq + softirq)) $((idle + iowait)) $steal"
}

machine_use() {  # how busy the machine was since cpu_ticks printed $1 $2 $3: CPU-bound, or waiting
  local now busy idle steal
  now=$(cpu_ticks)
  [ -n "$now" ] && [ -n "$1" ] || return 0
  read -r busy idle steal <<< "$now"
  busy=$((busy - $1)) idle=$((idle - $2)) steal=$((steal - $3))
  local hz; hz=$(getconf CLK_TCK)
  echo "== the run: $SECONDS s; the machine's $(cores) CPUs busy $((100 * busy / (busy + idle + steal + 1)))% of it" \
       "($((busy / hz)) CPU-seconds), idle $((idle / hz)) s, stolen by the host $((steal / hz)) s"
}

python3 scripts/machine_speed.py  # how fast this machine is, to read the times below by
start_ticks=$(cpu_ticks)
status=0
if [ "$parallel" = 1 ] && [ "${#stacks[@]}" -gt 1 ]; then
  # the cores shared out: side by side, each stack's in-process torch with its default of a thread per
  # core oversubscribed them, and its threads spun waiting (test_reference_equivalence.py: 35-47 CPU-s
  # with 2 threads beside a busy core, 12 with 1). Ranks take 1 thread already; the CPU kernels' tests
  # set their own (tests/conftest.py, two_cpu_threads)
  threads=$(( $(cores) / ${#stacks[@]} ))
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}
  pids=()
  for stack in "${stacks[@]}"; do
    stack_run "$stack" "$@" > "$work/$stack.log" 2>&1 &
    pids+=($!)
    echo "== $stack: setting up and testing in the background (log: $work/$stack.log)"
  done
  for i in "${!stacks[@]}"; do
    code=0
    wait "${pids[$i]}" || code=$?
    echo "== ${stacks[$i]}: exit status $code after $SECONDS s; its log:"
    cat "$work/${stacks[$i]}.log"
    [ "$code" = 0 ] || status=$code
  done
else
  for stack in "${stacks[@]}"; do
    stack_run "$stack" "$@" || status=$?
  done
fi
# shellcheck disable=SC2086  # three numbers
machine_use $start_ticks
exit $status

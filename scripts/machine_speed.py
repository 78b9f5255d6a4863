"""How fast this machine runs Python, in seconds for a fixed workload: printed first by
scripts/test.sh so that a slow test run can be told from a slow machine (docs/testing.md,
"Time, and where it goes", compares runs by it). Plain Python, no imports of the project:
the suite's time is mostly interpreters starting, importing torch and Megatron and
orchestrating ranks, which scale with this, not with a BLAS benchmark.

    python3 scripts/machine_speed.py      # one line: "machine speed: 0.31 s of CPU, 0.32 s of wall time ..."
"""

import time


def workload() -> int:
    """A fixed mix of what the interpreter does most here: calls, dicts, strings, integers."""
    table = {}
    total = 0
    for i in range(2_000_000):
        key = f"layer.{i % 97}.weight"
        table[key] = table.get(key, 0) + i
        total += len(key) * (i & 7)
    return total + sum(table.values())


def seconds(repeats: int = 5):
    """(CPU seconds, wall seconds): the best of ``repeats`` timings of ``workload``. The CPU time
    is this processor's speed; wall time above it is time the CPU was given to others (other
    processes, or the host's other guests: steal)."""
    cpu = wall = float("inf")
    for _ in range(repeats):
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        workload()
        cpu = min(cpu, time.process_time() - cpu_start)
        wall = min(wall, time.perf_counter() - wall_start)
    return cpu, wall


if __name__ == "__main__":
    cpu, wall = seconds()
    print(f"machine speed: {cpu:.2f} s of CPU, {wall:.2f} s of wall time for a fixed Python workload "
          "(best of 5; docs/testing.md compares runs by it)", flush=True)

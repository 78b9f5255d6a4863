"""Tier 1: the fused dual-norm kernels on the GPU, tested, checked by compute-sanitizer, and timed.

    kernel-tests        KERNEL_TESTS (each adds a "cuda" parameter to its value tests when the
                        CUDA kernels are present: the dual-norm ops and the boundary ops of
                        docs/kernels.md, which have no tiled generation yet and so run their
                        general kernels twice), once per CUDA kernel generation
                        (tiled first: it is the one not yet run on a GPU): per-test outcomes
                        from pytest's JUnit XML
    compute-sanitizer   memcheck and racecheck over the CUDA tests of SANITIZER_SELECTION with
                        the tiled kernels (PyTorch's caching allocator off, so that memcheck
                        sees every buffer's end): pass/fail and the sanitizer's error lines
    kernel-bench        bench/bench_dual_norm.py's eager / torch.compile / fused columns at
                        GPU_CASES (packed streams far beyond the H200's 60 MB L2), the fused
                        column per generation, all cases twice (repeat 1 and 2); fused bandwidth
                        as a share of a copy measured in the same process, and the fused ops'
                        kernels with their device time (torch.profiler, repeat 1)

    python bench/gpu/kernel_bench.py kernel-bench --result out.json [--rehearse]
"""

from __future__ import annotations

import glob
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from common import GENERATIONS, KERNELS_ENV, ROOT, cuda_kernels, require_gpu, seconds_left, step_main

REHEARSAL_CASES = ((64, 256, "bf16"),)
REPEATS = 2
CASE_MARGIN_S = 25  # the longest case (torch.compile's two graphs, four columns) fits in this
KERNEL_TESTS = ("tests/test_kernels.py", "tests/test_boundary_ops.py")
SANITIZER_SELECTION = "matches_reference_fp32 or wide_rows or zero_and_one"  # and "cuda" on a GPU
SANITIZER_TOOLS = ("memcheck", "racecheck")
SANITIZER_TOOL_TIMEOUT_S = 110
SANITIZER_GENERATION = "tiled"


def junit_outcomes(path: Path) -> tuple:
    """(test id -> passed / failed / error / skipped, test id -> failure message), from pytest's
    JUnit XML."""
    outcomes, messages = {}, {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name, outcome = f"{case.get('classname')}::{case.get('name')}", "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "failed" if child.tag == "failure" else child.tag
                if child.tag != "skipped":
                    messages[name] = (child.get("message") or child.text or "")[:600]
        outcomes[name] = outcome
    return outcomes, messages


def count(outcomes: dict, selected) -> dict:
    values = [outcomes[t] for t in selected]
    return {k: values.count(k) for k in ("passed", "failed", "error", "skipped")}


def run_killable(command, env: dict, timeout: float) -> tuple:
    """(exit code or None when killed at ``timeout``, stdout + stderr): the command and every
    process it starts (compute-sanitizer starts Python) in their own group, killed together."""
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=None if math.isinf(timeout) else max(timeout, 1))
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, output


def pytest_run(arguments, env: dict, timeout: float, prefix=()) -> dict:
    """pytest over ``arguments`` (under ``prefix``, e.g. compute-sanitizer): its outcomes."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [*prefix, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                   *arguments]
        start = time.perf_counter()
        code, output = run_killable(command, env, timeout)
        seconds = time.perf_counter() - start
        outcomes, messages = junit_outcomes(junit) if junit.exists() else ({}, {})
    return {"code": code, "output": output, "seconds": round(seconds, 1), "outcomes": outcomes,
            "messages": messages, "wrote_report": bool(outcomes) or code == 5}  # 5: pytest selected nothing


def kernel_tests_of(generation: str, rehearse: bool) -> dict:
    """KERNEL_TESTS with the CUDA kernels of ``generation``: today's record shape."""
    env = dict(os.environ, **{KERNELS_ENV: generation})
    run = pytest_run(list(KERNEL_TESTS), env, timeout=seconds_left() - 10)
    print(f"----- {' '.join(KERNEL_TESTS)} with {KERNELS_ENV}={generation}\n{run['output'][-8000:]}", flush=True)
    outcomes = run["outcomes"]
    cuda = [t for t in outcomes if "cuda" in t]
    record = {
        "kernels": generation,
        "exit_code": run["code"],
        "seconds": run["seconds"],
        "all": count(outcomes, outcomes),
        "cuda": count(outcomes, cuda),
        "not_passed": sorted(t for t, o in outcomes.items() if o in ("failed", "error")),
        "messages": run["messages"],
        "summary": run["output"].strip().splitlines()[-1] if run["output"].strip() else "",
        "passed": run["code"] == 0 and (rehearse or len(cuda) > 0),
    }
    if run["code"] is None:
        record["summary"] = f"killed at the step's deadline after {run['seconds']}s"
    elif not run["wrote_report"]:
        record["summary"] = f"pytest wrote no report (exit {run['code']}): {run['output'][-1500:]}"
    return record


def kernel_tests(rehearse: bool) -> dict:
    """Both generations; the top level keeps the verified run's record (what earlier runs and
    report.py read), "generations" has each."""
    from megatron_siamese import ops

    if not rehearse:
        require_gpu(False, "the CUDA kernel tests")
        if not ops.has_cuda_kernels():
            raise RuntimeError(f"no CUDA kernels: {ops.unavailable_reason('cuda')}")
    generations = {}
    for generation in sorted(GENERATIONS, key=lambda g: g != "tiled"):  # the unverified one first
        if seconds_left() < 30:
            generations[generation] = {"kernels": generation, "passed": False, "summary": "not run: no time left"}
            continue
        generations[generation] = kernel_tests_of(generation, rehearse)
    return {**generations["verified"], "generations": generations}


# -- compute-sanitizer -------------------------------------------------------------------------


def find_compute_sanitizer():
    """compute-sanitizer's path: PATH, then the CUDA toolkit's folders; None if there is none."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    homes = [os.environ.get("CUDA_HOME"), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    for home in filter(None, homes):
        candidate = Path(home) / "bin" / "compute-sanitizer"
        if candidate.exists():
            return str(candidate)
    return None


def sanitizer_lines(output: str) -> tuple:
    """(summary lines, error lines) of compute-sanitizer's output (its lines start '========= ')."""
    lines = [line.strip() for line in output.splitlines() if line.startswith("=========")]
    summaries = [line for line in lines if "SUMMARY" in line]
    errors = [line for line in lines if "SUMMARY" not in line and "COMPUTE-SANITIZER" not in line
              and line.strip("= ")]
    return summaries, errors[:40]


def sanitizer_tool(sanitizer: str, tool: str) -> dict:
    env = dict(os.environ, **{KERNELS_ENV: SANITIZER_GENERATION}, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    # API errors are torch's as much as ours (a failing launch fails its test); the kernels'
    # memory accesses and races are what only the sanitizer sees
    prefix = [sanitizer, "--tool", tool, "--error-exitcode", "86", "--target-processes", "all",
              "--report-api-errors", "no", "--print-limit", "40"]
    run = pytest_run(["-k", f"cuda and ({SANITIZER_SELECTION})", *KERNEL_TESTS], env,
                     timeout=min(SANITIZER_TOOL_TIMEOUT_S, seconds_left() - 10), prefix=prefix)
    print(f"----- compute-sanitizer --tool {tool}\n{run['output'][-6000:]}", flush=True)
    summaries, errors = sanitizer_lines(run["output"])
    outcomes = run["outcomes"]
    tests = count(outcomes, outcomes)
    record = {"exit_code": run["code"], "seconds": run["seconds"], "tests": tests, "summary": summaries,
              "errors": errors, "not_passed": sorted(t for t, o in outcomes.items() if o in ("failed", "error"))}
    if run["code"] is None:
        record["why"] = f"killed after {run['seconds']}s"
    elif not outcomes:
        record["why"] = "no test ran (the selection matched none, or pytest did not start)"
    record["passed"] = run["code"] == 0 and tests["passed"] > 0 and not errors
    return record


def compute_sanitizer(rehearse: bool) -> dict:
    sanitizer = find_compute_sanitizer()
    command = (f"{sanitizer or 'compute-sanitizer'} --tool TOOL python -m pytest -k 'cuda and "
               f"({SANITIZER_SELECTION})' {' '.join(KERNEL_TESTS)}  with {KERNELS_ENV}={SANITIZER_GENERATION}, "
               f"PYTORCH_NO_CUDA_MEMORY_CACHING=1")
    record = {"compute_sanitizer": sanitizer, "kernels": SANITIZER_GENERATION, "command": command,
              "tools": {}}
    if rehearse:
        import torch

        # which tests the selection names, on this machine (the "cuda" parameter exists on a GPU)
        run = pytest_run(["--collect-only", "-k", SANITIZER_SELECTION, *KERNEL_TESTS], dict(os.environ), timeout=120)
        record["selected_by_name"] = sum(1 for line in run["output"].splitlines() if "::" in line)
        if not torch.cuda.is_available():
            return dict(record, ran=False, passed=None,
                        why="a CPU rehearsal: compute-sanitizer checks CUDA kernels, which need a GPU")
    require_gpu(False, "compute-sanitizer")
    if sanitizer is None:
        return dict(record, ran=False, passed=False,
                    why="compute-sanitizer is not on PATH nor in $CUDA_HOME/bin, /usr/local/cuda*/bin")
    version = subprocess.run([sanitizer, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    record["version"] = version[-1] if version else ""
    for tool in SANITIZER_TOOLS:
        if seconds_left() < 40:
            record["tools"][tool] = {"passed": False, "why": "not run: no time left"}
            continue
        record["tools"][tool] = sanitizer_tool(sanitizer, tool)
    return dict(record, ran=True, passed=all(t["passed"] for t in record["tools"].values()))


# -- the bench ---------------------------------------------------------------------------------


def error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"[:800]


def bench_case(bench, impls: dict, case: tuple, device: str, repeat: int, copy: float, profile: bool) -> list:
    """The rows of one case in one repeat: per pass (fwd, fwd+bwd) one row per generation. A
    column that fails is recorded and the others still run (a failing fused generation gives an
    error row; a failing eager or compile column leaves its ratio None)."""
    import torch

    rows, hidden, dtype_name = case
    dtype = bench.DTYPES[dtype_name]
    common = {"shape": f"{rows}x{hidden}", "dtype": dtype_name, "repeat": repeat}
    times, column_errors = {}, {}
    for name, fn in impls.items():
        try:
            times[name] = bench.run_case(fn, rows, hidden, dtype, device)
        except Exception as error:  # noqa: BLE001 - the error's text is the result
            column_errors[name] = error_text(error)
    if column_errors:
        common["column_errors"] = column_errors
    out = []
    pass_bytes = rows * hidden * torch.tensor([], dtype=dtype).element_size()
    for generation in GENERATIONS:
        kernels = None
        try:
            with cuda_kernels(generation):
                fused = bench.run_case(bench.fused_sublayer, rows, hidden, dtype, device)
                if profile:
                    try:
                        kernels = [bench.kernel_profile(fn, device) for fn in
                                   bench.case_functions(bench.fused_sublayer, rows, hidden, dtype, device)]
                    except Exception as error:  # noqa: BLE001 - the timings stand without it
                        kernels = [[{"name": f"profile failed: {error_text(error)}", "us": 0, "launches": 0}]] * 2
        except Exception as error:  # noqa: BLE001
            out.append(dict(common, kernels=generation, error=error_text(error)))
            continue
        finally:
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        for index, label, passes in ((0, "fwd", bench.FORWARD_PASSES),
                                     (1, "fwd+bwd", bench.FORWARD_PASSES + bench.BACKWARD_PASSES)):
            t = {name: value[index] for name, value in times.items()}
            t["fused"] = fused[index]
            fused_bandwidth = passes * pass_bytes / t["fused"]
            row = dict(common, kernels=generation, **{
                "pass": label,
                "ms": {name: round(1e3 * value, 4) for name, value in t.items()},
                "eager_over_fused": round(t["eager"] / t["fused"], 3) if "eager" in t else None,
                "compile_over_fused": round(t["compile"] / t["fused"], 3) if "compile" in t else None,
                "fused_gb_s": round(fused_bandwidth / 1e9, 1),
                "fused_share_of_copy": round(fused_bandwidth / copy, 3),
            })
            if kernels is not None:
                row["profile"] = kernels[index]
            out.append(row)
    return out


def kernel_bench(rehearse: bool) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import bench_dual_norm as bench

    from megatron_siamese import ops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not rehearse:
        require_gpu(False, "the kernel bench")
    if ops.unavailable_reason(device):
        raise RuntimeError(ops.unavailable_reason(device))
    impls = {"eager": bench.eager_sublayer, "compile": bench.compiled_sublayer()}
    cases = REHEARSAL_CASES if rehearse else bench.GPU_CASES
    rows_out, copies, cut = [], [], []
    for repeat in range(1, REPEATS + 1):
        copies.append(bench.copy_bandwidth(device))
        for case in cases:
            if seconds_left() < CASE_MARGIN_S:
                cut.append(f"repeat {repeat}: {case[0]}x{case[1]} {case[2]}")
                continue
            rows_out += bench_case(bench, impls, case, device, repeat, copies[-1], profile=repeat == 1)
    timing = ({"iters": bench.GPU_ITERS, "warmup": bench.GPU_WARMUP, "clock": "CUDA events"} if device == "cuda"
              else {"iters": 5, "warmup": 2, "clock": "perf_counter"})
    return {"device": device, "copy_gb_s": round(copies[0] / 1e9, 1),
            "copy_gb_s_repeats": [round(c / 1e9, 1) for c in copies], "repeats": REPEATS, "timing": timing,
            "generations": list(GENERATIONS), "rows": rows_out, "cut_for_time": cut}


STEPS = {"kernel-tests": kernel_tests, "compute-sanitizer": compute_sanitizer, "kernel-bench": kernel_bench}

if __name__ == "__main__":
    sys.exit(step_main(STEPS))

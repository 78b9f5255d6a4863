"""Tier 1: the fused dual-norm kernels on the GPU, tested and timed.

    kernel-tests   tests/test_kernels.py (it adds a "cuda" parameter to its value tests when
                   the CUDA kernels are present): per-test outcomes from pytest's JUnit XML
    kernel-bench   bench/bench_dual_norm.py's eager / torch.compile / fused columns at shapes far
                   beyond the H200's 60 MB L2, fused bandwidth as a share of a copy measured in
                   the same process (target: >= 80%)

    python bench/gpu/kernels.py kernel-bench --result out.json [--rehearse]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from common import ROOT, require_gpu, step_main

# (rows, hidden, dtype): the packed streams are 2 * rows * hidden elements, 256 MB and more
BENCH_CASES = ((16384, 4096, "bf16"), (16384, 4096, "fp32"), (32768, 8192, "bf16"))
REHEARSAL_CASES = ((64, 256, "bf16"),)


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


def kernel_tests(rehearse: bool) -> dict:
    from megatron_siamese import ops

    if not rehearse:
        require_gpu(False, "the CUDA kernel tests")
        if not ops.has_cuda_kernels():
            raise RuntimeError(f"no CUDA kernels: {ops.unavailable_reason('cuda')}")
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                   "tests/test_kernels.py"]
        start = time.perf_counter()
        process = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if not junit.exists():
            raise RuntimeError(f"pytest wrote no report (exit {process.returncode}):\n{process.stdout[-3000:]}"
                               f"{process.stderr[-3000:]}")
        outcomes, messages = junit_outcomes(junit)
        print(process.stdout[-8000:], flush=True)  # the failures' tracebacks, into the run's log

    def count(selected):
        values = [outcomes[t] for t in selected]
        return {k: values.count(k) for k in ("passed", "failed", "error", "skipped")}

    cuda = [t for t in outcomes if "cuda" in t]
    return {
        "exit_code": process.returncode,
        "seconds": round(seconds, 1),
        "all": count(outcomes),
        "cuda": count(cuda),
        "not_passed": sorted(t for t, o in outcomes.items() if o in ("failed", "error")),
        "messages": messages,
        "summary": process.stdout.strip().splitlines()[-1] if process.stdout.strip() else "",
        "passed": process.returncode == 0 and (rehearse or len(cuda) > 0),
    }


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
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    impls = {"eager": bench.eager_sublayer, "fused": bench.fused_sublayer,
             "compile": torch.compile(bench.eager_sublayer, dynamic=False)}
    copy = bench.copy_bandwidth(device)
    rows_out = []
    for rows, hidden, dtype_name in REHEARSAL_CASES if rehearse else BENCH_CASES:
        dtype = dtypes[dtype_name]
        try:  # a case that fails is recorded, and the next case still runs
            times = {name: bench.run_case(fn, rows, hidden, dtype, device) for name, fn in impls.items()}
        except Exception as error:  # noqa: BLE001 - the error's text is the result
            rows_out.append({"shape": f"{rows}x{hidden}", "dtype": dtype_name, "error": f"{type(error).__name__}: {error}"[:800]})
            continue
        finally:
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        pass_bytes = rows * hidden * torch.tensor([], dtype=dtype).element_size()
        for index, label, passes in ((0, "fwd", bench.FORWARD_PASSES),
                                     (1, "fwd+bwd", bench.FORWARD_PASSES + bench.BACKWARD_PASSES)):
            t = {name: value[index] for name, value in times.items()}
            fused_bandwidth = passes * pass_bytes / t["fused"]
            rows_out.append({
                "shape": f"{rows}x{hidden}", "dtype": dtype_name, "pass": label,
                "ms": {name: round(1e3 * value, 3) for name, value in t.items()},
                "eager_over_fused": round(t["eager"] / t["fused"], 3),
                "compile_over_fused": round(t["compile"] / t["fused"], 3),
                "fused_gb_s": round(fused_bandwidth / 1e9, 1),
                "fused_share_of_copy": round(fused_bandwidth / copy, 3),
            })
    return {"device": device, "copy_gb_s": round(copy / 1e9, 1), "rows": rows_out}


STEPS = {"kernel-tests": kernel_tests, "kernel-bench": kernel_bench}

if __name__ == "__main__":
    sys.exit(step_main(STEPS))

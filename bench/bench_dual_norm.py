"""Side-by-side timing of one SiameseNorm sublayer's element-wise work (not a test).

    python bench/bench_dual_norm.py                 # CPU: fp32 and bf16, 8192x1024 and 4096x4096
    python bench/bench_dual_norm.py --device cuda   # GPU: GPU_CASES (or --shapes / --dtypes)

On a GPU the fused column runs the CUDA kernels MEGATRON_SIAMESE_CUDA_KERNELS names (verified,
the default, or tiled); bench/gpu/kernel_bench.py times both generations in one process.

Three implementations of the same math, measured in one run:
  eager    the PyTorch composition the layer uses without the extension (TorchSublayer)
  compile  torch.compile of that composition (inductor)
  fused    the extension's dual_norm + dual_residual ops (FusedSublayer)

The sublayer: u = PostNorm(x), normed = InputNorm(u + PreNorm(y)), then
[u + (out + bias)/c | y + (out + bias)]; `out` stands in for the attention/MLP output, so
its matmuls are not timed. Forward and forward+backward (random upstream gradients for the
packed output and for `normed`). Bandwidth: the byte floor of the fused ops (docs/kernels.md:
10 row-passes forward, 10 backward) over the measured time, and that as a fraction of a copy
bandwidth measured here with torch's copy_. Times: the median of 5 calls after 2 on CPU
(perf_counter); on a GPU the median of GPU_ITERS calls after GPU_WARMUP, each between two CUDA
events, queued back to back (device time per call with the launch queue full).

On CPU the script re-executes itself with glibc malloc tuned to keep freed memory mapped
(the effect PyTorch's CPU performance guide gets from jemalloc/tcmalloc): otherwise every
op's fresh output pages fault in and all three columns measure the kernel's page faults.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from megatron_siamese.ops import load_error

FORWARD_PASSES, BACKWARD_PASSES = 10, 10
GPU_ITERS, GPU_WARMUP = 30, 5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# (rows, hidden, dtype) on a GPU, every packed stream far beyond the H200's 60 MB L2: the
# 2026-12-01 shapes first (comparable with that run), then h = 1024 ... 16384 at
# 2 * rows * h = 64M elements, then the largest; fp16 is judged as bf16, at one shape
GPU_CASES = (
    (16384, 4096, "bf16"), (16384, 4096, "fp32"),
    (32768, 1024, "bf16"), (16384, 2048, "bf16"), (4096, 8192, "bf16"), (2048, 16384, "bf16"),
    (32768, 1024, "fp32"), (16384, 2048, "fp32"), (4096, 8192, "fp32"), (2048, 16384, "fp32"),
    (32768, 8192, "bf16"),
    (16384, 2048, "fp16"),
)


def eager_sublayer(streams, out, weights, bias, eps, inv_c):
    h = out.shape[-1]
    x, y = streams[:, :h], streams[:, h:]
    gx, bx, gy, by, gi, bi = weights
    u = F.layer_norm(x, (h,), gx, bx, eps)
    normed = F.layer_norm(u + F.layer_norm(y, (h,), gy, by, eps), (h,), gi, bi, eps)
    z = out + bias
    return torch.cat([u + z * inv_c, y + z], dim=-1), normed


def fused_sublayer(streams, out, weights, bias, eps, inv_c):
    from megatron_siamese.ops import fused

    h = out.shape[-1]
    base, normed = fused.dual_norm(streams, h, *weights, eps, False, False)
    return fused.dual_residual(base, out, bias, None, 1.0, inv_c), normed


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats=5, warmup=2):
    """Median seconds of one call of ``fn`` (see the module's docstring)."""
    if device == "cuda":
        return cuda_timed(fn, max(repeats, GPU_ITERS), max(warmup, GPU_WARMUP))
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cuda_timed(fn, iters, warmup):
    """Median seconds of `iters` calls timed by CUDA events queued back to back (one sync)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def compiled_sublayer():
    """torch.compile of eager_sublayer, one graph per shape and dtype (dynamic=False). Dynamo
    keeps at most recompile_limit (8) graphs per function and silently runs eagerly beyond them;
    GPU_CASES need 2 per case (forward under no_grad, forward + backward)."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 4 * len(GPU_CASES)))
    return torch.compile(eager_sublayer, dynamic=False)


def copy_bandwidth(device, numel=64 * 2**20):
    src = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeats=7)
    return 2 * src.numel() * src.element_size() / seconds


def make_inputs(rows, hidden, dtype, device):
    generator = torch.Generator(device=device).manual_seed(0)  # drawn where they are used

    def rand(*shape, scale=1.0, center=0.0):
        values = torch.randn(*shape, generator=generator, device=device) * scale + center
        return values.to(dtype).requires_grad_()

    streams = rand(rows, 2 * hidden)
    out = rand(rows, hidden)
    weights = [rand(hidden, scale=0.1, center=c) for c in (1, 0, 1, 0, 1, 0)]
    bias = rand(hidden, scale=0.1)
    return streams, out, weights, bias


def case_functions(impl, rows, hidden, dtype, device):
    """(forward, forward_backward): one call each of ``impl`` on fresh inputs of this case."""
    streams, out, weights, bias = make_inputs(rows, hidden, dtype, device)
    inv_c = 0.5
    grad_packed = torch.randn(rows, 2 * hidden, device=device, dtype=dtype)
    grad_normed = torch.randn(rows, hidden, device=device, dtype=dtype)
    inputs = [streams, out, bias] + weights

    def forward():
        with torch.no_grad():
            impl(streams, out, weights, bias, 1e-5, inv_c)

    def forward_backward():
        packed, normed = impl(streams, out, weights, bias, 1e-5, inv_c)
        torch.autograd.grad((packed, normed), inputs, (grad_packed, grad_normed))

    return forward, forward_backward


def run_case(impl, rows, hidden, dtype, device):
    """(forward, forward + backward) seconds of ``impl`` at this case."""
    forward, forward_backward = case_functions(impl, rows, hidden, dtype, device)
    return timed(forward, device), timed(forward_backward, device)


def kernel_profile(fn, device, calls=3, top=6):
    """The kernels one call of ``fn`` runs, by torch.profiler: [{name, us (device time per call),
    launches (per call)}], the ``top`` longest. On CPU (no device kernels) the ops, by self CPU
    time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as profiler:
        for _ in range(calls):
            fn()
        synchronize(device)
    found = []
    for event in profiler.key_averages():
        if device == "cuda":
            if event.device_type != DeviceType.CUDA:
                continue
            total = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        else:
            total = event.self_cpu_time_total
        found.append({"name": event.key[:200], "us": round(total / calls, 1),
                      "launches": round(event.count / calls, 2)})
    return sorted(found, key=lambda k: -k["us"])[:top]


CACHING_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(64 * 2**30),
    "MALLOC_TRIM_THRESHOLD_": str(64 * 2**30),
    "MALLOC_TOP_PAD_": str(2**30),
}


def main():
    if "--device" not in sys.argv[1:] or "cpu" in sys.argv[1:]:
        if any(os.environ.get(k) != v for k, v in CACHING_MALLOC.items()):
            os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **CACHING_MALLOC})
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shapes", help="rows x hidden, comma-separated (default: 8192x1024,4096x4096 on CPU, "
                                         "GPU_CASES on a GPU)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="with --shapes or on CPU: fp32, bf16, fp16")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    args = parser.parse_args()
    if load_error() is not None:
        raise SystemExit(f"the fused ops are not available: {load_error()}")
    if args.shapes is None and args.device == "cuda":
        cases = GPU_CASES
    else:
        shapes = [tuple(int(v) for v in shape.split("x"))
                  for shape in (args.shapes or "8192x1024,4096x4096").split(",")]
        cases = [(rows, hidden, name) for rows, hidden in shapes for name in args.dtypes.split(",")]
    copy_bw = copy_bandwidth(args.device)
    print(f"device={args.device} threads={torch.get_num_threads()} copy bandwidth {copy_bw / 1e9:.1f} GB/s")
    impls = {"eager": eager_sublayer, "fused": fused_sublayer}
    if not args.no_compile:
        impls["compile"] = compiled_sublayer()
    header = (f"{'shape':>10} {'dtype':>5} {'pass':>8} " + " ".join(f"{k:>9}" for k in impls)
              + f" {'eager/fused':>12} {'compile/fused':>14} {'fused GB/s':>10} {'% of copy':>9}")
    print(header)
    for rows, hidden, name in cases:
        shape, dtype = f"{rows}x{hidden}", DTYPES[name]
        times = {k: run_case(fn, rows, hidden, dtype, args.device) for k, fn in impls.items()}
        row_bytes = rows * hidden * torch.tensor([], dtype=dtype).element_size()
        for index, label, passes in ((0, "fwd", FORWARD_PASSES), (1, "fwd+bwd", FORWARD_PASSES + BACKWARD_PASSES)):
            t = {k: v[index] for k, v in times.items()}
            bandwidth = passes * row_bytes / t["fused"]
            compile_ratio = f"{t['compile'] / t['fused']:>14.2f}" if "compile" in t else f"{'-':>14}"
            print(f"{shape:>10} {name:>5} {label:>8} " + " ".join(f"{t[k] * 1e3:>7.1f}ms" for k in impls)
                  + f" {t['eager'] / t['fused']:>12.2f} {compile_ratio} {bandwidth / 1e9:>10.1f} "
                  f"{100 * bandwidth / copy_bw:>8.0f}%")


if __name__ == "__main__":
    main()

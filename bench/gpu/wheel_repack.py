"""Rewrite a wheel with one member replaced (e.g. a pruned library), as a valid wheel pip installs.

    python bench/gpu/wheel_repack.py IN.whl OUT_DIR --member PATH --replacement FILE --build-tag 1sm90

The member is stored LZMA-compressed (Python's zipfile, hence pip, reads it; the zero runs
that fatbin_prune.py leaves cost nothing), the rest deflated. RECORD gets the new member's
hash and size, and the wheel a build tag (in its file name and WHEEL file) saying it is not
the registry's file. Name and version stay, so Transformer Engine's version checks between
its packages still pass.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import sys
import zipfile
from pathlib import Path


def record_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return "sha256=" + base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()


def tagged_name(wheel_name: str, build_tag: str) -> str:
    """name-version[-build]-python-abi-platform.whl with ``build_tag`` as its build tag."""
    if not build_tag[:1].isdigit() or "-" in build_tag:
        raise ValueError(f"a wheel build tag starts with a digit and has no '-': {build_tag!r}")
    parts = wheel_name[: -len(".whl")].split("-")
    if len(parts) == 6:
        parts.pop(2)  # an existing build tag
    if len(parts) != 5:
        raise ValueError(f"not a wheel file name: {wheel_name}")
    return "-".join(parts[:2] + [build_tag] + parts[2:]) + ".whl"


def repack(wheel: Path, out_dir: Path, member: str, replacement: Path, build_tag: str) -> Path:
    output = out_dir / tagged_name(wheel.name, build_tag)
    with zipfile.ZipFile(wheel) as source:
        names = source.namelist()
        if member not in names:
            raise KeyError(f"{wheel.name} has no member {member}")
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        wheel_file = next(n for n in names if n.endswith(".dist-info/WHEEL"))
        with zipfile.ZipFile(output, "w", zipfile.ZIP_DEFLATED) as target:
            for info in source.infolist():
                if info.filename == member:
                    target.write(replacement, member, compress_type=zipfile.ZIP_LZMA)
                elif info.filename == record:
                    lines = []
                    for line in source.read(record).decode().splitlines():
                        path = line.rsplit(",", 2)[0]
                        if path == member:
                            line = f"{member},{record_hash(replacement)},{replacement.stat().st_size}"
                        lines.append(line)
                    target.writestr(info, "\n".join(lines) + "\n")
                elif info.filename == wheel_file:
                    text = [l for l in source.read(wheel_file).decode().splitlines() if not l.startswith("Build:")]
                    target.writestr(info, "\n".join(text + [f"Build: {build_tag}"]) + "\n")
                else:
                    target.writestr(info, source.read(info.filename))
    return output


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--member", required=True, help="path inside the wheel")
    parser.add_argument("--replacement", required=True, type=Path)
    parser.add_argument("--build-tag", required=True)
    args = parser.parse_args(argv)
    print(repack(args.wheel, args.out_dir, args.member, args.replacement, args.build_tag))
    return 0


if __name__ == "__main__":
    sys.exit(main())

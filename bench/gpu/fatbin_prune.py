"""Prune a CUDA shared library to one GPU architecture by zeroing the other fatbin payloads.

    python bench/gpu/fatbin_prune.py IN.so OUT.so --arch 90

Why: Transformer Engine's core library (libtransformer_engine.so, ~460 MB) carries device
code for sm_75 ... sm_120 in its ``.nv_fatbin`` ELF section, and the lent H200 needs only
sm_90's. Zeroing the payloads of the entries the driver can never load on the target keeps
the file's size, its ELF layout and every fatbin header byte for byte (nothing moves, no
offset or symbol changes), and leaves long zero runs that any compressor squeezes away.

Layout (little-endian), as nvcc writes it:

    .nv_fatbin section = fatbin containers, one after another (zero padding between)
    container header   = magic 0xBA55ED50 (u32), version (u16), header size (u16),
                         size of the entries that follow (u64)
    entry header       = kind (u16: 1 PTX, 2 cubin), version (u16), header size (u32),
                         payload size (u64), ..., arch at byte 28 (u32, e.g. 90 for sm_90)
    entry payload      = header-size bytes after the entry's start; the next entry follows it

What is kept, per container, for a target ``arch`` (which must be an N.0 architecture such as
80, 90 or 100, whose cubins run on no other device and which no other cubin runs on):
every entry built for exactly ``arch`` (cubin or PTX), and, in a container that has no cubin
for ``arch``, its highest PTX at or below ``arch`` (what the driver would JIT-compile there).
Everything else has its payload zeroed. The result is verified before it is written: same
size, same bytes outside the zeroed payloads.
"""

from __future__ import annotations

import argparse
import struct
import sys
from dataclasses import dataclass
from typing import Iterator, List, Tuple

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_CUBIN = 1, 2
KIND_NAMES = {KIND_PTX: "ptx", KIND_CUBIN: "cubin"}
ENTRY_HEADER_MIN = 32  # the fields read here end at byte 32 (arch at 28)


class PruneError(ValueError):
    """The input is not an ELF with a well-formed .nv_fatbin section."""


@dataclass(frozen=True)
class Entry:
    container: int  # file offset of its container
    offset: int  # file offset of the entry header
    kind: int
    header_size: int
    payload_size: int
    arch: int

    @property
    def payload(self) -> Tuple[int, int]:
        start = self.offset + self.header_size
        return start, start + self.payload_size


def elf_section(data: bytes, name: str) -> Tuple[int, int]:
    """(file offset, size) of the named section of a 64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF" or len(data) < 64:
        raise PruneError("not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise PruneError("only 64-bit little-endian ELF files are supported")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shoff + shnum * shentsize > len(data):
        raise PruneError("ELF section header table is missing or truncated")

    def header(index: int):
        # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size
        return struct.unpack_from("<IIQQQQ", data, shoff + index * shentsize)

    strtab_offset = header(shstrndx)[4]
    for index in range(shnum):
        name_offset, sh_type, _, _, offset, size = header(index)
        start = strtab_offset + name_offset
        section_name = data[start : data.index(b"\0", start)].decode("ascii", "replace")
        if section_name == name:
            if sh_type == 8:  # SHT_NOBITS: no bytes in the file
                raise PruneError(f"section {name} has no file contents")
            if offset + size > len(data):
                raise PruneError(f"section {name} runs past the end of the file")
            return offset, size
    raise PruneError(f"no {name} section (not a CUDA library, or its device code is elsewhere)")


def fatbin_entries(data: bytes, start: int, size: int) -> Iterator[Entry]:
    """Every entry of every fatbin container in data[start:start+size]; raises on anything
    that is not a well-formed container or zero padding."""
    end, position = start + size, start
    while position < end:
        if position + 16 > end:
            if any(data[position:end]):
                raise PruneError(f"stray bytes at the end of the fatbin section (offset {position:#x})")
            return
        magic, _, header_size, entries_size = struct.unpack_from("<IHHQ", data, position)
        if magic != FATBIN_MAGIC:
            if data[position : position + 8] != bytes(8):
                raise PruneError(f"no fatbin container at offset {position:#x} (magic {magic:#x})")
            position += 8  # zero padding between containers
            continue
        container, entry = position, position + header_size
        container_end = entry + entries_size
        if header_size < 16 or container_end > end:
            raise PruneError(f"fatbin container at {container:#x} runs past its section")
        while entry < container_end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            arch, = struct.unpack_from("<I", data, entry + 28)
            if kind not in KIND_NAMES or entry_header < ENTRY_HEADER_MIN:
                raise PruneError(f"bad fatbin entry at {entry:#x} (kind {kind}, header {entry_header})")
            if entry + entry_header + payload > container_end:
                raise PruneError(f"fatbin entry at {entry:#x} runs past its container")
            yield Entry(container, entry, kind, entry_header, payload, arch)
            entry += entry_header + payload
        position = container_end


def entries_to_keep(entries: List[Entry], arch: int) -> List[Entry]:
    """What the driver can load on ``arch`` (see the module docstring)."""
    keep = [e for e in entries if e.arch == arch]
    by_container = {}
    for entry in entries:
        by_container.setdefault(entry.container, []).append(entry)
    for members in by_container.values():
        if any(e.kind == KIND_CUBIN and e.arch == arch for e in members):
            continue
        ptx = [e for e in members if e.kind == KIND_PTX and e.arch <= arch]
        if ptx:
            best = max(ptx, key=lambda e: e.arch)
            if best not in keep:
                keep.append(best)
    return keep


@dataclass
class Report:
    entries: int
    kept: int
    zeroed: int
    kept_bytes: int
    zeroed_bytes: int
    by_arch: dict  # "cubin sm_90" -> count

    def summary(self) -> str:
        archs = ", ".join(f"{k}: {v}" for k, v in sorted(self.by_arch.items()))
        return (f"{self.entries} fatbin entries ({archs}); kept {self.kept} ({self.kept_bytes / 2**20:.1f} MiB), "
                f"zeroed {self.zeroed} ({self.zeroed_bytes / 2**20:.1f} MiB)")


def prune(data: bytearray, arch: int) -> Report:
    """Zero, in place, the payloads of ``data``'s fatbin entries that ``arch`` cannot load."""
    if arch % 10 != 0:
        raise ValueError(f"arch must be an N.0 architecture (80, 90, 100, ...), got {arch}")
    start, size = elf_section(data, ".nv_fatbin")
    entries = list(fatbin_entries(data, start, size))
    if not entries:
        raise PruneError("the .nv_fatbin section holds no fatbin entries")
    keep = set(entries_to_keep(entries, arch))
    if not any(e.kind == KIND_CUBIN for e in keep):
        raise PruneError(f"no sm_{arch} cubin in this library: pruning would leave nothing to run")
    by_arch: dict = {}
    kept_bytes = zeroed_bytes = 0
    for entry in entries:
        label = f"{KIND_NAMES[entry.kind]} sm_{entry.arch}"
        by_arch[label] = by_arch.get(label, 0) + 1
        if entry in keep:
            kept_bytes += entry.payload_size
        else:
            begin, finish = entry.payload
            data[begin:finish] = bytes(finish - begin)
            zeroed_bytes += entry.payload_size
    return Report(len(entries), len(keep), len(entries) - len(keep), kept_bytes, zeroed_bytes, by_arch)


def verify(original: bytes, pruned: bytes, arch: int) -> None:
    """Raise unless ``pruned`` is ``original`` with only the non-``arch`` payloads zeroed."""
    if len(original) != len(pruned):
        raise PruneError("the pruned file changed size")
    start, size = elf_section(original, ".nv_fatbin")
    entries = list(fatbin_entries(original, start, size))
    keep = set(entries_to_keep(entries, arch))
    position = 0
    for entry in sorted(entries, key=lambda e: e.offset):
        begin, finish = entry.payload
        if entry in keep:
            continue
        if original[position:begin] != pruned[position:begin]:
            raise PruneError(f"bytes outside the zeroed payloads changed (before {begin:#x})")
        if any(pruned[begin:finish]):
            raise PruneError(f"payload at {begin:#x} was not zeroed")
        position = finish
    if original[position:] != pruned[position:]:
        raise PruneError("bytes after the last zeroed payload changed")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input")
    parser.add_argument("output")
    parser.add_argument("--arch", type=int, default=90, help="the architecture to keep, e.g. 90 for sm_90 (H100/H200)")
    args = parser.parse_args(argv)
    with open(args.input, "rb") as f:
        original = f.read()
    pruned = bytearray(original)
    try:
        report = prune(pruned, args.arch)
        verify(original, pruned, args.arch)
    except PruneError as error:
        print(f"fatbin_prune: {args.input}: {error}", file=sys.stderr)
        return 1
    with open(args.output, "wb") as f:
        f.write(pruned)
    print(f"{args.input}: {report.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The memory areas of a task from CRIU's mm image (mm-<vpid>.img), without crit.

One mm_entry message after the two magics; its field 14 holds each vma_entry
(images/mm.proto, images/vma.proto). Only what page filling asks is kept:
where an area lies, its protection and mmap flags, CRIU's status bits
(criu/include/image.h), which say what kind of memory it is, and the madvise
bits CRIU's restorer applies to it (field 9), which ``with_advice`` adds to.
"""

from __future__ import annotations

import struct
from collections.abc import Collection
from dataclasses import dataclass

from gpusnap.criu.images import IMG_COMMON_MAGIC, ImageError, checked_messages, fields_of
from gpusnap.proto.wire import WireError, spans, varint

MM_MAGIC = 0x57492820
PROT_WRITE = 0x2
MAP_PRIVATE, MAP_ANONYMOUS, MAP_GROWSDOWN, MAP_HUGETLB = 0x02, 0x20, 0x0100, 0x40000
MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15
VMA_AREA_REGULAR, VMA_FILE_PRIVATE, VMA_ANON_PRIVATE, VMA_EXT_PLUGIN = 1 << 0, 1 << 6, 1 << 9, 1 << 27
# Kinds of memory CRIU restores its own way (stacks, vdso, AIO rings, SysV
# shm, memfd, shadow stacks, guard pages, uprobes, plugins' areas, unsupported).
VMA_SPECIAL = ((1 << 1) | (1 << 2) | (1 << 3) | (1 << 10) | (1 << 11) | (1 << 12) | (1 << 13)
               | (1 << 14) | (1 << 15) | (1 << 16) | (1 << 17) | (1 << 27) | (1 << 31))


@dataclass(frozen=True)
class Vma:
    start: int
    end: int
    prot: int
    flags: int
    status: int
    madv: int = 0  # bit N: CRIU's restorer calls madvise(start, length, N)
    pgoff: int = 0  # a file mapping's offset in its file
    shmid: int = 0  # a file mapping's file: its id in CRIU's files image

    @property
    def private_file(self) -> bool:
        """A private mapping of a regular file: CRIU maps the file and writes the
        task's changed pages over it, each write reading the file's page first."""
        return bool(self.status & VMA_AREA_REGULAR and self.status & VMA_FILE_PRIVATE
                    and not self.status & VMA_SPECIAL)

    @property
    def plain_private_memory(self) -> bool:
        """Writable private anonymous memory that CRIU restores only by writing
        its pages into place: nothing else of the task depends on how they got there."""
        return (self.status & VMA_AREA_REGULAR and self.status & VMA_ANON_PRIVATE
                and not self.status & VMA_SPECIAL and self.prot & PROT_WRITE
                and self.flags & MAP_PRIVATE and not self.flags & (MAP_GROWSDOWN | MAP_HUGETLB))

    @property
    def restored_in_place(self) -> bool:
        """Memory CRIU never premaps (criu/mem.c, premap_priv_vmas): hugetlb and
        plugins' areas, whose pages its restorer reads itself."""
        return bool(self.flags & MAP_HUGETLB or self.status & VMA_EXT_PLUGIN)


def parse(data: bytes) -> list[Vma]:
    entries = checked_messages(data, MM_MAGIC, "mm")
    if len(entries) != 1:
        raise ImageError(f"an mm image holds one entry, this one {len(entries)}")
    vmas = []
    for number, wire, value in fields_of(entries[0]):
        if number == 14 and wire == 2:
            f = {n: v for n, w, v in fields_of(value) if w == 0}
            vmas.append(Vma(f.get(1, 0), f.get(2, 0), f.get(5, 0), f.get(6, 0), f.get(7, 0),
                            f.get(9, 0), f.get(3, 0), f.get(4, 0)))
    return vmas


def with_advice(data: bytes, areas: Collection[tuple[int, int]], advice: int) -> bytes:
    """The mm image with bit ``advice`` added to the madvise bits of the areas
    (start, end) named; every other byte as it was. ValueError names an area
    the image lacks."""
    if len(data) < 12 or struct.unpack_from("<II", data) != (IMG_COMMON_MAGIC, MM_MAGIC):
        raise ImageError("not a CRIU mm image")
    (size,) = struct.unpack_from("<I", data, 8)
    if 12 + size != len(data):
        raise ImageError("an mm image holds one entry, this one does not")
    entry, out, left = data[12:12 + size], [], set(areas)
    try:
        for number, wire, value, start, end in spans(entry):
            if number != 14 or wire != 2:
                out.append(entry[start:end])
                continue
            f = {n: v for n, w, v in fields_of(value) if w == 0}
            if (f.get(1, 0), f.get(2, 0)) not in left:
                out.append(entry[start:end])
                continue
            left.discard((f.get(1, 0), f.get(2, 0)))
            kept = b"".join(value[s:e] for n, _, _, s, e in spans(value) if n != 9)
            vma = kept + varint(9 << 3) + varint(f.get(9, 0) | 1 << advice)
            out.append(varint(14 << 3 | 2) + varint(len(vma)) + vma)
    except WireError as exc:
        raise ImageError(str(exc)) from None
    if left:
        raise ValueError(f"the mm image has no area {min(left)[0]:#x}-{min(left)[1]:#x}")
    body = b"".join(out)
    return data[:8] + struct.pack("<I", len(body)) + body

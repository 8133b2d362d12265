"""The memory areas of a task from CRIU's mm image (mm-<vpid>.img), without crit.

One mm_entry message after the two magics; its field 14 holds each vma_entry
(images/mm.proto, images/vma.proto). Only what page filling asks is kept:
where an area lies, its protection and mmap flags, and CRIU's status bits
(criu/include/image.h), which say what kind of memory it is.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from gpusnap.criu.images import IMG_COMMON_MAGIC, ImageError, fields_of, messages

MM_MAGIC = 0x57492820
PROT_WRITE = 0x2
MAP_PRIVATE, MAP_ANONYMOUS, MAP_GROWSDOWN, MAP_HUGETLB = 0x02, 0x20, 0x0100, 0x40000
VMA_AREA_REGULAR, VMA_ANON_PRIVATE, VMA_EXT_PLUGIN = 1 << 0, 1 << 9, 1 << 27
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
    if len(data) < 8 or struct.unpack_from("<II", data) != (IMG_COMMON_MAGIC, MM_MAGIC):
        raise ImageError("not a CRIU mm image")
    entries = messages(data)
    if len(entries) != 1:
        raise ImageError(f"an mm image holds one entry, this one {len(entries)}")
    vmas = []
    for number, wire, value in fields_of(entries[0]):
        if number == 14 and wire == 2:
            f = {n: v for n, w, v in fields_of(value) if w == 0}
            vmas.append(Vma(f.get(1, 0), f.get(2, 0), f.get(5, 0), f.get(6, 0), f.get(7, 0)))
    return vmas

"""CRIU's pagemap images (pagemap-<vpid>.img), read and written without crit.

A pagemap image is the two magics, then u32-sized protobuf messages: one
pagemap_head (pages_id: the task's pages-<id>.img), then one pagemap_entry per
run of pages (images/pagemap.proto). A run with PE_PRESENT has its pages next
in the pages file, in order, so a page's offset there is implicit; a run with
PE_PARENT has none there: CRIU reads it from the ``parent`` images folder, at
the same address (how its own pre-dump chains restore, criu/page-read.c).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

from gpusnap.criu.images import IMG_COMMON_MAGIC, ImageError
from gpusnap.proto.wire import WireError, read_varint, varint

PAGEMAP_MAGIC = 0x56084025
PAGE = 4096
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4


class Run(NamedTuple):
    """A run of ``pages`` pages at ``vaddr`` (a tuple: a 32 GiB task has tens of
    thousands, parsed and written again in the stop)."""

    vaddr: int
    pages: int
    flags: int

    @property
    def present(self) -> bool:
        return bool(self.flags & PE_PRESENT)


@dataclass(frozen=True)
class Pagemap:
    pages_id: int
    runs: tuple[Run, ...]

    @property
    def pages_file(self) -> str:
        return f"pages-{self.pages_id}.img"

    def present_bytes(self) -> int:
        return sum(r.pages for r in self.runs if r.present) * PAGE


def parse(data: bytes) -> Pagemap:
    """One pass over the image, each entry's fields kept in locals and its varints
    decoded inline: the generic reader (images.messages + fields_of, a dict an
    entry) costs several Python calls a run, and so does a call of
    wire.read_varint per multi-byte value (every address); these images are read
    in the stop of a dump and of a restore (a GPU process's holds thousands of
    runs)."""
    if len(data) < 8 or struct.unpack_from("<II", data) != (IMG_COMMON_MAGIC, PAGEMAP_MAGIC):
        raise ImageError("not a CRIU pagemap image")
    n, pos, unpack = len(data), 8, struct.unpack_from
    head, runs = None, []
    try:
        while pos < n:
            if pos + 4 > n:
                raise ImageError("truncated entry size")
            end = pos + 4 + unpack("<I", data, pos)[0]
            pos += 4
            if end > n:
                raise ImageError("truncated entry")
            vaddr = compat = in_parent = 0
            pages = flags = None
            while pos < end:
                key = data[pos]  # a one-byte tag (fields 1-15), else read as a varint
                if key < 0x80:
                    pos += 1
                else:
                    key, pos = read_varint(data, pos, end)
                if key & 7:
                    raise ImageError(f"unexpected wire type {key & 7} in a pagemap entry")
                value = data[pos]
                pos += 1
                if value >= 0x80:  # the varint's further bytes, inline (as wire.read_varint)
                    value &= 0x7F
                    shift = 7
                    while True:
                        byte = data[pos]
                        pos += 1
                        value |= (byte & 0x7F) << shift
                        if byte < 0x80:
                            break
                        shift += 7
                        if shift > 63:
                            raise ImageError("varint too long")
                if pos > end:
                    raise ImageError("truncated varint")
                field = key >> 3
                if field == 1:
                    vaddr = value
                elif field == 5:
                    pages = value
                elif field == 4:
                    flags = value
                elif field == 2:
                    compat = value
                elif field == 3:
                    in_parent = value
            if head is None:
                head = vaddr  # pagemap_head: field 1 is pages_id
                continue
            # as criu/page-read.c reads old images: in_parent, or no flags at all (present)
            if flags is None:
                flags = PE_PARENT if in_parent else PE_PRESENT
            runs.append(Run(vaddr, compat if pages is None else pages, flags))
    except IndexError:  # a varint running off the image's end
        raise ImageError("truncated varint") from None
    except WireError as exc:
        raise ImageError(str(exc)) from None
    if head is None:
        raise ImageError("a pagemap image without its head")
    return Pagemap(head, tuple(runs))


def _message(fields: list[tuple[int, int]]) -> bytes:
    body = b"".join(varint(n << 3) + varint(v) for n, v in fields)
    return struct.pack("<I", len(body)) + body


def serialize(pagemap: Pagemap) -> bytes:
    """As CRIU 4 writes one: compat_nr_pages 0, nr_pages and flags set."""
    out = [struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC),
           _message([(1, pagemap.pages_id)])]
    size, flag_bytes = struct.Struct("<I").pack, {}
    for r in pagemap.runs:  # one entry: vaddr (1), compat_nr_pages 0 (2), flags (4), nr_pages (5)
        flags = flag_bytes.get(r.flags) or flag_bytes.setdefault(r.flags, varint(r.flags))
        body = b"".join((b"\x08", varint(r.vaddr), b"\x10\x00\x20", flags, b"\x28",
                         varint(r.pages)))
        out += (size(len(body)), body)
    return b"".join(out)


def offsets(pagemap: Pagemap) -> list[tuple[int, int, int]]:
    """(offset in the pages file, vaddr, pages) of each present run, in order."""
    out, pos = [], 0
    for r in pagemap.runs:
        if r.present:
            out.append((pos, r.vaddr, r.pages))
            pos += r.pages * PAGE
    return out

"""Protobuf's varints, for the few messages gpusnap reads and writes by hand
(CRIU's mount and pagemap images, the shim's delete reply): no protobuf import."""

from __future__ import annotations


class WireError(ValueError):
    pass


def read_varint(data: bytes, pos: int, end: int | None = None) -> tuple[int, int]:
    """The varint at ``pos`` (of a message ending at ``end``), and the position after it."""
    end = len(data) if end is None else end
    value = shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos
        if shift > 63:
            raise WireError("varint too long")


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def fields(data: bytes):
    """Each (field number, wire type, value) of a message: an int for varints,
    bytes for length-delimited fields, None for fixed 32/64-bit ones (unused here)."""
    for number, wire, value, _, _ in spans(data):
        yield number, wire, value


def spans(data: bytes):
    """As ``fields``, with where each field's bytes begin and end in ``data``: an
    editor copies the fields it does not change byte for byte (fixed ones too)."""
    pos = 0
    while pos < len(data):
        start = pos
        tag, pos = read_varint(data, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = read_varint(data, pos)
        elif wire == 2:
            size, pos = read_varint(data, pos)
            if pos + size > len(data):
                raise WireError("truncated field")
            value, pos = data[pos:pos + size], pos + size
        elif wire in (1, 5):
            value, pos = None, pos + (8 if wire == 1 else 4)
            if pos > len(data):
                raise WireError("truncated field")
        else:
            raise WireError(f"unsupported protobuf wire type {wire}")
        yield number, wire, value, start, pos

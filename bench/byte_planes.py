"""Would bf16 chunks cost less split into their two byte planes?

    /opt/gpusnap/venv/bin/python bench/byte_planes.py [--mib 4] [--rounds 5] [--json]

bf16 weights drawn from a normal distribution (std 0.02, the bit statistics
of model weights): the high byte of each value (sign and exponent) compresses,
the low byte (mantissa) hardly does. Each zstd level is timed on one thread
over the chunk as it is, and over its two planes split and compressed apart
(Python's own slicing: what gpusnap would do without numpy), decoding and
joining them back included. Prints the ratio and the MB/s of each way.
"""

from __future__ import annotations

import argparse
import array
import json
import random
import time

import zstandard


def bf16_normals(n: int, seed: int = 1) -> bytes:
    rng = random.Random(seed)
    f32 = array.array("f", (rng.gauss(0, 0.02) for _ in range(n))).tobytes()
    out = bytearray(2 * n)
    out[0::2], out[1::2] = f32[2::4], f32[3::4]  # bf16: the high half of each float32
    return bytes(out)


def timed(fn, rounds: int) -> float:
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - start) / rounds


def measure(data: bytes, level: int, rounds: int) -> dict:
    c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
    whole = c.compress(data)
    planes = (c.compress(data[0::2]), c.compress(data[1::2]))

    def split() -> None:
        c.compress(data[0::2]), c.compress(data[1::2])

    def join() -> None:
        out = bytearray(len(data))
        out[0::2], out[1::2] = d.decompress(planes[0]), d.decompress(planes[1])

    mb = len(data) / 1e6
    return {"level": level,
            "whole": {"ratio": round(len(whole) / len(data), 3),
                      "compress_mb_s": round(mb / timed(lambda: c.compress(data), rounds)),
                      "decompress_mb_s": round(mb / timed(lambda: d.decompress(whole), rounds))},
            "planes": {"ratio": round(sum(map(len, planes)) / len(data), 3),
                       "compress_mb_s": round(mb / timed(split, rounds)),
                       "decompress_mb_s": round(mb / timed(join, rounds)),
                       "exponent_ratio": round(len(planes[1]) / (len(data) // 2), 3)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=4, help="chunk size (gpusnap's chunks average 4 MiB)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    data = bf16_normals(a.mib << 19)
    results = [measure(data, level, a.rounds) for level in (1, 3)]
    if a.json:
        print(json.dumps(results, indent=1))
        return
    for r in results:
        w, p = r["whole"], r["planes"]
        print(f"zstd-{r['level']}: as it is {w['ratio']:.3f}, {w['compress_mb_s']} / "
              f"{w['decompress_mb_s']} MB/s; two planes {p['ratio']:.3f}, {p['compress_mb_s']} / "
              f"{p['decompress_mb_s']} MB/s (compress / decompress, one thread)")


if __name__ == "__main__":
    main()

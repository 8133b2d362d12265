"""oci/segments._write_mapped: segments written into one file through mappings."""

from __future__ import annotations

import os

from gpusnap.oci import segments


def test_segments_at_unaligned_offsets_share_a_page(tmp_path):
    path = tmp_path / "pages-1.img"
    data = os.urandom(3 * 4096 + 1536)
    with open(path, "wb") as f:
        f.truncate(len(data))
    cut = 4096 + 512  # chunk sizes are multiples of 512, not of the page size
    # the second segment first: each worker writes only its own bytes of the shared page
    segments._write_mapped(str(path), cut, len(data) - cut, [data[cut:cut + 1000], data[cut + 1000:]])
    segments._write_mapped(str(path), 0, cut, [data[:cut]])
    segments._write_mapped(str(path), len(data), 0, [])  # nothing to write: no mapping made
    assert path.read_bytes() == data

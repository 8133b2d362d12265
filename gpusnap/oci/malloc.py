"""One glibc heap for the transfer threads.

Chunk buffers (256 KiB to 16 MiB) are allocated in one thread and freed in
another, and glibc gives every thread that allocates its own heap ("arena"),
up to 8 per core: each keeps the freed chunks it once held, so peak RSS grows
with the number of threads, not with the chunks in flight. With one arena the
freed buffers are reused by whichever thread needs the next one.

One arena gives a push or pull a lower peak RSS than glibc's default, and
less CPU. A fixed mmap threshold (every chunk its own mapping) gives the
lowest RSS, but its page faults cost much more CPU (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes

_M_ARENA_MAX = -8  # malloc.h
ARENAS = 1
_done = False


def one_heap_for_all_threads() -> bool:
    """Limit glibc to ARENAS arenas; must run before the threads allocate.
    False where it cannot be set (not glibc: its allocator decides)."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(None)
        _done = bool(libc.mallopt(_M_ARENA_MAX, ARENAS))
    except (OSError, AttributeError):
        return False
    return _done

"""Upload CRIU's page images while CRIU still writes them.

A GPU process's pages-N.img is as large as its GPU memory, and CRIU writes it
front to back, for seconds. Podman's export, where the push learns the file's
final size, starts only after the whole dump: waiting for it would leave the
worker cores idle for those seconds (bench/timeline.py's figures in
docs/benchmarks.md). This watcher polls
Podman's checkpoint folder and hands every whole segment CRIU has written to
the segment workers at once; when the export's header arrives, the push takes
those futures and submits only the rest.

Safe because CRIU only appends to an image (it never rewrites bytes it has
written), because segments are final once the file is big enough that its
chunk sizes no longer depend on its size (``final_from``), and because the
push still checks the file against the export's header (size and mtime) before
it uses a single early segment. Page images left from an earlier checkpoint
are removed before the dump (``clear_stale``), so every file seen is this dump's.

Memory pre-dump reads ahead of CRIU (pages/dump_ahead.py) lands in a file of
the push's RAM folder at its final offsets, with a note that grows as the read
goes on (``.ready``: the file's size and the ranges read, every GiB): the
segments that lie wholly in those ranges go to the workers then, while the
read and then CRIU go on.
The file becomes a pages file at post-dump, the same inode: ``take`` finds
them by it. In a pre-copy's final round the note also names the ranges the
read found as round 1 left them: a segment wholly in those is round 1's
chunks (same_pages.py), handed over done without a worker reading it.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gpusnap.errors import GpusnapError
from gpusnap.oci import chunker
from gpusnap.oci.bundle import Chunk
from gpusnap.pages import same_pages

POLL = 0.05  # seconds between looks at the folder
PATTERN = "pages-*.img"
READY = ".ahead-*.img.ready"  # dump_ahead._note


def clear_stale(images: Path) -> None:
    """Page images of an earlier dump of this (running) container: the coming
    dump replaces them anyway, and the watcher must not read them as new."""
    for path in images.glob(PATTERN):
        path.unlink(missing_ok=True)


_Key = tuple[int, int]  # a file's (device, inode): tmpfs and disk number inodes apart


def _key(st: os.stat_result) -> _Key:
    return st.st_dev, st.st_ino


@dataclass
class _Watched:
    ino: int
    params: chunker.ChunkParams
    end: int = 0  # bytes handed to workers, a multiple of params.segment
    bad: bool = False  # the file was replaced or shrank after segments were read
    futures: list[Future] = field(default_factory=list)
    held: Path | None = None  # the workers' way to the file (the push pins it open)


class EarlyPages:
    """``submit(path, start, length, params)`` -> a segment's future (segments.SegmentPool).

    ``params_for(size)`` gives a file's chunk parameters; they are final for
    every size from ``final_from`` on, which is when a file is first taken.
    ``known(chunks)`` -> a done future of a segment that is round 1's
    ``chunks``, for a push whose ``push_id`` matches round 1's index;
    ``on_known(future)`` once such a future is handed to the push (take):
    what was never handed out is never counted."""

    def __init__(self, images: Path, submit: Callable[[Path, int, int, chunker.ChunkParams], Future],
                 params_for: Callable[[int], chunker.ChunkParams], final_from: int,
                 done: Callable[[], bool],
                 pin: Callable[[Path], Path | None] = lambda path: path,
                 aside: Path | None = None,
                 known: Callable[[list[Chunk]], Future] | None = None,
                 push_id: str | None = None,
                 on_known: Callable[[Future], None] = lambda future: None) -> None:
        self.images, self._submit, self._params_for = images, submit, params_for
        self.aside, self._known, self._push_id, self._on_known = aside, known, push_id, on_known
        # read ahead, by file (device, inode): the ranges found unchanged, the
        # index beside it, round 1's chunks of each segment (for the parameters
        # asked) and the futures made of them
        self._same: dict[_Key, list[tuple[int, int, int]]] = {}  # (start, end, shift)
        self._read_as: dict[_Key, Path] = {}
        self._indexes: dict[_Key, same_pages.Index | None] = {}
        self._made_known: set[Future] = set()
        # read ahead: file -> (chunk parameters, {segment offset: future})
        self._ahead: dict[_Key, tuple[chunker.ChunkParams, dict[int, Future]]] = {}
        self._notes: dict[str, tuple[int, int]] = {}  # note -> (inode, mtime) last read
        self._held_ahead: dict[_Key, Path] = {}
        self._ahead_of: dict[str, _Key] = {}  # a file read ahead -> its (device, inode)
        self._pin = pin
        self._final_from, self._done = final_from, done
        self._files: dict[str, _Watched] = {}
        self._taken: set[str] = set()  # handed to the push: never watched again
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.early_bytes = 0
        self._thread = threading.Thread(target=self._loop, name="gpusnap-early-pages", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(POLL) and not self._done():
            if self.aside is not None:
                for note in self.aside.glob(READY):
                    with self._lock:
                        if self._stop.is_set():
                            return
                        try:
                            self._read_ahead(note)
                        except GpusnapError:
                            return
            for path in self.images.glob(PATTERN):
                try:
                    st = path.stat()
                except OSError:
                    continue
                with self._lock:
                    if self._stop.is_set():
                        return
                    try:
                        self._advance(path, st)
                    except GpusnapError:
                        return  # a worker died: the push says so when it takes the file

    def _advance(self, path: Path, st: os.stat_result) -> None:
        if _key(st) in self._ahead:  # read ahead, now whole under its pages name
            self._complete(st)
            return
        w = self._files.get(path.name)
        if w is None:
            if path.name in self._taken or st.st_size < self._final_from:
                return
            held = self._pin(path)
            if held is None:
                return
            w = self._files[path.name] = _Watched(st.st_ino, self._params_for(st.st_size),
                                                  held=held)
        if w.ino != st.st_ino or st.st_size < w.end:  # replaced or cut: take() gives nothing
            w.bad = True
        if w.bad:
            return
        seg = w.params.segment
        while w.end + seg <= st.st_size:
            w.futures.append(self._submit(w.held, w.end, seg, w.params))
            w.end += seg
            self.early_bytes += seg

    def _read_ahead(self, note: Path) -> None:
        """The segments of a file read ahead that lie wholly in its final
        ranges, and were not handed out before: the note grows while the read
        goes on (dump_ahead._note), each version replacing the last."""
        try:
            st = note.stat()
            if self._notes.get(note.name) == (st.st_ino, st.st_mtime_ns):
                return
            self._notes[note.name] = (st.st_ino, st.st_mtime_ns)
            ready = json.loads(note.read_text())
            size, final = int(ready["size"]), [(int(a), int(b)) for a, b in ready["final"]]
            same = [(int(r[0]), int(r[1]), int(r[2]) if len(r) > 2 else 0)
                    for r in ready.get("same", [])]
        except (OSError, ValueError, KeyError, TypeError):
            return
        data = note.with_name(note.name.removesuffix(".ready"))
        ino = self._ahead_of.get(data.name)
        if ino is None:
            held = self._pin(data)
            if held is None:
                return
            ino = self._ahead_of[data.name] = _key(os.stat(held))
            self._held_ahead[ino] = held
            self._read_as[ino] = data  # its index keeps this name (same_pages.index_path)
            if size >= self._final_from:
                self._ahead[ino] = (self._params_for(size), {})
        self._same[ino] = same
        if ino not in self._ahead:
            return  # taken by the push already, or small: take() finds its known segments
        params, submitted = self._ahead[ino]
        if self._params_for(size) != params:
            return
        seg = params.segment
        for at in range(0, size - seg, seg):  # not the last: the file grows past ``size``
            if at not in submitted and same_pages.covered(final, at, at + seg):
                submitted[at] = self._known_or(ino, params, at, size) \
                    or self._early(ino, at, params)

    def _early(self, ino: _Key, at: int, params: chunker.ChunkParams,
               length: int | None = None) -> Future:
        """The segment to a worker, with round 1's chunks where the read found
        its bytes moved (same_pages.Index.moved): those are not hashed there."""
        length = params.segment if length is None else length
        self.early_bytes += length
        moved = self._moved(ino)
        index = self._index(ino) if moved else None
        known = index.moved(moved, at, at + length) if index else ()
        held = self._held_ahead[ino]
        return self._submit(held, at, length, params, known) if known \
            else self._submit(held, at, length, params)

    def _index(self, ino: _Key) -> same_pages.Index | None:
        """Round 1's index beside the file read ahead, read once."""
        if ino not in self._indexes:
            self._indexes[ino] = same_pages.load_index(self._read_as[ino], self._push_id)
        return self._indexes[ino]

    def _moved(self, ino: _Key) -> list[tuple[int, int, int]]:
        """The ranges the read found unchanged but moved, where round 1's index may serve."""
        if self._known is None or self._push_id is None or ino not in self._read_as:
            return []
        return [r for r in self._same.get(ino, []) if r[2]]

    def _add_moved(self, ino: _Key, params: chunker.ChunkParams, size: int,
                   have: dict[int, Future]) -> dict[int, Future]:
        """The segments not handed out yet that hold moved ranges, to the workers
        now with round 1's chunks (a file too small to be taken early)."""
        moved = self._moved(ino)
        for at in range(0, size, params.segment) if moved else ():
            end = min(at + params.segment, size)
            if at not in have and any(a < end and at < b for a, b, _ in moved):
                have[at] = self._early(ino, at, params, end - at)
        return have

    def _known_or(self, ino: _Key, params: chunker.ChunkParams, at: int, size: int
                  ) -> Future | None:
        """Round 1's chunks of the segment at ``at``, done, where the read found
        it wholly unchanged and round 1's index has them; else None."""
        same = [(a, b) for a, b, shift in self._same.get(ino, []) if shift == 0]
        end = at + params.segment
        if self._known is None or self._push_id is None or not same or end > size \
                or not same_pages.covered(same, at, end) or ino not in self._read_as:
            return None
        index = self._index(ino)
        chunks = index.segments(params).get(at) if index else None
        if chunks is None:
            return None
        made = self._known(chunks)
        self._made_known.add(made)
        return made

    def _add_known(self, ino: _Key, params: chunker.ChunkParams, size: int,
                   have: dict[int, Future]) -> dict[int, Future]:
        for at in range(0, size, params.segment):
            if at not in have:
                found = self._known_or(ino, params, at, size)
                if found is not None:
                    have[at] = found
        return have

    def _complete(self, st: os.stat_result) -> None:
        """A file read ahead that post-dump made whole: its other whole segments."""
        key = _key(st)
        params, have = self._ahead[key]
        if self._params_for(st.st_size) != params:
            return
        for at in range(0, st.st_size - params.segment + 1, params.segment):
            if at not in have:
                have[at] = self._known_or(key, params, at, st.st_size) \
                    or self._early(key, at, params)

    def take(self, path: Path, size: int, params: chunker.ChunkParams) -> dict[int, Future]:
        """The futures of ``path``'s segments already submitted or known, by
        offset; {} when none, or when the file is not the one they came from."""
        try:
            st = os.stat(path)
        except OSError:
            st = None
        with self._lock:
            w = self._files.pop(path.name, None)
            self._taken.add(path.name)
            key = _key(st) if st is not None else None
            ahead = self._ahead.pop(key, None) if key is not None else None
            if ahead is not None:
                if ahead[0] == params and ahead[1] and max(ahead[1]) + params.segment <= size:
                    have = self._add_known(key, params, size, ahead[1])
                    return self._handed(self._add_moved(key, params, size, have))
                for f in ahead[1].values():
                    f.cancel()
            if key is not None and key in self._same and w is None:
                have = self._add_known(key, params, size, {})
                return self._handed(self._add_moved(key, params, size, have))
        if w is None:
            return {}
        same = st is not None and st.st_ino == w.ino and st.st_size >= w.end
        if w.bad or not same or w.params != params or w.end > size:
            for f in w.futures:
                f.cancel()
            return {}
        return {i * params.segment: f for i, f in enumerate(w.futures)}

    def _handed(self, have: dict[int, Future]) -> dict[int, Future]:
        """``have`` goes to the push: its known segments are counted now, once."""
        for f in have.values():
            if f in self._made_known:
                self._made_known.discard(f)
                self._on_known(f)
        return have

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
        self._thread.join()

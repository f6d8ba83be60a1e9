"""Sequential prefetch for object stores: GETs kept in flight ahead of a reader that moves forward.

The DCP reader reads each data file front to back, a record (or a part of a large record) at a
time, from a few threads that each read, then check and decode before reading again. Against an
object store every read is a request with its own latency, so a thread that decodes is a thread
that does not fetch: the network idles while the CPU works, then the reverse. :class:`Prefetcher`
notices reads of one object that move forward and keeps ``window`` bytes after the furthest of
them being fetched, as GETs of ``part`` bytes on the storage's thread pool, so that the next
reads find their bytes already here (or on their way).

Memory is bounded: extents are scheduled no further than ``window`` past the reads, an extent is
dropped as soon as as many bytes were read from it as it holds, and extents that the reads left
behind are dropped. A read that lies inside one extent gets a view of it (no copy); a read that
spans extents is copied together; a read that finds none goes to the store as before. A failed
prefetch is dropped quietly: the read then makes its own request, which raises the real error.
Nothing here checks bytes: the reader checks every chunk's CRC32C, and
:meth:`Prefetcher.forget` (called by ``forget_cached`` before a re-read) drops what was fetched.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from nvdcp.storage.base import Buffer, ReadBuffer, read_buffer

#: fetch(start, length) -> up to ``length`` bytes at ``start`` (fewer at the end of the object)
Fetch = Callable[[int, int], ReadBuffer]


@dataclass(eq=False)
class _Extent:
    start: int
    length: int
    future: cf.Future[ReadBuffer]
    consumed: int = 0  # bytes of it read at least once
    read: list[tuple[int, int]] = field(default_factory=list)  # (start, end) read, merged, sorted

    def mark(self, start: int, end: int) -> None:
        """Record that ``[start, end)`` was read: a part read twice (a record header that every
        part of a large record reads again) counts once."""
        merged: list[tuple[int, int]] = []
        for a, b in self.read:
            if b < start or a > end:
                merged.append((a, b))
            else:
                start, end = min(a, start), max(b, end)
        merged.append((start, end))
        merged.sort()
        self.read = merged
        self.consumed = sum(b - a for a, b in merged)

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class _Stream:
    """What the prefetcher knows of one object's reads."""

    extents: list[_Extent] = field(default_factory=list)  # by start, not overlapping
    last_end: int = -1  # end of the latest read
    streak: int = 0  # consecutive reads that moved forward
    scheduled_end: int = 0  # end of the furthest extent scheduled
    size: int | None = None  # the object's size, once a GET told it
    direct: bool = False  # its reader reads whole parts or more at once: nothing more is scheduled
    streak_start: int = 0  # where the current run of forward reads began
    covered: int = 0  # bytes those reads asked for (a byte read twice counts twice)


class Prefetcher:
    """Read-ahead extents of the objects of one storage, shared by its reader threads.

    Args:
        part: bytes per prefetch GET (one extent).
        window: bytes kept scheduled past the furthest sequential read of an object.
        submit: runs a fetch on the storage's pool; returns its future.
        min_streak: forward reads of an object before prefetching starts (random access never
            triggers it).
    """

    def __init__(
        self, part: int, window: int, submit: Callable[[Callable[[], ReadBuffer]], cf.Future[ReadBuffer]],
        min_streak: int = 2,
    ) -> None:
        self.part = part
        self.window = window
        self._submit = submit
        self.min_streak = min_streak
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        #: extents fetched / reads served from them, for tests and benchmarks
        self.stats = {"extents": 0, "hits": 0, "partial_hits": 0, "misses": 0, "dropped_bytes": 0, "stopped": 0}

    # -- sizes ---------------------------------------------------------------------------------
    def learn_size(self, key: str, size: int) -> None:
        """The object's size (from a GET's Content-Range): prefetch stops at its end."""
        with self._lock:
            self._streams.setdefault(key, _Stream()).size = size

    def held_bytes(self) -> int:
        """Bytes of extents scheduled or held, over all objects."""
        with self._lock:
            return sum(e.length for s in self._streams.values() for e in s.extents)

    # -- reads ---------------------------------------------------------------------------------
    def read(
        self, key: str, offset: int, length: int, fetch: Fetch, exact: Callable[[int, int], Buffer],
    ) -> Buffer | None:
        """``length`` bytes at ``offset`` from prefetched extents, or None when the first byte is
        not in one (the caller reads it itself). Also schedules prefetches: ``fetch(start, n)``
        fetches an extent (up to ``n`` bytes); ``exact(start, n)`` reads the part of a read that
        extends past the extents (exactly ``n`` bytes, or raises).

        Reads that move forward but skip most of the bytes they pass (the GPU reader reads a
        batch's record headers before their chunks) do not start it. A read of at least one part
        stops the prefetching of its object for good (extents already scheduled still serve
        reads; whoever reads, e.g. ``nvdcp verify``): such a reader (the GPU path, which reads a
        whole record's chunks into staging at once) keeps more GETs in flight by itself, split
        into the storage's read parts, than extents of one GET each would. On the H200 device
        (benchmarks/s3_read_knobs.py, docs/BENCHMARKS.md "S3 on the H200"), 400 MB of 64 MiB GPU tensors
        loaded in 0.70 s with prefetching and 16 MiB read parts, 0.58 s without prefetching and
        8 MiB parts (s3torchconnector: 0.60 s)."""
        self._note(key, offset, length, fetch)
        pieces = self._take(key, offset, length)
        if not pieces:
            with self._lock:
                self.stats["misses"] += 1
            return None
        views: list[memoryview] = []
        pos = offset
        for ext, at, n in pieces:
            data = self._result(key, ext)
            if data is None or len(data) < at + n:
                break
            views.append(memoryview(data)[at : at + n])
            pos += n
        if not views:
            with self._lock:
                self.stats["misses"] += 1
            return None
        if pos == offset + length and len(views) == 1:
            with self._lock:
                self.stats["hits"] += 1
            return views[0]
        out = read_buffer(length)
        at = 0
        for v in views:
            out[at : at + len(v)] = v
            at += len(v)
        if at < length:
            out[at:] = memoryview(exact(offset + at, length - at)).cast("B")
        with self._lock:
            self.stats["partial_hits"] += 1
        return out

    def _result(self, key: str, ext: _Extent) -> ReadBuffer | None:
        try:
            data = ext.future.result()
        except Exception:  # noqa: BLE001 - the caller's own request raises the real error
            self._drop(key, ext)
            return None
        if len(data) < ext.length:  # the object ends inside it
            self._drop(key, ext)
        return data

    def _take(self, key: str, offset: int, length: int) -> list[tuple[_Extent, int, int]]:
        """Extents covering ``[offset, offset+length)`` from its start on, consecutive; their
        use is counted now and fully used extents leave the table (their buffers live on in
        the views handed out)."""
        with self._lock:
            stream = self._streams.get(key)
            if stream is None:
                return []
            pieces: list[tuple[_Extent, int, int]] = []
            pos, end = offset, offset + length
            for ext in stream.extents:
                if ext.end <= pos:
                    continue
                if ext.start > pos or pos >= end:
                    break
                n = min(ext.end, end) - pos
                pieces.append((ext, pos - ext.start, n))
                pos += n
            for ext, at, n in pieces:
                ext.mark(at, at + n)
                if ext.consumed >= ext.length:
                    stream.extents.remove(ext)
            return pieces

    def _note(self, key: str, offset: int, length: int, fetch: Fetch) -> None:
        """Record a read; when reads of ``key`` move forward, schedule extents up to ``window``
        past it and drop the extents the reads have left behind."""
        end = offset + length
        with self._lock:
            stream = self._streams.setdefault(key, _Stream())
            forward = stream.last_end >= 0 and stream.last_end - self.window <= offset <= stream.last_end + self.window
            stream.streak = stream.streak + 1 if forward else 0
            stream.last_end = max(end, stream.last_end) if forward else end
            if not forward:
                stream.streak_start, stream.covered = offset, 0
            stream.covered += length
            # Extents wholly behind this read by more than a window will not be read.
            for ext in [e for e in stream.extents if e.end < offset - self.window]:
                self._discard(stream, ext)
            if length >= self.part and not stream.direct:
                stream.direct = True
                self.stats["stopped"] += 1
            if stream.direct or stream.streak + 1 < self.min_streak:
                return
            if 2 * stream.covered < stream.last_end - stream.streak_start:
                return  # forward, but skipping most bytes (record headers read ahead of their chunks)
            start = max(stream.scheduled_end, end)
            limit = stream.last_end + self.window
            if stream.size is not None:
                limit = min(limit, stream.size)
            new: list[_Extent] = []
            while start < limit:
                n = min(self.part, limit - start)
                if n < self.part and (stream.size is None or start + n < stream.size):
                    break  # schedule whole parts only, except the object's last
                ext = _Extent(start, n, cf.Future())
                stream.extents.append(ext)
                new.append(ext)
                start += n
            if new:
                stream.extents.sort(key=lambda e: e.start)
                stream.scheduled_end = start
                self.stats["extents"] += len(new)
        for ext in new:
            fut = self._submit(functools.partial(fetch, ext.start, ext.length))
            fut.add_done_callback(functools.partial(_chain, dst=ext.future))

    # -- dropping ------------------------------------------------------------------------------
    def _discard(self, stream: _Stream, ext: _Extent) -> None:
        stream.extents.remove(ext)
        self.stats["dropped_bytes"] += ext.length - ext.consumed

    def _drop(self, key: str, ext: _Extent) -> None:
        with self._lock:
            stream = self._streams.get(key)
            if stream is not None and ext in stream.extents:
                self._discard(stream, ext)

    def forget(self, key: str | None = None) -> None:
        """Drop the extents (and read history) of ``key``, or of every object."""
        with self._lock:
            if key is None:
                self._streams.clear()
            else:
                self._streams.pop(key, None)


def _chain(src: cf.Future[ReadBuffer], dst: cf.Future[ReadBuffer]) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


__all__ = ["Prefetcher"]

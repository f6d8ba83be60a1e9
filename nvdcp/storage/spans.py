"""``ChunkSpans``: an item's stored chunks as spans of a few host buffers.

Why not a list with one ``memoryview`` per chunk: the stager holds every record of a save until
the background save has written it, and at 64 KiB per chunk that is ~16,000 objects per GB of
state that Python's garbage collector tracks. They outlive several young collections, get
promoted to the oldest generation, and enough promotions trigger a full collection: a pause of
every thread of the process (the training loop's too) that grows with everything the process
holds (0.13 s for torch, DCP and nvdcp alone on the CPU machine; 0.129 s in the H200 training
loop of benchmarks/async_loop_bench.py). Spans keep two numpy arrays (untracked) per buffer;
local files write them with vectored system calls over iovec arrays built by numpy
(:meth:`~nvdcp.storage.base.WriteStream.write_spans`), other stores iterate them, making each
chunk's view only then, when it dies young.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np


class ChunkSpans(Sequence[memoryview]):
    """Chunks ``buffer[start : start + size]`` of a few buffers, in stored order.

    A read-only sequence of memoryviews (what :class:`~nvdcp.pipeline.cpu.EncodedItem` holds as
    ``chunks``); the views are made on access.
    """

    __slots__ = ("_count", "_parts")

    def __init__(self) -> None:
        self._parts: list[tuple[memoryview, np.ndarray, np.ndarray]] = []
        self._count = 0

    @classmethod
    def of(cls, buffer: memoryview, starts: np.ndarray, sizes: np.ndarray) -> ChunkSpans:
        """Chunks ``buffer[starts[i] : starts[i] + sizes[i]]``: ``starts`` and ``sizes`` int64
        arrays of one length, taken as they are (an encoder's own arrays; :meth:`add` checks)."""
        spans = cls.__new__(cls)
        spans._parts = [(buffer, starts, sizes)] if len(sizes) else []
        spans._count = len(sizes)
        return spans

    def add(self, buffer: memoryview, starts: np.ndarray, sizes: np.ndarray) -> None:
        """Append chunks ``buffer[starts[i] : starts[i] + sizes[i]]``."""
        if len(starts) != len(sizes):
            raise ValueError(f"{len(starts)} chunk starts for {len(sizes)} sizes")
        if len(sizes):
            self._parts.append((buffer, np.asarray(starts, dtype=np.int64), np.asarray(sizes, dtype=np.int64)))
            self._count += len(sizes)

    def extend(self, other: ChunkSpans) -> None:
        """Append ``other``'s chunks (sharing its buffers)."""
        self._parts.extend(other._parts)
        self._count += other._count

    def copied(self) -> ChunkSpans:
        """The same chunks in memory of their own (one ``bytes`` per buffer span), for chunks
        whose buffers are about to be reused."""
        out = ChunkSpans()
        for buffer, starts, sizes in self._parts:
            lo, hi = int(starts[0]), int(starts[-1] + sizes[-1])
            out.add(memoryview(bytes(buffer[lo:hi])), starts - lo, sizes)
        return out

    def parts(self) -> list[tuple[memoryview, np.ndarray, np.ndarray]]:
        """``(buffer, starts, sizes)`` per buffer, in order (for vectored writes)."""
        return list(self._parts)

    @property
    def sizes(self) -> np.ndarray:
        """Each chunk's size in bytes."""
        if not self._parts:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([sizes for _, _, sizes in self._parts])

    @property
    def nbytes(self) -> int:
        return int(sum(int(sizes.sum()) for _, _, sizes in self._parts))

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[memoryview]:
        for buffer, starts, sizes in self._parts:
            for start, size in zip(starts.tolist(), sizes.tolist()):
                yield buffer[start : start + size]

    @overload
    def __getitem__(self, index: int) -> memoryview: ...

    @overload
    def __getitem__(self, index: slice) -> list[memoryview]: ...

    def __getitem__(self, index: int | slice) -> memoryview | list[memoryview]:
        if isinstance(index, slice):
            return list(self)[index]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(f"chunk {index} of {self._count}")
        for buffer, starts, sizes in self._parts:
            if index < len(sizes):
                start = int(starts[index])
                return buffer[start : start + int(sizes[index])]
            index -= len(sizes)
        raise AssertionError("unreachable")

    def __repr__(self) -> str:
        return f"ChunkSpans({self._count} chunks, {self.nbytes} bytes in {len(self._parts)} spans)"


class Gather:
    """Byte ranges of a few buffers in write order: piece ``i`` is
    ``buffers[which[i]][starts[i] : starts[i] + sizes[i]]``.

    Many records at once (a GPU bucket's share of a file: each header, then its chunks), as four
    arrays: local files write them with vectored system calls over iovecs built by numpy
    (:meth:`~nvdcp.storage.base.WriteStream.write_gather`), no Python object per piece.
    """

    __slots__ = ("buffers", "sizes", "starts", "which")

    def __init__(self, buffers: list[memoryview], which: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> None:
        if not len(which) == len(starts) == len(sizes):
            raise ValueError(f"{len(which)} buffer indexes, {len(starts)} starts, {len(sizes)} sizes")
        self.buffers = buffers
        self.which = which
        self.starts = starts
        self.sizes = sizes

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self) -> Iterator[memoryview]:
        for w, start, size in zip(self.which.tolist(), self.starts.tolist(), self.sizes.tolist()):
            yield self.buffers[w][start : start + size]


__all__ = ["ChunkSpans", "Gather"]

"""``RecordBatch``: many whole records as arrays, from the GPU encoder to a data file.

A save of 20,000 small GPU tensors is bound by the Python its threads run per item, one GIL
between them (H200 timeline, benchmarks/phase_probe.py --timeline: the GPU busy 0.05 s of a
4.7 s save, the process's CPU time 1.06x its wall time). Two costs were per record: an
``ItemHeader`` and an ``EncodedItem`` built for every record of a bucket (30 us of the main
thread's CPU per item), and the file threads' append of each record (45 us of CPU per item).
A batch keeps a bucket's whole records as the arrays they are built from: one buffer of
headers, the chunks' places in the bucket's host buffer, each record's digest; a file writes a
range of it with one gather (:class:`~nvdcp.storage.spans.Gather`), and per-record objects
are made only where something needs them (:meth:`RecordBatch.items`).

The CPU batch encoder (:mod:`nvdcp.pipeline.cpu_batch`) lays a group's records out back to back
in one buffer, each header before its chunks: the same batch with ``headers`` and ``chunks``
that buffer and each header's size given (``header_sizes``), so the file threads write CPU
records as they write GPU ones (CPU machine, 20,000 small tensors: an append, a copy and a
``WriteResult`` per record had cost the file threads 47 us of CPU per record).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nvdcp.format.header_batch import HeaderFields, header_of
from nvdcp.pipeline.cpu import EncodedItem
from nvdcp.storage.spans import ChunkSpans, Gather


@dataclass(eq=False)
class RecordBatch:
    """Records ``lo..hi-1`` of a bucket's whole items (all arrays cover the bucket's records).

    Record ``i`` is header bytes ``headers[header_starts[i] : header_starts[i] + header_sizes[i]]``
    followed by chunks ``first_chunk[i] .. first_chunk[i + 1] - 1``, chunk ``j`` being
    ``chunks[chunk_starts[j] : chunk_starts[j] + table[j, 0]]`` (``table``: each chunk's stored
    bytes and CRC32C, as in the header). Headers packed back to back (the GPU encoder's) need no
    sizes: ``header_starts`` then has one more entry, and each header ends where the next starts.
    The chunks' memory may be borrowed (a pooled pinned buffer): write or copy them before the
    bucket goes back.
    """

    jobs: Sequence[Any]  # per record: what it encodes (``.key`` is the WriteItem)
    fields: Sequence[HeaderFields]  # per record: its header's fields besides the chunk table
    headers: np.ndarray  # uint8
    header_starts: np.ndarray  # int64, per record (one more when header_sizes is None)
    digests: np.ndarray  # uint32: each header's CRC32C (the record's digest)
    chunks: memoryview
    chunk_starts: np.ndarray  # int64, per chunk
    table: np.ndarray  # (chunks, 2) uint32: stored bytes, CRC32C
    first_chunk: np.ndarray  # int64, one more than records
    chunk_bytes: int
    lo: int = 0
    hi: int = -1
    header_sizes: np.ndarray | None = None  # int64, per record (None: headers packed)

    def __post_init__(self) -> None:
        if self.hi < 0:
            self.hi = len(self.jobs)
        if self.header_sizes is None:
            self.header_sizes = np.diff(self.header_starts)

    def __len__(self) -> int:
        return self.hi - self.lo

    def part(self, lo: int, hi: int) -> RecordBatch:
        """Records ``lo..hi-1`` of this batch (numbered from its start), sharing its arrays."""
        if not 0 <= lo <= hi <= len(self):
            raise ValueError(f"records {lo}..{hi} of a batch of {len(self)}")
        return RecordBatch(self.jobs, self.fields, self.headers, self.header_starts, self.digests, self.chunks,
                           self.chunk_starts, self.table, self.first_chunk, self.chunk_bytes,
                           self.lo + lo, self.lo + hi, self.header_sizes)

    @functools.cached_property
    def record_nbytes(self) -> np.ndarray:
        """Each record's size in bytes (header and stored chunks), int64."""
        lo, hi = self.lo, self.hi
        stored = np.zeros(len(self.table) + 1, dtype=np.int64)
        np.cumsum(self.table[:, 0], out=stored[1:])
        fc = self.first_chunk[lo : hi + 1]
        assert self.header_sizes is not None
        return self.header_sizes[lo:hi] + stored[fc[1:]] - stored[fc[:-1]]

    @property
    def nbytes(self) -> int:
        return int(self.record_nbytes.sum())

    @property
    def raw_nbytes(self) -> int:
        """The raw bytes of the items the records hold."""
        return sum(f.raw_nbytes for f in self.fields[self.lo : self.hi])

    def gather(self) -> Gather:
        """The records' bytes in write order: each header, then its chunks."""
        lo, hi = self.lo, self.hi
        fc = self.first_chunk[lo : hi + 1]
        c0, c1 = int(fc[0]), int(fc[-1])
        n = hi - lo
        total = n + c1 - c0
        at_header = fc[:-1] - c0 + np.arange(n, dtype=np.int64)  # each header, its chunks after it
        which = np.ones(total, dtype=np.int64)
        starts = np.empty(total, dtype=np.int64)
        sizes = np.empty(total, dtype=np.int64)
        which[at_header] = 0
        starts[at_header] = self.header_starts[lo:hi]
        assert self.header_sizes is not None
        sizes[at_header] = self.header_sizes[lo:hi]
        is_chunk = np.ones(total, dtype=bool)
        is_chunk[at_header] = False
        starts[is_chunk] = self.chunk_starts[c0:c1]
        sizes[is_chunk] = self.table[c0:c1, 0]
        return Gather([self.headers.data, self.chunks], which, starts, sizes)

    def items(self) -> list[tuple[Any, EncodedItem]]:
        """``(job, record)`` for each record, as :class:`EncodedItem` objects (whose chunks view
        the same memory)."""
        out = []
        view = self.headers.data
        assert self.header_sizes is not None
        starts, sizes, firsts = self.header_starts.tolist(), self.header_sizes.tolist(), self.first_chunk.tolist()
        for i in range(self.lo, self.hi):
            f = self.fields[i]
            at, end, c0, c1 = starts[i], starts[i] + sizes[i], firsts[i], firsts[i + 1]
            header = header_of(f, self.table[c0:c1], end - at, int(self.digests[i]))
            spans = ChunkSpans.of(self.chunks, self.chunk_starts[c0:c1], self.table[c0:c1, 0].astype(np.int64))
            out.append((self.jobs[i], EncodedItem(header, bytes(view[at:end]), spans)))
        return out


def split_by_load(batch: RecordBatch, loads: list[int], given: list[int] | None = None) -> list[tuple[int, RecordBatch]]:
    """``batch`` cut into consecutive parts for the files whose queued bytes are ``loads``:
    ``(file index, part)``, filling the least loaded files up to one common level (each file's
    load plus its part is about equal where it gets one), so a bucket costs one entry per file.

    Files equally loaded are taken in order of ``given`` (bytes given so far, fewest first), and
    each file taken gets at least one record: when the files keep up (nothing queued anywhere) a
    batch of fewer records than files goes to those given least so far, one record each."""
    n = len(batch)
    if n == 0:
        return []
    sizes = batch.record_nbytes
    total = float(sizes.sum())
    ties = given if given is not None else [0] * len(loads)
    order = sorted(range(len(loads)), key=lambda f: (loads[f], ties[f]))
    # the level L with sum(L - load) == total over the files below it
    below = len(order)
    for k in range(len(order)):
        level = (total + sum(loads[f] for f in order[: k + 1])) / (k + 1)
        if k + 1 == len(order) or level <= loads[order[k + 1]]:
            below = k + 1
            break
    files = order[: min(below, n)]
    m = len(files)
    level = (total + sum(loads[f] for f in files)) / m
    shares = np.maximum(0.0, level - np.asarray([loads[f] for f in files], dtype=np.float64))
    # the record that crosses a file's share goes to it when more than half is inside
    cuts = np.searchsorted(np.cumsum(sizes) - sizes / 2, np.cumsum(shares)[:-1], side="right")
    # at least one record each: cut i in [i + 1, n - m + 1 + i], strictly increasing
    at = np.arange(m - 1)
    cuts = np.maximum.accumulate(np.clip(cuts, at + 1, n - m + 1 + at) - at) + at
    bounds = [0, *cuts.tolist(), n]
    return [(f, batch.part(a, b)) for f, a, b in zip(files, bounds, bounds[1:])]


__all__ = ["RecordBatch", "split_by_load"]

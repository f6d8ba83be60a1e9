"""Bucket planning for the GPU encoder, as columns: jobs' numbers read once per save, block
ranges packed into buckets by cumulative sums and binary searches.

A bucket is a run of *segments*, each a range of one job's blocks placed in consecutive slots
(one slot per block and plane). A rank of a mixture-of-experts model saves 100,000 small tensors:
one Python object and a few statements per segment, in the plan and again in every per-bucket
table, made the encode thread the save's limit (H100, 100,000 tensors: the main thread waited
for it in 30% of its samples, cpu_pipeline_profile_2026-12-07_h100_session37_moe-save.json).
Here each segment is one entry of four numpy columns (:class:`Bucket`), each job one entry of
:class:`JobColumns`, and jobs that fit whole in a bucket's rest are placed many at a time
(:func:`plan_buckets`); only a job cut over buckets is placed one block range at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from nvdcp.gpu.nvcomp_codecs import typed_data_type

if TYPE_CHECKING:
    from nvdcp.gpu.encoder import GpuJob


class Segment(NamedTuple):
    """One range of a job's blocks in a bucket: blocks ``first_block`` on, ``n_blocks`` of them,
    in slots from ``first_slot`` (block-major, planes within)."""

    job: int
    first_block: int
    n_blocks: int
    first_slot: int


@dataclass(eq=False)
class JobColumns:
    """A save's jobs as columns (entry ``i``: job ``i``), read from the jobs once.

    Jobs of one *kind* share their layout, dtype and whether they have a base: what a block's
    GPU footprint and each plane's codec depend on."""

    elements: np.ndarray  # int64: bytes per plane (elements for byte planes)
    planes: np.ndarray  # int64
    nbytes: np.ndarray  # int64
    kind: np.ndarray  # int64: index into ``kind_jobs``
    has_base: np.ndarray  # bool: stored as a difference from a base
    plain: np.ndarray  # bool: no base and no bytes to keep
    kind_jobs: list[int]  # one job of each kind
    #: int32 ``(kinds, most planes)``: each plane's codec key (an index into ``keys``), -1: raw
    codec_keys: np.ndarray
    keys: list[tuple[str, str | None]]  # (codec name, nvCOMP data type), numbered by first use

    @classmethod
    def of(cls, jobs: Sequence[GpuJob]) -> JobColumns:
        """The columns of ``jobs``: one pass over them, a dictionary lookup per job for its kind."""
        n = len(jobs)
        kind_of: dict[tuple[object, ...], int] = {}
        kind_jobs: list[int] = []
        kinds = []
        for i, job in enumerate(jobs):
            # the layout's fields, not the layout: a dataclass's hash is Python code
            key = (job.layout.transform, job.layout.plane_codecs, job.dtype, job.delta is None)
            k = kind_of.get(key)
            if k is None:
                k = kind_of[key] = len(kind_jobs)
                kind_jobs.append(i)
            kinds.append(k)
        keys: dict[tuple[str, str | None], int] = {}
        rows = []
        for i in kind_jobs:
            job = jobs[i]
            rows.append([-1 if name == "none" else keys.setdefault((name, typed_data_type(name, job.dtype)), len(keys))
                         for name in job.layout.plane_codecs])
        codec_keys = np.full((len(rows), max(map(len, rows), default=1)), -1, dtype=np.int32)
        for r, row in enumerate(rows):
            codec_keys[r, : len(row)] = row
        kind = np.asarray(kinds, dtype=np.int64)
        kind_planes = np.asarray([len(row) for row in rows], dtype=np.int64)
        kind_base = np.asarray([jobs[i].delta is not None for i in kind_jobs], dtype=bool)
        return cls(
            elements=np.fromiter((job.elements for job in jobs), dtype=np.int64, count=n),
            planes=kind_planes[kind] if n else np.zeros(0, dtype=np.int64),
            nbytes=np.fromiter((job.nbytes for job in jobs), dtype=np.int64, count=n),
            kind=kind,
            has_base=kind_base[kind] if n else np.zeros(0, dtype=bool),
            plain=np.fromiter((job.delta is None and job.keep is None for job in jobs), dtype=bool, count=n),
            kind_jobs=kind_jobs,
            codec_keys=codec_keys,
            keys=sorted(keys, key=keys.__getitem__),
        )


@dataclass(eq=False)
class Bucket:
    """A bucket's segments as columns (entry ``s``: segment ``s``, in slot order), and the
    columns of the save's jobs that ``job`` indexes."""

    cols: JobColumns
    job: np.ndarray  # int64
    first_block: np.ndarray  # int64
    n_blocks: np.ndarray  # int64
    first_slot: np.ndarray  # int64
    slots: int  # rows of the bucket's slot array
    cost: int = 0  # GPU bytes its blocks need (the planner's budget)

    @classmethod
    def of(cls, cols: JobColumns, segments: Sequence[tuple[int, int, int, int]], slots: int | None = None,
           cost: int = 0) -> Bucket:
        """A bucket of ``segments`` (``(job, first block, blocks, first slot)`` each); ``slots``:
        by default, up to the end of the last."""
        job, first_block, n_blocks, first_slot = (np.asarray(column, dtype=np.int64).reshape(-1)
                                                  for column in zip(*segments)) if segments else (
            np.zeros(0, dtype=np.int64) for _ in range(4))
        if slots is None:
            slots = int((first_slot + n_blocks * cols.planes[job]).max(initial=0))
        return cls(cols, job, first_block, n_blocks, first_slot, slots, cost)

    def __len__(self) -> int:
        return len(self.job)

    def segment(self, s: int) -> Segment:
        return Segment(int(self.job[s]), int(self.first_block[s]), int(self.n_blocks[s]), int(self.first_slot[s]))

    @property
    def segments(self) -> list[Segment]:
        """Every segment as a tuple (error messages and tests; the hot paths use the columns)."""
        return [Segment(*row) for row in zip(self.job.tolist(), self.first_block.tolist(), self.n_blocks.tolist(),
                                             self.first_slot.tolist())]

    @cached_property
    def planes(self) -> np.ndarray:
        """Each segment's job's plane count."""
        return self.cols.planes[self.job]

    @cached_property
    def slot_counts(self) -> np.ndarray:
        """Slots of each segment."""
        return self.n_blocks * self.planes

    def whole(self, chunk_bytes: int) -> np.ndarray:
        """Whether each segment holds all of its job (an empty job's one segment does)."""
        return (self.first_block == 0) & (self.n_blocks * chunk_bytes >= self.cols.elements[self.job])

    def segment_of_slot(self, slot: int) -> int:
        """The segment holding ``slot``."""
        return max(0, int(np.searchsorted(self.first_slot, slot, side="right")) - 1)


def slot_ranges(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The slots ``first[i] .. first[i] + counts[i] - 1`` of every range, concatenated (int64)."""
    starts = np.cumsum(counts) - counts
    return np.repeat(first - starts, counts) + np.arange(int(counts.sum()), dtype=np.int64)


@dataclass(frozen=True)
class SlotLayout:
    """Where a bucket's slots lie in its arena (byte offsets from its start).

    The torch copies write a segment's slots as consecutive rows of a whole chunk: those slots
    come first, as rows in slot order. The plane kernel writes each slot by address
    (:class:`~nvdcp.gpu.encoder._KernelSplit`): the slots of the segments it splits follow,
    each its raw bytes rounded up to the compaction granule, so a 1 KiB tensor's four planes
    take 1 KiB of the arena instead of four 64 KiB rows. nvCOMP reads every slot at its offset
    and the compaction gathers uncompressed ones from there, whole granules at a time."""

    at: np.ndarray  # int64 per slot: its first byte
    row_of: np.ndarray  # int64 per slot: its row among the chunk-sized ones; -1: packed
    n_rows: int  # chunk-sized rows, first in the arena
    end: int  # bytes all slots take
    kernel: bool  # the plane kernel splits the segments it takes (their slots may be packed)

    def first_rows(self, bucket: Bucket) -> np.ndarray:
        """Each segment's first row (-1: its slots are packed); an empty segment after the
        last slot gets the row after the last."""
        return np.append(self.row_of, self.n_rows)[bucket.first_slot]

    @classmethod
    def rows(cls, n_slots: int, chunk_bytes: int, kernel: bool) -> SlotLayout:
        """Every slot a row of ``chunk_bytes``, in slot order."""
        row_of = np.arange(n_slots, dtype=np.int64)
        return cls(row_of * chunk_bytes, row_of, n_slots, n_slots * chunk_bytes, kernel)

    @classmethod
    def of(cls, bucket: Bucket, raw_sizes: np.ndarray, packed: np.ndarray | None, chunk_bytes: int,
           granule: int) -> SlotLayout:
        """The slots of ``bucket``'s segments where ``packed`` (bool per segment: those the
        kernel splits; None: the kernel does not run) packed at ``granule`` after the rows of
        all other slots; ``raw_sizes``: each slot's bytes."""
        if packed is None or not packed.any():
            return cls.rows(bucket.slots, chunk_bytes, kernel=packed is not None)
        dense = np.zeros(bucket.slots, dtype=bool)
        dense[slot_ranges(bucket.first_slot[packed], bucket.slot_counts[packed])] = True
        is_row = ~dense
        row_of = np.where(is_row, np.cumsum(is_row) - 1, -1)
        n_rows = bucket.slots - int(dense.sum())
        sizes = -(-raw_sizes[dense] // granule) * granule
        at = row_of * chunk_bytes
        at[dense] = n_rows * chunk_bytes + np.cumsum(sizes) - sizes
        return cls(at, row_of, n_rows, n_rows * chunk_bytes + int(sizes.sum()), kernel=True)


@dataclass(frozen=True)
class Charges:
    """What jobs charge against one of a bucket's bounds (the GPU scratch, the pinned buffer):
    ``whole[j]`` for job ``j`` held whole by one bucket, ``per_block[k]`` for each block of a job
    of kind ``k`` cut over buckets (never less than a block's share of ``whole``)."""

    whole: np.ndarray  # int64 per job
    per_block: np.ndarray  # int64 per kind
    limit: int  # a bucket's bound


class _Builder:
    """Buckets filled in order: pieces of segment columns per bucket, joined at the end."""

    def __init__(self, cols: JobColumns) -> None:
        self.cols = cols
        self.done: list[Bucket] = []
        self._pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # job, first block, blocks
        self.slots = 0
        self.used = [0, 0]  # charged against the GPU bound, the pinned bound

    @property
    def empty(self) -> bool:
        return not self._pieces

    def add(self, jobs: np.ndarray, first_blocks: np.ndarray, n_blocks: np.ndarray, slots: int, gpu: int,
            pinned: int) -> None:
        self._pieces.append((jobs, first_blocks, n_blocks))
        self.slots += slots
        self.used[0] += gpu
        self.used[1] += pinned

    def close(self) -> None:
        """End the current bucket (one with no segment is dropped)."""
        if self._pieces:
            job, first_block, n_blocks = (np.concatenate(column) for column in zip(*self._pieces))
            counts = n_blocks * self.cols.planes[job]
            first_slot = np.cumsum(counts) - counts  # segments back to back
            self.done.append(Bucket(self.cols, job, first_block, n_blocks, first_slot, self.slots, self.used[0]))
        self._pieces, self.slots, self.used = [], 0, [0, 0]


def plan_buckets(cols: JobColumns, chunk_bytes: int, gpu: Charges, pinned: Charges) -> list[Bucket]:
    """Pack every job's blocks, in order, into buckets within two bounds: the GPU scratch a
    bucket may use (``gpu``) and the pinned buffer it is copied out into (``pinned``).

    Greedy, job by job: a job that fits whole in the current bucket's rest goes there (found for
    a run of jobs at once by binary search over cumulative charges); one that does not but would
    fit an empty bucket starts a new one (its chunks then stay in one host buffer); a larger one
    fills the rest and continues in new buckets, charged by the block. A bucket holding one
    segment may exceed the bounds (a single block over them). Empty jobs get a segment of no blocks.
    """
    c = chunk_bytes
    n = len(cols.elements)
    blocks = -(-cols.elements // c)
    slots = blocks * cols.planes
    cum = [np.zeros(n + 1, dtype=np.int64) for _ in range(2)]
    for total, charges in zip(cum, (gpu, pinned)):
        np.cumsum(np.asarray(charges.whole, dtype=np.int64), out=total[1:])
    cum_slots = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(slots, out=cum_slots[1:])
    zeros = np.zeros(n, dtype=np.int64)
    limits = (gpu.limit, pinned.limit)
    out = _Builder(cols)
    j = 0
    while j < n:
        rooms = [limit - used for limit, used in zip(limits, out.used)]
        if min(rooms) >= 0:
            # jobs j..end-1 fit whole in the rest (the cumulative charges never decrease)
            end = min(int(np.searchsorted(total, total[j] + room, side="right")) for total, room in zip(cum, rooms)) - 1
            if end > j:
                out.add(np.arange(j, end, dtype=np.int64), zeros[j:end], blocks[j:end],
                        int(cum_slots[end] - cum_slots[j]), *(int(total[end] - total[j]) for total in cum))
                j = end
                continue
        if blocks[j] == 0:  # an empty job, after a bucket over its bounds: it joins that one
            out.add(np.array([j], dtype=np.int64), zeros[:1], zeros[:1], 0, 0, 0)
            j += 1
            continue
        k = int(cols.kind[j])
        _place_cut_job(out, j, int(blocks[j]), int(cols.planes[j]), limits,
                       (int(gpu.per_block[k]), int(pinned.per_block[k])), (int(gpu.whole[j]), int(pinned.whole[j])))
        j += 1
    out.close()
    return out.done


def _place_cut_job(out: _Builder, j: int, blocks: int, planes: int, limits: tuple[int, int],
                   per_block: tuple[int, int], whole: tuple[int, int]) -> None:
    """Place job ``j``, which does not fit whole in the current bucket's rest, one block range at
    a time (each charged ``per_block`` a block; ``whole`` if it lands whole in a new bucket)."""
    fits_empty = min(limit // charge for limit, charge in zip(limits, per_block))
    b = 0
    while b < blocks:
        room = min((limit - used) // charge for limit, used, charge in zip(limits, out.used, per_block))
        if not out.empty and (room <= 0 or (b == 0 and room < blocks <= fits_empty)):
            # a new bucket, also for a job that would fit whole in one but not in this one's rest
            out.close()
            continue
        take = min(blocks - b, max(room, 1))
        charged = whole if take == blocks else tuple(take * charge for charge in per_block)
        out.add(np.array([j], dtype=np.int64), np.array([b], dtype=np.int64), np.array([take], dtype=np.int64),
                take * planes, *charged)
        b += take

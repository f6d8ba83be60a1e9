"""GPU item encoder: byte planes with torch, chunks compressed by nvCOMP in batched calls.

Items are cut into block ranges and packed into *buckets* whose GPU footprint stays under the
configured budget. A bucket's chunks sit in fixed slots of one device *arena*; every codec gets
one batched nvCOMP call per bucket, however many tensors it holds, writing into its own region
of the arena. The stored chunks (compressed where that paid, raw otherwise) are then *compacted*
on the device by one row gather (:func:`compaction_plan`), checksummed there (CRC32C by a Triton
kernel, :mod:`nvdcp.gpu.crc32c`, when it runs here; else on the host after the copy), and only
stored bytes cross to the host, in one copy per host buffer run. Two CUDA streams alternate
between buckets, so bucket k+1 compresses while bucket k is compacted and copied.

Two ways out: :meth:`GpuEncoder.encode_buckets` (the writer) moves each bucket into a pooled
pinned buffer and yields its records; a producer thread drives the GPU, so later buckets are
compressed and copied out while the caller's file threads write the held ones, releasing each
bucket when its records are written (:meth:`GpuEncoder.encode`: the same, one record at a time). :meth:`GpuEncoder.stage` (the async stager) copies
every bucket into host memory the caller provides and returns as soon as the copies are done,
leaving headers (and host checksums, without the kernel) to :meth:`GpuEncoder.items`, which the
caller runs in the background.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import numpy as np
import torch

from nvdcp.codecs import codec_id
from nvdcp.format.crc import checksum_ranges
from nvdcp.format.header import TRANSFORM_BYTEPLANES, ChunkTable, ItemHeader
from nvdcp.format.header_batch import HeaderFields, header_layout, header_of, pack_headers_into
from nvdcp.gpu import crc32c
from nvdcp.gpu.bound import WORKSPACE_CODECS, SaveBound, fit_scratch
from nvdcp.gpu.merge import PLANE_COUNTS, merge_table, split_available, split_rows
from nvdcp.gpu.nvcomp_batch import WORKSPACES, BatchResult, NvcompCallError, side_streams_on
from nvdcp.gpu.nvcomp_codecs import CodecCache, typed_data_type
from nvdcp.gpu.pinned import PinnedPool
from nvdcp.gpu.plan import Bucket, Charges, JobColumns, Segment, SlotLayout, plan_buckets
from nvdcp.pipeline.cpu import EncodedItem, layout_codec_ids
from nvdcp.pipeline.delta import DeltaInput
from nvdcp.pipeline.policy import Layout
from nvdcp.pipeline.record_batch import RecordBatch
from nvdcp.pipeline.tensors import flat_bytes
from nvdcp.storage.spans import ChunkSpans
from nvdcp.transform import delta as delta_transform

#: Stored chunks start at multiples of this many bytes after compaction (device and host). The
#: gather index costs 8 bytes per granule; the padding averages half a granule per compressed chunk.
MAX_GRANULE = 256


def granule_for(chunk_bytes: int) -> int:
    """The compaction granule for a chunk size: the largest power of two <= 256 dividing it."""
    return min(MAX_GRANULE, chunk_bytes & -chunk_bytes)


def compaction_plan(src_offsets: np.ndarray, stored: np.ndarray, granule: int,
                    device: torch.device | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """Row gather that packs chunks into one buffer, each starting at a granule boundary.

    ``src_offsets[i]`` (a multiple of ``granule``) is where chunk ``i``'s ``stored[i]`` bytes
    start in the source viewed as rows of ``granule`` bytes. Returns ``(rows, offsets)``:
    gathering source rows ``rows`` (an int64 tensor on ``device``) in order gives the packed
    buffer, in which chunk ``i`` starts at byte ``offsets[i]`` (one more entry: the packed size).
    The per-row index is expanded on ``device`` from per-chunk numbers: building it on the host
    and copying it over cost more than the gather itself.
    """
    counts = -(-stored.astype(np.int64) // granule)
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    total = int(starts[-1])
    n = len(counts)
    # one upload for both columns: each torch call may wait for the GIL behind a busy thread
    both = torch.from_numpy(np.concatenate((src_offsets.astype(np.int64) // granule - starts[:-1], counts))).to(device)
    rows = torch.repeat_interleave(both[:n], both[n:], output_size=total)
    rows += torch.arange(total, dtype=torch.int64, device=device)
    return rows, starts * granule


def pack_chunks(arena: torch.Tensor, src_offsets: np.ndarray, stored: np.ndarray,
                granule: int) -> tuple[torch.Tensor, np.ndarray]:
    """Gather chunks of ``arena`` (flat uint8, any device) into one buffer on the same device.

    Chunk ``i`` is ``stored[i]`` bytes at ``src_offsets[i]``; see :func:`compaction_plan` for
    the layout of the result. One ``index_select`` over rows of 8-byte words (when the granule
    allows) does the whole bucket, whatever the number of chunks.
    """
    rows, offsets = compaction_plan(src_offsets, stored, granule, arena.device)
    word = torch.int64 if granule % 8 == 0 and arena.numel() % 8 == 0 else torch.uint8
    width = granule // word.itemsize
    packed = torch.empty(max(int(offsets[-1]), granule), dtype=torch.uint8, device=arena.device)
    if len(rows):
        torch.index_select(arena.view(word).view(-1, width), 0, rows,
                           out=packed.view(word).view(-1, width)[: len(rows)])
    return packed, offsets


class HostSink(Protocol):
    """Host memory for a bucket's packed chunks."""

    def place(self, sizes: np.ndarray) -> list[tuple[torch.Tensor, int, int]]:
        """Runs ``(buffer, lo, hi)``: pieces ``lo..hi-1`` of ``sizes`` back to back in ``buffer``
        (a uint8 tensor of exactly their total size); the runs cover every piece in order."""
        ...


@dataclass
class HostBucket:
    """A bucket's stored chunks in host memory, complete once ``done`` has happened."""

    bucket: Bucket
    stored: np.ndarray  # stored bytes of each slot
    offsets: np.ndarray  # where each slot's chunk starts in the packed bucket
    runs: list[tuple[torch.Tensor, int, int]]  # host buffers holding slots lo..hi-1
    done: torch.cuda.Event
    #: each slot's CRC32C computed on the device (int32 bits, host memory, valid after ``done``);
    #: None: computed on the host by :meth:`checksums`
    crcs: torch.Tensor | None = None

    def checksums(self) -> np.ndarray:
        """Each slot's CRC32C, uint32 (from the device, or one batched host call per host buffer run)."""
        if self.crcs is not None:
            return self.crcs.numpy().view(np.uint32)
        crcs = [np.zeros(0, dtype=np.uint32)]
        for host, lo, hi in self.runs:
            if hi > lo:
                starts = self.offsets[lo:hi] - self.offsets[lo]
                crcs.append(np.asarray(checksum_ranges(host.numpy(), starts, self.stored[lo:hi]), dtype=np.uint32))
        return np.concatenate(crcs)

    def views(self) -> list[memoryview]:
        """Each slot's stored bytes (host work: kept off the path that blocks training)."""
        return list(self.spans(0, len(self.stored)))

    def spans(self, lo: int, hi: int) -> ChunkSpans:
        """Slots ``lo..hi-1``'s stored bytes, as spans of the host buffers (no view per slot)."""
        spans = ChunkSpans()
        for host, run_lo, run_hi in self.runs:
            a, b = max(lo, run_lo), min(hi, run_hi)
            if a < b:
                buffer = host.numpy().data if host.numel() else memoryview(b"")
                spans.add(buffer, self.offsets[a:b] - self.offsets[run_lo], self.stored[a:b])
        return spans


#: Small tensors are split into planes in groups of at most this many bytes (the group's
#: concatenation and its transposed copy are the only GPU memory beyond the bucket's arena).
SMALL_SPLIT_BYTES = 16 << 20
#: Delta items are differenced and split in runs of at most this many bytes (:func:`split_run`).
DELTA_RUN_BYTES = 64 << 20


def split_small_tensors(sources: list[torch.Tensor], first_slots: list[int], p: int, m: int,
                        slots: torch.Tensor, blocks: int = 1) -> None:
    """Write tensors of ``blocks`` whole blocks each into their slots: ``sources[i]`` (flat
    uint8, ``blocks * m * p`` bytes: elements of ``p`` bytes, or bytes with ``p = 1``) puts byte
    ``j`` of every element of its block ``b`` (``m`` elements each) into the first ``m`` bytes of
    row ``first_slots[i] + b * p + j`` of ``slots`` (a ``(rows, chunk_bytes)`` uint8 tensor).
    What the per-segment copies of a segment holding the whole tensor write, with one
    concatenation, one transposed copy and one indexed write per group of
    ``SMALL_SPLIT_BYTES``, on the current stream."""
    per = max(1, SMALL_SPLIT_BYTES // (blocks * m * p))
    lanes = np.arange(blocks * p, dtype=np.int64)
    for lo in range(0, len(sources), per):
        group = sources[lo : lo + per]
        k = len(group)
        planes = torch.cat(group).view(k, blocks, m, p).permute(0, 1, 3, 2).reshape(k * blocks * p, m)
        rows = (np.asarray(first_slots[lo : lo + per], dtype=np.int64)[:, None] + lanes).reshape(-1)
        # non_blocking: pageable memory is staged at once, without waiting for the stream's work
        slots[torch.from_numpy(rows).to(slots.device, non_blocking=True), :m] = planes


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``host`` on ``device``, queued on the current stream (a copy also when the
    device is the CPU, as in the tests: ``.to`` would return the same memory)."""
    out = torch.empty(host.shape, dtype=host.dtype, device=device)
    out.copy_(host, non_blocking=True)
    return out


#: Segments of tensors up to this size, with nothing to difference or keep, are split by the
#: plane kernel (:class:`_KernelSplit`); larger ones by torch copies, whose host cost per tensor
#: is small next to their bytes.
KERNEL_SPLIT_MAX_BYTES = 4 << 20


def _kernel_splits(device: torch.device) -> bool:
    """Whether the plane kernel writes slots on ``device``: a CUDA device with Triton, or CPU
    tensors under ``TRITON_INTERPRET=1`` (tests); ``NVDCP_GPU_SPLIT=0`` turns it off."""
    if not split_available():
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _upload_table(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table`` on ``device``, queued on the current stream, from pinned memory (torch's
    pinned-memory cache keeps the buffer until the copy is done). A pageable ``.to()`` waited
    less for the GIL behind a busy thread (benchmarks/table_upload_probe.py), but in saves of
    20,000 small tensors the two did not differ (H100, 36th session: own time 0.970 s pinned,
    0.977 s pageable, medians of 2 rounds, code_ab_2026-12-07_h100_session36_encoder.json)."""
    return table.pin_memory().to(device, non_blocking=True)


class _KernelSplit:
    """A bucket's segments split into their slots by one plane-kernel launch per plane count
    (:func:`~nvdcp.gpu.merge.split_rows`): a table row per block holds the address of its first
    element, its element count and the address of each plane's slot, made in numpy from one
    address per tensor. Replaces a concatenation, a transposed copy and an indexed write per
    group of tensors of one shape, which needed a flat uint8 view of each tensor (made per
    item on the main thread) and an index upload per group."""

    def __init__(self, chunk_bytes: int) -> None:
        self.c = chunk_bytes
        #: per plane count: the bucket's segments it splits, and their tensors' addresses
        self.by_planes: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @staticmethod
    def takes(bucket: Bucket) -> np.ndarray:
        """Which of the bucket's segments it splits (:meth:`takes_jobs`)."""
        cols = bucket.cols
        return _KernelSplit.takes_jobs(cols.planes[bucket.job], cols.plain[bucket.job], cols.nbytes[bucket.job])

    @staticmethod
    def takes_jobs(planes: np.ndarray, plain: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Which jobs it splits, from their columns: tensors up to ``KERNEL_SPLIT_MAX_BYTES``
        with nothing to difference or keep (and a plane count it has)."""
        return plain & np.isin(planes, PLANE_COUNTS) & (nbytes > 0) & (nbytes <= KERNEL_SPLIT_MAX_BYTES)

    def add(self, jobs: list[GpuJob], bucket: Bucket, segments: np.ndarray) -> None:
        """Split ``segments`` (indices into the bucket's, each of a job it takes) too."""
        segments = segments[bucket.n_blocks[segments] > 0]
        planes = bucket.planes[segments]
        for p in np.unique(planes).tolist():
            mine = segments[planes == p]
            addr = np.fromiter((jobs[j].data.data_ptr() for j in bucket.job[mine].tolist()), dtype=np.int64,
                               count=len(mine))
            self.by_planes[p] = (mine, addr)

    def run(self, bucket: Bucket, arena: torch.Tensor, layout: SlotLayout) -> None:
        """Queue the splits on the current stream, into the slots where ``layout`` puts them in
        ``arena``: every plane count's table built in numpy, the tables sent to the GPU in one
        upload (each upload waits for the GIL several times behind a thread running Python,
        benchmarks/table_upload_probe.py, and a bucket of fp32 and bf16 tensors has two plane
        counts), then one launch per plane count on a view of it."""
        slot_addr = arena.data_ptr() + layout.at
        tables = [(p, *self._table(p, bucket, mine, addr, slot_addr))
                  for p, (mine, addr) in self.by_planes.items()]
        if not tables:
            return
        flat = torch.from_numpy(np.concatenate([t.reshape(-1) for _, t, _ in tables]))
        if arena.is_cuda:
            flat = _upload_table(flat, arena.device)
        at = 0
        for p, table, longest in tables:
            rows = table.shape[0]
            split_rows(flat[at : at + table.size].view(rows, 2 + p), p, longest)
            at += table.size

    def _table(self, p: int, bucket: Bucket, mine: np.ndarray, addr: np.ndarray,
               slot_addr: np.ndarray) -> tuple[np.ndarray, int]:
        """The kernel's table for segments ``mine`` of ``p`` planes (one row per block), whose
        tensors start at ``addr``, into slots at ``slot_addr``; and the largest element count
        of a row."""
        c = self.c
        m = bucket.cols.elements[bucket.job[mine]]
        first_block, n_blocks, first_slot = bucket.first_block[mine], bucket.n_blocks[mine], bucket.first_slot[mine]
        seg_of = np.repeat(np.arange(len(mine)), n_blocks)
        b = np.arange(len(seg_of), dtype=np.int64) - np.repeat(np.cumsum(n_blocks) - n_blocks, n_blocks)
        block = first_block[seg_of] + b
        counts = np.minimum(c, m[seg_of] - block * c)
        rows = first_slot[seg_of] + b * p
        table = merge_table(addr[seg_of] + block * (c * p), counts,
                            slot_addr[rows[:, None] + np.arange(p, dtype=np.int64)])
        return table, int(counts.max())


def split_run(run: list[tuple[GpuJob, int]], slots: torch.Tensor, chunk_bytes: int,
              keep_stream: torch.cuda.Stream | None = None) -> None:
    """Write a run of ``(job, first slot)`` into the slots, each job kept (its raw bytes copied
    to ``keep``, when set) and, with a base, stored as its difference from it: what the
    per-segment copies write, with one concatenation, one difference and one transposed copy
    (an indexed write when the slots are not consecutive) for the whole run, and one upload
    and one download per job, instead of seven or eight torch calls per job.

    A run (:meth:`GpuEncoder._runs`): jobs of one dtype and layout transform, each held whole by
    one segment of whole blocks, all with a base or all without (then each has a ``keep``). On
    the current stream; the copies of the kept bytes to the host on ``keep_stream`` when given,
    after the uploads, so that the differencing and compression do not wait for them (the
    caller synchronizes it before the host memory is read again)."""
    jobs = [job for job, _ in run]
    first = jobs[0]
    p, c = first.n_planes, chunk_bytes
    sizes = [job.nbytes for job in jobs]
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    new = first.flat if len(jobs) == 1 else torch.cat([job.flat for job in jobs])
    spans = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))
    out = None
    if first.delta is not None:
        out = torch.empty(new.numel(), dtype=torch.uint8, device=slots.device)
        bases = [job.delta.base for job in jobs if job.delta is not None]
        assert len(bases) == len(jobs) and all(b is not None for b in bases)
        copy_pairs([out[lo:hi] for lo, hi in spans], bases)  # type: ignore[arg-type]
    # after the uploads: a job's keep may be its base's memory
    kept = [(job.keep, new[lo:hi]) for job, (lo, hi) in zip(jobs, spans) if job.keep is not None]
    if kept and keep_stream is not None:
        keep_stream.wait_stream(torch.cuda.current_stream(slots.device))
        with torch.cuda.stream(keep_stream):
            copy_pairs([dst for dst, _ in kept], [src for _, src in kept])
        new.record_stream(keep_stream)  # the temporary outlives the copies that read it
    else:
        copy_pairs([dst for dst, _ in kept], [src for _, src in kept])
    if out is not None:
        kind, size = delta_transform.kind_for(first.dtype), first.dtype.itemsize
        delta_transform.difference_into_base_torch(new, out, kind, size)
        del new  # the concatenation's memory serves the next temporary (same stream)
        new = delta_transform.finish_in_place_torch(out, kind, size)
    blocks = [n // (p * c) for n in sizes]
    first_slots = [slot for _, slot in run]
    total = sum(blocks)
    if all(a + b * p == nxt for a, b, nxt in zip(first_slots, blocks, first_slots[1:])):  # consecutive
        slots[first_slots[0] : first_slots[0] + total * p].view(total, p, c).copy_(new.view(total, c, p).permute(0, 2, 1))
        return
    rows = np.concatenate([np.arange(a, a + b * p, dtype=np.int64) for a, b in zip(first_slots, blocks)])
    planes = new.view(total, c, p).permute(0, 2, 1).reshape(total * p, c)
    slots[torch.from_numpy(rows).to(slots.device, non_blocking=True)] = planes


def copy_pairs(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i], non_blocking=True)`` for every pair, on the current stream, with
    one copy per run of pairs whose destinations and sources each lie back to back in one
    allocation (a run's base bytes in the host cache, carved in order; their uploads): a copy
    between host and device releases the GIL and waits to get it back, which behind the file
    threads cost the encode thread most of a delta bucket's launch (H100, 160 bf16 tensors)."""
    i = 0
    while i < len(dsts):
        j = i + 1
        while j < len(dsts) and _follows(dsts[j - 1], dsts[j]) and _follows(srcs[j - 1], srcs[j]):
            j += 1
        if j - i == 1:
            dsts[i].copy_(srcs[i], non_blocking=True)
        else:
            n = sum(d.numel() for d in dsts[i:j])
            dsts[i].as_strided((n,), (1,)).copy_(srcs[i].as_strided((n,), (1,)), non_blocking=True)
        i = j


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether flat uint8 ``b`` starts where ``a`` ends, in the same allocation."""
    return (a.dtype == b.dtype == torch.uint8 and a.dim() == b.dim() == 1 and a.is_contiguous() and b.is_contiguous()
            and a.device == b.device and a.data_ptr() + a.numel() == b.data_ptr()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


@dataclass
class GpuJob:
    """One tensor to encode on its device."""

    key: Any
    #: the tensor whose elements are stored: contiguous, on the GPU, of any dtype (or already
    #: its flat uint8 view). The plane kernel reads it by address; torch copies use :attr:`flat`.
    #: No view per tensor is made up front: two torch calls per item were a third of the main
    #: thread's part of a GPU save of 20,000 small tensors (H100, py-spy, twenty-first session).
    data: torch.Tensor
    layout: Layout
    dtype: torch.dtype
    dtype_code: int
    shape: tuple[int, ...]
    kind: int = 0
    #: set: stored as the XOR with ``delta.base`` (host bytes, copied to the GPU per bucket)
    delta: DeltaInput | None = None
    #: host uint8 memory that receives the tensor's raw bytes (the next save's base)
    keep: torch.Tensor | None = None
    #: bytes of ``data``
    nbytes: int = field(init=False)
    #: byte planes of the layout (1 without a transform); a layout changed later keeps its count
    n_planes: int = field(init=False)
    #: bytes per plane: elements for byte planes, bytes without a transform
    elements: int = field(init=False)

    def __post_init__(self) -> None:
        # plain fields, not properties: the encode thread reads them for every segment, several
        # times (the two properties led a cProfile of its planning, 20,000 small tensors)
        self.nbytes = self.data.nbytes
        self.n_planes = len(self.layout.plane_codecs)
        self.elements = self.nbytes // self.n_planes

    def whole(self, layout: Layout) -> GpuJob:
        """This job stored whole with ``layout`` (its bytes already kept)."""
        return GpuJob(self.key, self.data, layout, self.dtype, self.dtype_code, self.shape, self.kind)

    @cached_property
    def flat(self) -> torch.Tensor:
        """``data``'s bytes as a flat uint8 view (made on first use)."""
        if not self.nbytes:
            return torch.empty(0, dtype=torch.uint8, device=self.data.device)
        return flat_bytes(self.data)


@dataclass
class _Group:
    """One codec's share of a bucket: its slots and its output region of the arena."""

    ids: np.ndarray  # slot ids
    base: int  # byte offset of its output slots in the arena
    cap: int  # output slot stride: nvCOMP's bound for one chunk, rounded up to the granule
    result: BatchResult | None = None  # nvCOMP's compressed sizes and statuses


@dataclass
class _Launched:
    bucket: Bucket
    stream: torch.cuda.Stream
    arena: torch.Tensor  # the bucket's slots, then each group's output slots
    slot_at: np.ndarray  # byte offset of each slot in the arena (:class:`~nvdcp.gpu.plan.SlotLayout`)
    raw_sizes: np.ndarray  # uncompressed bytes per slot
    groups: list[_Group]
    encoded: torch.cuda.Event | None = None  # recorded after the bucket's encode calls
    jobs: list[GpuJob] = field(default_factory=list)  # the save's jobs (the bucket's segments index them)


class _PooledSink:
    """One pinned buffer from the encoder's pool per bucket (the writer's path), at most
    ``depth`` buckets held at once: :meth:`place` waits for the consumer to release one.

    Buckets are numbered in the order they are placed (0, 1, ...); the consumer releases each
    by its number (:meth:`release_bucket`), in any order: writers of several files finish
    buckets out of order."""

    def __init__(self, pool: PinnedPool, depth: int = 2) -> None:
        self.pool = pool
        self.held: dict[int, torch.Tensor] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._room = threading.Semaphore(depth)
        self.closed = False

    def place(self, sizes: np.ndarray) -> list[tuple[torch.Tensor, int, int]]:
        total = int(sizes.sum())
        while not self._room.acquire(timeout=0.1):
            if self.closed:
                raise _Stopped
        buf = self.pool.acquire(max(total, 1))
        with self._lock:
            self.held[self._next] = buf
            self._next += 1
        return [(buf[:total], 0, len(sizes))]

    def release_bucket(self, seq: int) -> None:
        """The consumer is done with bucket ``seq`` (a second call does nothing)."""
        with self._lock:
            buf = self.held.pop(seq, None)
        if buf is not None:
            self.pool.release(buf)
            self._room.release()

    def release_oldest(self) -> None:
        """The consumer is done with the oldest held bucket."""
        with self._lock:
            oldest = min(self.held) if self.held else None
        if oldest is not None:
            self.release_bucket(oldest)

    def release(self, first: int | None = None) -> None:
        """Release every held bucket (``first``: only those numbered ``first`` or later)."""
        with self._lock:
            seqs = [k for k in self.held if first is None or k >= first]
            bufs = [self.held.pop(k) for k in seqs]
        for buf in bufs:
            self.pool.release(buf)
            self._room.release()


@dataclass
class EncodedBucket:
    """The records a bucket completed (:meth:`GpuEncoder.encode_buckets`). Their chunks view
    the bucket's pinned buffer (chunks of items that began in an earlier bucket are copies):
    call :meth:`release` once every record is written; the buffer then goes back to the pool."""

    #: each ``(job, record)``, or many records as one :class:`RecordBatch` (``batches``)
    records: list[tuple[GpuJob, EncodedItem] | RecordBatch]
    seq: int
    _sink: _PooledSink

    def release(self) -> None:
        self._sink.release_bucket(self.seq)


class _Stopped(Exception):
    """The consumer of :meth:`GpuEncoder.encode` went away: the producer stops."""


def _runnable(job: GpuJob, seg: Segment, chunk_bytes: int) -> bool:
    """Whether ``seg`` holds all of ``job`` in whole blocks and the job has a base or bytes to
    keep (:func:`split_run`)."""
    if job.delta is None and job.keep is None:  # first: the test that decides for most jobs
        return False
    m = job.elements
    return not (seg.first_block != 0 or m == 0 or m % chunk_bytes or seg.n_blocks * chunk_bytes != m)


class GpuEncoder:
    """Encodes CUDA tensors into container records (one encoder per device and writer thread)."""

    def __init__(self, device: torch.device, *, chunk_bytes: int, budget_bytes: int,
                 gdeflate_type: int, pinned_bytes: int = 512 << 20, pinned: PinnedPool | None = None,
                 bound: SaveBound | None = None) -> None:
        """``budget_bytes``: the scratch of each encode, nvCOMP's workspaces beside it; or, with
        ``bound`` (a user's ``gpu_memory_bytes``), the scratch comes out of the bound once the
        workspaces of each encode's codecs are set aside (:func:`~nvdcp.gpu.bound.fit_scratch`)."""
        self.device = device
        self.bound = bound
        #: Pinned buffers of :meth:`encode` (one bucket at a time); shared with the owner's other encoders.
        self.pinned = pinned if pinned is not None else PinnedPool(pinned_bytes)
        self.pinned_bytes = pinned_bytes
        self.chunk_bytes = chunk_bytes
        self.granule = granule_for(chunk_bytes)
        # Two buckets are in flight at once (one compressing, one being compacted and copied out).
        self.bucket_budget = max(budget_bytes // 2, 64 * chunk_bytes)
        # The writer holds ``depth`` buckets in pinned buffers of the pool at once (2: one being
        # written, one being copied out); a bucket's slots fit in its share of the pinned budget.
        self.max_slots = self.max_slots_for(2)
        self.gdeflate_type = gdeflate_type
        self.streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        #: a bucket's codec groups after its first, each on its own stream (:meth:`_compress_groups`)
        self._side_streams: dict[tuple[int, int], torch.cuda.Stream] = {}
        #: copies of kept bytes to the host cache (delta policies), off the compression's streams
        self.keep_stream = torch.cuda.Stream(device)
        self.codecs = CodecCache(chunk_bytes, gdeflate_type)
        #: chunk checksums on the device (the Triton kernel) rather than on the host after the copy
        self.device_crc = crc32c.device_crc_available()
        #: small tensors split into planes by the plane kernel, into slots packed at the granule
        self.kernel_splits = _kernel_splits(device)

    # -- planning ------------------------------------------------------------------------------
    def max_slots_for(self, depth: int) -> int:
        """Slots of a bucket when ``depth`` buckets share the pinned budget."""
        return max(16 * 16, self.pinned_bytes // max(2, depth) // self.chunk_bytes)

    def output_slot_bytes(self, name: str, data_type: str | None) -> int:
        """An nvCOMP output slot of codec ``name`` in a bucket's arena: the library's bound for
        one chunk, rounded up to the granule. GDeflate's is just over two 64 KiB chunks; at 1
        KiB chunks ANS's is 3.5 chunks and Bitcomp's 8 (nvCOMP 6)."""
        cap = self.codecs.get(name, data_type).max_output
        return -(-cap // self.granule) * self.granule

    def _block_cost(self, job: GpuJob) -> int:
        c = self.chunk_bytes
        # per plane: its slot, its packed copy and the gather index (8 bytes per granule);
        # per compressed plane: nvCOMP's output slot; a delta: the base's bytes on the device
        # and the XOR
        outputs = sum(self.output_slot_bytes(name, typed_data_type(name, job.dtype))
                      for name in job.layout.plane_codecs if name != "none")
        delta = 2 * job.n_planes * c if job.delta is not None else 0
        return job.n_planes * (2 * c + 8 * c // self.granule) + outputs + delta

    def _bucket_budget(self, jobs: list[GpuJob], depth: int) -> int:
        """A bucket's share of the scratch (two are in flight), within the user's bound if any
        (which may give auto-chosen Zstd planes GDeflate: :func:`~nvdcp.gpu.bound.fit_scratch`)."""
        if self.bound is None:
            return self.bucket_budget
        scratch = fit_scratch(jobs, self.bound, self.codecs, self.max_slots_for(depth))
        return max(scratch // 2, 64 * self.chunk_bytes)

    def _plan(self, jobs: list[GpuJob], depth: int = 2) -> list[Bucket]:
        """Pack block ranges of the jobs, in order, into buckets under the budget and under the
        pinned budget's share of each of ``depth`` buckets held at once
        (:func:`~nvdcp.gpu.plan.plan_buckets`; the charges: :meth:`_charges`)."""
        budget = self._bucket_budget(jobs, depth)  # first: under a bound it may change layouts
        cols = JobColumns.of(jobs)
        return plan_buckets(cols, self.chunk_bytes, *self._charges(jobs, cols, budget, depth))

    def _charges(self, jobs: list[GpuJob], cols: JobColumns, budget: int, depth: int) -> tuple[Charges, Charges]:
        """What each job charges against a bucket's GPU budget and its pinned share.

        GPU: a full block costs :meth:`_block_cost`. A job's last block is counted by its bytes
        where they, not the chunk size, set the memory: its packed copy, gather index and a
        delta's temporaries hold the block's bytes rounded up to the granule, and so do its
        slots when the plane kernel splits the job (packed: :class:`~nvdcp.gpu.plan.SlotLayout`);
        nvCOMP's output slots stay whole (:meth:`output_slot_bytes`). A 1 KiB fp32 tensor then
        costs 130 KiB of a bucket (385 KiB with its slots whole, 648 KiB as a full block; 64 KiB
        chunks, GDeflate).

        Pinned: a bucket's stored chunks, each at most its raw bytes rounded up to the granule, so
        a small tensor charges its bytes, not a chunk per plane: 100,000 small tensors at the
        writer's four buckets held at once took 171 buckets of 2,048 slots each, at about 7 ms of
        own time a bucket (H100, ``bucket_budget_probe_2026-12-07_h100_session38.json``). Where a
        codec's workspace grows with the chunks of a call (Zstd's, sized by
        :func:`~nvdcp.gpu.bound.workspace_bytes` for a bucket's slot bound), every slot charges a
        whole chunk, so no bucket holds more chunks than that."""
        c, g = self.chunk_bytes, self.granule
        kind_block_cost = np.asarray([self._block_cost(jobs[i]) for i in cols.kind_jobs], dtype=np.int64)
        blocks = -(-cols.elements // c)
        tail = cols.elements - (blocks - 1) * c  # bytes of each plane's last block (blocks > 0)
        unused = np.where(blocks > 0, c - -(-tail // g) * g, 0)  # of that block's chunk, per plane
        # per unused byte: the packed copy, a delta's base and XOR, the slot of a job the kernel
        # splits (packed at the granule: SlotLayout); per unused granule: 8 index bytes
        packed = (_KernelSplit.takes_jobs(cols.planes, cols.plain, cols.nbytes) if self.kernel_splits
                  else np.zeros(len(blocks), dtype=bool))
        saved = unused * (1 + 2 * cols.has_base + packed) + unused // g * 8
        gpu = Charges(blocks * kind_block_cost[cols.kind] - cols.planes * saved, kind_block_cost, budget)
        per_chunk_workspace = any(name in WORKSPACE_CODECS for name, _ in cols.keys)
        pinned_whole = cols.planes * (blocks * c - (0 if per_chunk_workspace else unused))
        pinned = Charges(pinned_whole, cols.planes[cols.kind_jobs] * c, self.max_slots_for(depth) * c)
        return gpu, pinned

    # -- device work ---------------------------------------------------------------------------
    def _slot_table(self, bucket: Bucket) -> tuple[np.ndarray, np.ndarray, list[tuple[str, str | None]]]:
        """Per slot: uncompressed bytes and codec group (-1: stored raw); and the group keys,
        numbered in order of first use by the bucket's segments (an empty job's too). All numpy
        over the bucket's columns: a bucket of small tensors has a thousand segments."""
        c = self.chunk_bytes
        cols = bucket.cols
        raw_sizes = np.empty(bucket.slots, dtype=np.int64)
        slot_key = np.full(bucket.slots, -1, dtype=np.int32)
        if not len(bucket):
            return raw_sizes, slot_key, []
        counts = bucket.slot_counts
        seg_of = np.repeat(np.arange(len(counts)), counts)
        at = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        planes = bucket.planes[seg_of]
        slot = bucket.first_slot[seg_of] + at
        block = bucket.first_block[seg_of] + at // planes
        raw_sizes[slot] = np.minimum(c, cols.elements[bucket.job][seg_of] - block * c)  # a short last block
        # the save's codec keys, renumbered in the order the bucket's kinds first use them
        seg_kind = cols.kind[bucket.job]
        kinds, first = np.unique(seg_kind, return_index=True)
        local: dict[int, int] = {}
        for k in kinds[np.argsort(first)].tolist():
            for key in cols.codec_keys[k].tolist():
                if key >= 0:
                    local.setdefault(key, len(local))
        renumber = np.full(len(cols.keys) + 1, -1, dtype=np.int32)  # the last entry: raw planes (-1)
        renumber[list(local)] = list(local.values())
        slot_key[slot] = renumber[cols.codec_keys[seg_kind[seg_of], at % planes]]
        return raw_sizes, slot_key, [cols.keys[key] for key in local]

    def _split_planes(self, jobs: list[GpuJob], bucket: Bucket, arena: torch.Tensor, layout: SlotLayout) -> None:
        """Copy each segment's blocks into its slots, one plane per slot (reads the tensors), at
        their places in ``arena`` (flat uint8): rows of a chunk for the torch copies below,
        packed slots for the kernel's segments (:class:`~nvdcp.gpu.plan.SlotLayout`).

        Where the plane kernel runs, segments of tensors up to ``KERNEL_SPLIT_MAX_BYTES`` with
        nothing to difference or keep are split by it (:class:`_KernelSplit`), read by address.
        Without it, tensors of one block or of whole blocks, held by one segment, with nothing to
        difference or keep, go in groups of one shape (:func:`split_small_tensors`): a few copies per group
        instead of two or three torch calls per tensor, which took most of the encode thread's
        time for 20,000 small tensors (for those of several blocks still 56% of its stack samples,
        cpu_pipeline_profile_2026-12-01_h200_session7_small-save_cuda.json). Such tensors with a
        base or bytes to keep go in runs (:func:`split_run`): a delta save's encode thread spent
        most of its time in the seven or eight torch calls each of them made
        (delta_bench_2026-12-01_h200_decay_session8.json, profiles)."""
        c = self.chunk_bytes
        small: dict[tuple[int, int, int], tuple[list[torch.Tensor], list[int]]] = {}
        kernel = _KernelSplit(c) if layout.kernel else None
        slots = arena[: layout.n_rows * c].view(layout.n_rows, c)
        row = layout.first_rows(bucket)
        for run in self._runs(jobs, bucket, row):
            split_run(run, slots, c, self.keep_stream)
        rest = np.arange(len(bucket))
        if kernel is not None:  # (a job with a base or a keep never is the kernel's)
            takes = kernel.takes(bucket)
            kernel.add(jobs, bucket, np.flatnonzero(takes))
            rest = np.flatnonzero(~takes)
        for s in rest.tolist():
            seg = bucket.segment(s)._replace(first_slot=int(row[s]))  # its rows, from here on
            job = jobs[seg.job]
            p, m = job.n_planes, job.elements
            if _runnable(job, seg, c):
                continue  # written by its run
            whole = seg.first_block == 0 and seg.n_blocks * c >= m  # the segment holds all of it
            if whole and 0 < m and (m <= c or m % c == 0) and job.delta is None and job.keep is None:
                # one block, or whole blocks only (no tail): grouped with tensors of its shape
                sources, first_slots = small.setdefault((p, min(m, c), max(1, m // c)), ([], []))
                sources.append(job.flat)
                first_slots.append(seg.first_slot)
                continue
            start = seg.first_block * c
            m = min(job.elements, (seg.first_block + seg.n_blocks) * c) - start
            full, tail = divmod(m, c)
            src = job.flat[start * p : (start + m) * p]
            base = None
            if job.delta is not None and job.delta.base is not None:
                # the base's bytes reach the GPU before the same host memory receives the new ones
                base = _upload(job.delta.base[start * p : (start + m) * p], src.device)
            if job.keep is not None:
                job.keep[start * p : (start + m) * p].copy_(src, non_blocking=True)
            if base is not None:
                src = delta_transform.encode_into_base_torch(src, base, delta_transform.kind_for(job.dtype), job.dtype.itemsize)
            region = slots[seg.first_slot : seg.first_slot + seg.n_blocks * p]
            if job.layout.transform == TRANSFORM_BYTEPLANES:
                if full:
                    region[: full * p].view(full, p, c).copy_(src[: full * c * p].view(full, c, p).permute(0, 2, 1))
                if tail:
                    region[full * p : (full + 1) * p, :tail].copy_(src[full * c * p :].view(tail, p).t())
            else:
                if full:
                    region[:full].copy_(src[: full * c].view(full, c))
                if tail:
                    region[full, :tail].copy_(src[full * c :])
        for (p, m, blocks), (sources, first_slots) in small.items():
            split_small_tensors(sources, first_slots, p, m, slots, blocks)
        if kernel is not None:
            kernel.run(bucket, arena, layout)

    def _runs(self, jobs: list[GpuJob], bucket: Bucket, row: np.ndarray) -> Iterator[list[tuple[GpuJob, int]]]:
        """The bucket's runs for :func:`split_run`: its runnable jobs (:func:`_runnable`) grouped
        by dtype, transform and whether they have a base, each with its first row (``row``:
        per segment), in bucket order. The concatenation is a temporary: runs with a base hold at most
        ``DELTA_RUN_BYTES`` (the bucket's budget counts two temporaries per delta block), the
        others ``SMALL_SPLIT_BYTES``."""
        c = self.chunk_bytes
        runs: dict[tuple[torch.dtype, int, bool], list[tuple[GpuJob, int]]] = {}
        sizes: dict[tuple[torch.dtype, int, bool], int] = {}
        for s in np.flatnonzero(~bucket.cols.plain[bucket.job]).tolist():  # the others never run
            seg = bucket.segment(s)
            job = jobs[seg.job]
            if not _runnable(job, seg, c):
                continue
            key = (job.dtype, job.layout.transform, job.delta is not None)
            cap = DELTA_RUN_BYTES if job.delta is not None else SMALL_SPLIT_BYTES
            run = runs.setdefault(key, [])
            if run and sizes[key] + job.nbytes > cap:
                yield run
                run = runs[key] = []
            if not run:
                sizes[key] = 0
            run.append((job, int(row[s])))
            sizes[key] += job.nbytes
        yield from (run for run in runs.values() if run)

    def _launch(self, jobs: list[GpuJob], bucket: Bucket, parity: int) -> _Launched:
        stream = self.streams[parity]
        c, g = self.chunk_bytes, self.granule
        raw_sizes, slot_key, keys = self._slot_table(bucket)
        layout = SlotLayout.of(bucket, raw_sizes, _KernelSplit.takes(bucket) if self.kernel_splits else None, c, g)
        groups, end = [], layout.end
        for kid, (name, data_type) in enumerate(keys):
            ids = np.flatnonzero(slot_key == kid)
            base = -(-end // MAX_GRANULE) * MAX_GRANULE  # nvCOMP's outputs start aligned, whatever c is
            groups.append(_Group(ids, base, self.output_slot_bytes(name, data_type)))
            end = base + len(ids) * groups[-1].cap
        with torch.cuda.stream(stream):
            arena = torch.empty(max(end, g), dtype=torch.uint8, device=self.device)
            # nvCOMP's GDeflate leaves some bytes of its output unwritten (measured on the H200:
            # 136 bytes of a 256x256 fp32 record followed what the buffer held before): zeroed
            # output slots keep records byte-reproducible and no stale device memory in a file.
            arena[layout.end :].zero_()
            self._split_planes(jobs, bucket, arena, layout)
            self._compress_groups(arena, layout.at, raw_sizes, groups, keys, parity)
            encoded = torch.cuda.Event()
            encoded.record(stream)
        return _Launched(bucket, stream, arena, layout.at, raw_sizes, groups, encoded, jobs)

    def _compress_groups(self, arena: torch.Tensor, slot_at: np.ndarray, raw_sizes: np.ndarray,
                         groups: list[_Group], keys: list[tuple[str, str | None]], parity: int) -> None:
        """Queue one nvCOMP call per codec group, the first on the bucket's stream and each
        other on a side stream of its own, after the split and before what the bucket's stream
        queues next. A delta's sparse top planes go to Zstd, whose call takes milliseconds
        whatever it carries while leaving most of the GPU idle: GDeflate's call on the other
        planes runs beside it (GDeflate asks for no workspace, so it never waits for Zstd's).
        The arena needs no ``record_stream``: the bucket's stream joins every side stream
        before anything frees it."""
        stream = self.streams[parity]
        split = torch.cuda.Event()
        split.record(stream)
        sides: list[torch.cuda.Stream] = []
        apart = side_streams_on()
        try:
            for i, (grp, (name, data_type)) in enumerate(zip(groups, keys)):
                on = stream
                if i and apart:
                    on = self._side_stream(parity, i)
                    on.wait_event(split)
                    sides.append(on)
                out_offsets = grp.base + np.arange(len(grp.ids), dtype=np.int64) * grp.cap
                grp.result = self.codecs.get(name, data_type).compress(
                    arena, slot_at[grp.ids], raw_sizes[grp.ids], arena, out_offsets, on)
        finally:  # also when a call was refused: nothing frees the arena under a side stream's work
            for side in sides:
                stream.wait_stream(side)

    def _side_stream(self, parity: int, group: int) -> torch.cuda.Stream:
        key = (parity, group)
        side = self._side_streams.get(key)
        if side is None:
            side = self._side_streams[key] = torch.cuda.Stream(self.device)
        return side

    def _to_host(self, launched: _Launched, sink: HostSink) -> HostBucket:
        """Pack the bucket's stored chunks on the device and queue their copy into ``sink``'s memory."""
        g = self.granule
        stored = launched.raw_sizes.copy()
        src_offsets = launched.slot_at.copy()
        if launched.encoded is not None and launched.groups:
            launched.encoded.synchronize()  # the sizes' copies came before it on the stream
        for grp in launched.groups:
            result = grp.result
            assert result is not None
            sizes = result.sizes()
            failed = result.failed()
            if len(failed):
                owner = _slot_owner(launched.jobs, launched.bucket, int(grp.ids[failed[0]]))
                raise NvcompCallError(f"{owner}: nvCOMP could not compress it ({len(failed)} chunks of its bucket "
                                      f"failed): {result.status_text(int(failed[0]))}")
            used = sizes < launched.raw_sizes[grp.ids]  # compression paid: keep it
            stored[grp.ids[used]] = sizes[used]
            src_offsets[grp.ids[used]] = grp.base + np.flatnonzero(used) * grp.cap
        with torch.cuda.stream(launched.stream):
            packed, offsets = pack_chunks(launched.arena, src_offsets, stored, g)
            host_crcs = None
            if self.device_crc and len(stored):
                crcs, _ = crc32c.checksum_ranges_device(packed, offsets[:-1], stored)
                host_crcs = torch.empty(len(stored), dtype=torch.int32, pin_memory=True)
                host_crcs.copy_(crcs, non_blocking=True)
            runs = sink.place(np.diff(offsets))
            for host, lo, hi in runs:
                host.copy_(packed[int(offsets[lo]) : int(offsets[hi])], non_blocking=True)
            done = torch.cuda.Event()
            done.record(launched.stream)
        return HostBucket(launched.bucket, stored, offsets, runs, done, host_crcs)

    def _buckets(self, jobs: list[GpuJob], ready: torch.cuda.Event | None, sink: HostSink,
                 depth: int = 2) -> Iterator[HostBucket]:
        if ready is not None:
            for s in self.streams:
                s.wait_event(ready)
        prev: _Launched | None = None
        with WORKSPACES.held():
            for k, bucket in enumerate(self._plan(jobs, depth)):
                cur = self._launch(jobs, bucket, k % 2)
                if prev is not None:
                    yield self._to_host(prev, sink)
                prev = cur
            if prev is not None:
                yield self._to_host(prev, sink)

    # -- host work -----------------------------------------------------------------------------
    def _bucket_items(self, jobs: list[GpuJob], hb: HostBucket,
                      partial: dict[int, tuple[ChunkSpans, list[np.ndarray]]],
                      copy_partial: bool, batches: bool = False) -> Iterator[tuple[GpuJob, EncodedItem] | RecordBatch]:
        """The bucket's completed records, in segment order: those of jobs held whole by one
        segment built together (:meth:`_whole_records`), a job cut over buckets once its last
        segment is here. ``batches``: the whole records of jobs without a base come first, as
        one :class:`RecordBatch` (when they lie in one host buffer), the others after them."""
        c = self.chunk_bytes
        crcs = hb.checksums()
        bucket = hb.bucket
        whole = bucket.whole(c)
        # with ``batches``: whole, and no base (the common case: no Python per segment)
        batched = whole & ~bucket.cols.has_base[bucket.job] if batches else np.zeros(len(bucket), dtype=bool)
        whole_segments: list[int] = []
        done: list[tuple[GpuJob, EncodedItem] | None] = []  # None: the next of the whole records
        for s in np.flatnonzero(~batched).tolist():
            if whole[s]:
                whole_segments.append(s)
                done.append(None)
                continue
            seg = bucket.segment(s)
            job = jobs[seg.job]
            lo = seg.first_slot
            hi = lo + seg.n_blocks * job.n_planes
            # Spans buckets; with copy_partial its bytes must outlive this bucket's buffer.
            spans = hb.spans(lo, hi)
            held = partial.setdefault(seg.job, (ChunkSpans(), []))
            held[0].extend(spans.copied() if copy_partial else spans)
            held[1].append(crcs[lo:hi].copy())
            if (seg.first_block + seg.n_blocks) * c < job.elements:
                continue
            spans, parts = partial.pop(seg.job)
            done.append((job, self._item(job, spans, np.concatenate(parts))))
        yield from self._whole_records(jobs, hb, np.flatnonzero(batched), crcs, batch=True)
        records = iter(self._whole_records(jobs, hb, np.asarray(whole_segments, dtype=np.int64), crcs))
        for record in done:
            yield record if record is not None else next(records)  # type: ignore[misc]

    def _whole_records(self, jobs: list[GpuJob], hb: HostBucket, segments: np.ndarray, crcs: np.ndarray,
                       batch: bool = False) -> list[tuple[GpuJob, EncodedItem]] | list[RecordBatch]:
        """Records of jobs each held whole by one of ``segments`` (indices into the bucket's):
        headers packed and checksummed together (:mod:`nvdcp.format.header_batch`), each
        record's chunks spans of the host buffer run holding its slots, made from the bucket's
        arrays. ``batch``: as one :class:`RecordBatch` when every record lies in one host buffer run."""
        if not len(segments):
            return []
        c = self.chunk_bytes
        bucket = hb.bucket
        owners = [jobs[j] for j in bucket.job[segments].tolist()]
        lo = bucket.first_slot[segments]
        n = bucket.slot_counts[segments]
        first_chunk = np.zeros(len(segments) + 1, dtype=np.int64)
        np.cumsum(n, out=first_chunk[1:])
        slots = np.repeat(lo - first_chunk[:-1], n) + np.arange(int(first_chunk[-1]), dtype=np.int64)
        table = np.empty((len(slots), 2), dtype=np.uint32)
        table[:, 0] = hb.stored[slots]
        table[:, 1] = crcs[slots]
        fields = [_fields(job, c) for job in owners]
        table_at, sizes = header_layout(fields, n)
        starts = np.zeros(len(segments) + 1, dtype=np.int64)
        np.cumsum(sizes, out=starts[1:])
        headers = np.empty(int(starts[-1]), dtype=np.uint8)
        header_crcs = pack_headers_into(headers, starts[:-1], fields, table_at, sizes, table, first_chunk)
        run = _run_holding(hb, int(lo.min()), int((lo + n).max()))
        if run is not None:
            host, run_lo, _ = hb.runs[run]
            buffer = host.numpy().data if host.numel() else memoryview(b"")
            records = RecordBatch(owners, fields, headers, starts, header_crcs, buffer,
                                  hb.offsets[slots].astype(np.int64) - int(hb.offsets[run_lo]), table, first_chunk, c)
            return [records] if batch else records.items()
        hview = headers.data
        chunk_spans = _chunk_spans(hb, lo, lo + n)
        out = []
        for job, f, at, size, c0, c1, crc, chunks in zip(
            owners, fields, starts.tolist(), sizes.tolist(), first_chunk[:-1].tolist(), first_chunk[1:].tolist(),
            header_crcs.tolist(), chunk_spans,
        ):
            out.append((job, EncodedItem(header_of(f, table[c0:c1], size, crc), bytes(hview[at : at + size]), chunks)))
        return out

    def _item(self, job: GpuJob, spans: ChunkSpans, crcs: np.ndarray) -> EncodedItem:
        header = ItemHeader(
            kind=job.kind, dtype_code=job.dtype_code, shape=job.shape, raw_nbytes=job.nbytes,
            transform=job.layout.transform, plane_codecs=tuple(codec_id(n) for n in job.layout.plane_codecs),
            chunks=ChunkTable.from_columns(spans.sizes, crcs), chunk_bytes=self.chunk_bytes,
            base_digest=job.delta.base_digest if job.delta is not None else None,
            delta_kind=delta_transform.kind_for(job.dtype) if job.delta is not None else 0,
        )
        return EncodedItem(header, header.pack(), spans)

    # -- entry points --------------------------------------------------------------------------
    def encode(self, jobs: list[GpuJob], ready: torch.cuda.Event | None = None) -> Iterator[tuple[GpuJob, EncodedItem]]:
        """Yield ``(job, encoded item)`` for every job, in order of completion.

        ``ready`` is an event recorded on the caller's stream after the tensors were produced;
        our streams wait on it, so compression never reads a tensor before it is written. The
        yielded chunks view a pooled pinned buffer that is reused once the next item is asked for.
        """
        buckets = self.encode_buckets(jobs, ready, depth=2)
        try:
            for bucket in buckets:
                for record in bucket.records:
                    assert not isinstance(record, RecordBatch)  # none asked for
                    yield record
                bucket.release()
        finally:
            buckets.close()

    def encode_buckets(self, jobs: list[GpuJob], ready: torch.cuda.Event | None = None,
                       depth: int = 2, batches: bool = False) -> Generator[EncodedBucket, None, None]:
        """Yield each bucket's completed records as one :class:`EncodedBucket`, in order
        (``batches``: the whole records of jobs without a base as a :class:`RecordBatch`).

        A producer thread compresses and copies out up to ``depth`` buckets ahead: while the
        caller writes the records of held buckets (from several threads, releasing each bucket
        when its records are written, in any order), the next bucket is compressed. Each bucket
        handed out goes back to the pool on its :meth:`~EncodedBucket.release`, also after the
        iterator ended or raised; closing the iterator early returns them all at once (the
        caller must be done with every record by then). ``ready``: as :meth:`encode`.
        """
        partial: dict[int, tuple[ChunkSpans, list[np.ndarray]]] = {}
        sink = _PooledSink(self.pinned, depth)
        ready_buckets: queue.Queue[HostBucket | BaseException | None] = queue.Queue()

        def produce() -> None:
            try:
                with torch.cuda.device(self.device):
                    for hb in self._buckets(jobs, ready, sink, depth):
                        ready_buckets.put(hb)
                ready_buckets.put(None)
            except _Stopped:
                pass
            except BaseException as exc:  # handed to the consumer, raised there
                ready_buckets.put(exc)

        producer = threading.Thread(target=produce, name="nvdcp-gpu-encode", daemon=True)
        producer.start()
        seq = 0  # buckets handed out so far
        closed = False
        try:
            while True:
                got = ready_buckets.get()
                if got is None:
                    break
                if isinstance(got, BaseException):
                    raise got
                got.done.synchronize()
                records = list(self._bucket_items(jobs, got, partial, copy_partial=True, batches=batches))
                yield EncodedBucket(records, seq, sink)
                seq += 1
        except GeneratorExit:
            closed = True
            raise
        finally:
            sink.closed = True
            producer.join()
            # copies already queued into pinned buffers must land before the pool reuses them
            for stream in (*self.streams, self.keep_stream):
                stream.synchronize()
            # Buckets handed out go back when the caller releases them (its writers may still be
            # at work when the last bucket was yielded), or all at once when it closes this.
            sink.release(None if closed else seq)

    def stage(self, jobs: list[GpuJob], sink: HostSink, ready: torch.cuda.Event | None = None) -> list[HostBucket]:
        """Compress ``jobs`` into ``sink``'s host memory; returns once every copy is complete.

        After it returns the tensors are no longer read (training may change them) and the
        stored chunks are in host memory; :meth:`items` then checksums them into records.
        """
        try:
            buckets = list(self._buckets(jobs, ready, sink))
        except BaseException:
            # Copies already queued into the sink's memory must land before the caller reuses it.
            for stream in (*self.streams, self.keep_stream):
                stream.synchronize()
            raise
        for hb in buckets:
            hb.done.synchronize()
        self.keep_stream.synchronize()  # kept bytes are in host memory and the tensors no longer read
        return buckets

    def items(self, jobs: list[GpuJob], buckets: list[HostBucket]) -> Iterator[tuple[GpuJob, EncodedItem]]:
        """The records of jobs staged by :meth:`stage` (host work only: checksums and headers).

        Their chunks view the sink's memory, which must stay untouched while they are in use.
        """
        partial: dict[int, tuple[ChunkSpans, list[np.ndarray]]] = {}
        for hb in buckets:
            for record in self._bucket_items(jobs, hb, partial, copy_partial=False):
                assert not isinstance(record, RecordBatch)  # none asked for
                yield record


def _fields(job: GpuJob, chunk_bytes: int) -> HeaderFields:
    """The header fields of ``job``'s record (its chunk table aside)."""
    delta = job.delta
    return HeaderFields(
        job.kind, job.dtype_code, job.layout.transform, layout_codec_ids(job.layout.plane_codecs), job.shape,
        chunk_bytes, job.nbytes, delta.base_digest if delta is not None else None,
        delta_transform.kind_for(job.dtype) if delta is not None else 0,
    )


def _slot_owner(jobs: list[GpuJob], bucket: Bucket, slot: int) -> str:
    """The item and chunk a slot of ``bucket`` holds, for error messages."""
    seg = bucket.segment(bucket.segment_of_slot(slot))
    job = jobs[seg.job]
    return f"{job.key}: chunk {seg.first_block * job.n_planes + slot - seg.first_slot}"


def _run_holding(hb: HostBucket, lo: int, hi: int) -> int | None:
    """The index of the host buffer run holding slots ``lo..hi-1`` (None: they cross runs)."""
    for r, (_, run_lo, run_hi) in enumerate(hb.runs):
        if run_lo <= lo and hi <= run_hi:
            return r
    return None


def _chunk_spans(hb: HostBucket, lo: np.ndarray, hi: np.ndarray) -> list[ChunkSpans]:
    """For each slot range ``lo[i]..hi[i]-1`` of ``hb``: its stored chunks as spans of the host
    buffer run holding it, made from the bucket's arrays without a check per item (ranges that
    cross runs: :meth:`HostBucket.spans`)."""
    n_runs = len(hb.runs)
    run_lo = np.fromiter((r[1] for r in hb.runs), dtype=np.int64, count=n_runs)
    run_hi = np.fromiter((r[2] for r in hb.runs), dtype=np.int64, count=n_runs)
    which = np.maximum(np.searchsorted(run_lo, lo, side="right") - 1, 0)
    inside = (hi <= run_hi[which]) & (lo >= run_lo[which]) if n_runs else np.zeros(len(lo), dtype=bool)
    buffers = [host.numpy().data if host.numel() else memoryview(b"") for host, _, _ in hb.runs]
    # each slot's offset within its run's buffer, for the slots of every run
    rel = hb.offsets[:-1].astype(np.int64, copy=True)
    for r_lo, r_hi in zip(run_lo.tolist(), run_hi.tolist()):
        rel[r_lo:r_hi] -= hb.offsets[r_lo]
    stored = hb.stored.astype(np.int64, copy=False)
    out: list[ChunkSpans] = []
    for r, a, b, ok in zip(which.tolist(), lo.tolist(), hi.tolist(), inside.tolist()):
        if a == b:
            out.append(ChunkSpans())
        else:
            out.append(ChunkSpans.of(buffers[r], rel[a:b], stored[a:b]) if ok else hb.spans(a, b))
    return out


def by_device(jobs: list[GpuJob]) -> dict[torch.device, list[GpuJob]]:
    """Jobs grouped by the device their tensors are on, in first-seen order."""
    groups: dict[torch.device, list[GpuJob]] = {}
    for job in jobs:
        groups.setdefault(job.data.device, []).append(job)
    return groups


def ready_event(device: torch.device) -> torch.cuda.Event:
    """An event on the caller's current stream of ``device``: our streams wait on it, so
    compression reads tensors only after the work that produced them (e.g. the optimizer step)."""
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(device))
    return ready

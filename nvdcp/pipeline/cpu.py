"""CPU item encoder and decoder: byte planes + CPU codecs on a thread pool.

The codecs release the GIL, so chunks of one item compress on all cores at once. Work goes to
the pool in groups of chunks (``_GROUP_BYTES``) to keep per-task overhead small.

Byte planes are split and merged by the optional native library (``nvdcp.format._crc32c_batch``:
SSE shuffles, the GIL released, one call per group or block) or, without it, by numpy's strided
copies (:func:`split_planes`, :func:`merge_planes`; the same bytes either way).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from nvdcp._native import load_function
from nvdcp.codecs import GPU_ONLY, Codec, codec_class, codec_id, codec_name, cpu_codec
from nvdcp.errors import CodecUnavailableError, CorruptCheckpointError, UnknownCodecError
from nvdcp.format.crc import checksum_ranges
from nvdcp.format.dtypes import code_dtype, is_float_like
from nvdcp.format.header import (
    DEFAULT_CHUNK_BYTES,
    KIND_TENSOR,
    TRANSFORM_BYTEPLANES,
    ChunkTable,
    ItemHeader,
    checksum,
    parse_item_header,
)
from nvdcp.pipeline.policy import Layout
from nvdcp.pipeline.scratch import PLANE_BUFFERS
from nvdcp.transform import delta as delta_transform

logger = logging.getLogger(__name__)

_GROUP_BYTES = 1 << 20
_FORMAT_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "format")


# -- byte planes ---------------------------------------------------------------------------------
@functools.cache
def _native_split() -> Callable[..., int] | None:
    fn = load_function(_FORMAT_DIR, "_crc32c_batch", "nvdcp_split_planes")
    if fn is None:
        logger.debug("nvdcp.format._crc32c_batch is not available: byte planes are split by numpy")
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


@functools.cache
def _native_merge() -> Callable[..., int] | None:
    fn = load_function(_FORMAT_DIR, "_crc32c_batch", "nvdcp_merge_planes")
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def native_planes_available() -> bool:
    """Whether byte planes are split and merged by the native library here."""
    return _native_split() is not None and _native_merge() is not None


def split_planes(src: np.ndarray, n_planes: int, out: np.ndarray | None = None) -> np.ndarray:
    """The ``(n_planes, n)`` byte planes of ``src`` (contiguous uint8, ``n * n_planes`` bytes):
    plane ``p`` holds byte ``p`` of every element. ``out``: a C-contiguous uint8 array of that
    shape to fill (a fresh one otherwise)."""
    n = src.size // n_planes
    if out is None:
        out = np.empty((n_planes, n), dtype=np.uint8)
    fn = _native_split()
    if fn is not None:
        if n:
            fn(src.ctypes.data, n, n_planes, out.ctypes.data, n)
        return out
    grid = src.reshape(n, n_planes)
    for p in range(n_planes):  # one plane at a time: a long strided loop (see merge_planes)
        out[p] = grid[:, p]
    return out


def merge_planes(planes: Sequence[np.ndarray], out: np.ndarray) -> None:
    """Inverse of :func:`split_planes`: interleave ``planes`` (``n_planes`` uint8 arrays of ``n``
    bytes each, contiguous) into ``out`` (contiguous uint8, ``n * n_planes`` bytes)."""
    n_planes = len(planes)
    n = out.size // n_planes
    fn = _native_merge()
    if fn is not None:
        if n:
            ptrs = (ctypes.c_void_p * n_planes)(*[p.ctypes.data for p in planes])
            fn(ptrs, n, n_planes, out.ctypes.data)
        return
    grid = out.reshape(n, n_planes)
    for p, plane in enumerate(planes):
        # One plane at a time: a long strided loop; several planes in one transposed copy
        # measured 3x slower (numpy iterates the short axis innermost).
        grid[:, p] = plane


@dataclass
class EncodedItem:
    """An item ready to append to a data file: its header and its stored chunks, in order."""

    header: ItemHeader
    header_bytes: bytes
    chunks: Sequence[bytes | memoryview]  # a list, or ChunkSpans (GPU records: no object per chunk)
    #: a delta whose XOR is all zero: the item equals its base item (the stale-save check)
    unchanged: bool = False
    #: the whole record (header, then chunks) where it lies contiguous in memory that nothing
    #: reuses (a small-item batch's buffer, :mod:`nvdcp.pipeline.cpu_batch`): written as it is
    record: memoryview | None = None

    @functools.cached_property
    def nbytes(self) -> int:
        # Cached: the writer asks several times per item, and the header sums its chunk table
        # on every call (0.77 s of a 20,000-item save under cProfile before).
        if self.record is not None:
            return len(self.record)  # a batch's record: its length is known without the sum
        return len(self.header_bytes) + self.header.stored_nbytes


def block_chunks(planes: np.ndarray, chunk_bytes: int) -> list[memoryview]:
    """Chunks of a ``(n_planes, n)`` plane array in stored (block-major) order."""
    n_planes, n = planes.shape
    views = [memoryview(plane) for plane in planes]
    return [views[p][b : b + chunk_bytes] for b in range(0, n, chunk_bytes) for p in range(n_planes)]


@dataclass
class _Delta:
    """An item's base for a delta record (see :func:`encode_item`): each group of blocks takes
    its own difference, keeps its raw bytes in ``keep`` (None: not kept) and appends to
    ``changed`` where the difference is not all zero."""

    base: np.ndarray
    kind: int
    element_size: int
    keep: np.ndarray | None
    changed: list[bool]


def _encode_blocks(
    raw: np.ndarray, n_planes: int, codecs: list[Codec | None], chunk_bytes: int, planes_buf: np.ndarray | None,
    delta: _Delta | None, blocks: range, origin: int = 0,
) -> list[tuple[bytes | memoryview, int]]:
    """Stored chunks and CRC32Cs of ``blocks``: the group's elements split into their planes here
    (one pass per group: cache-friendly, and on the pool's threads, not one whole-item pass
    before compression), into the group's own part of ``planes_buf`` (the item's plane buffer,
    ``raw.size`` bytes). ``codecs[p]``: plane ``p``'s codec, None to store it raw.
    ``delta``: the group's difference from its base is encoded instead of ``raw`` (taken in the
    same pass as the split, per group: cache-sized passes on the pool's threads), the group's
    raw bytes kept for the next save as it goes, and ``changed`` gets True when the difference
    is not all zero. ``origin``: the byte of the item that ``planes_buf`` starts at (a buffer
    of one group's size, reused: :class:`StreamedRecord`)."""
    plane_nbytes = raw.size // n_planes
    lo = blocks.start * chunk_bytes
    hi = min(blocks.stop * chunk_bytes, plane_nbytes)
    src = raw[lo * n_planes : hi * n_planes]
    if delta is not None:
        span = slice(lo * n_planes, hi * n_planes)
        into = (np.empty((1, src.size), dtype=np.uint8) if planes_buf is None
                else planes_buf[lo * n_planes - origin : hi * n_planes - origin].reshape(n_planes, hi - lo))
        keep = None if delta.keep is None else delta.keep[span]
        if delta_transform.delta_split([src], [delta.base[span]], [keep], delta.kind, delta.element_size, into,
                                       np.zeros(1, dtype=np.int64))[0]:
            delta.changed.append(True)
        views = [plane.data for plane in into]
    elif n_planes == 1 or planes_buf is None:
        views = [src.data]
    else:
        planes = planes_buf[lo * n_planes - origin : hi * n_planes - origin].reshape(n_planes, hi - lo)
        split_planes(src, n_planes, planes)
        views = [plane.data for plane in planes]
    out: list[tuple[bytes | memoryview, int]] = []
    append = out.append
    for b in range(0, hi - lo, chunk_bytes):
        for p in range(n_planes):
            chunk = views[p][b : b + chunk_bytes]
            codec = codecs[p]
            if codec is None:
                append((chunk, checksum(chunk)))
                continue
            stored: bytes | memoryview = codec.encode(chunk)
            if len(stored) >= len(chunk):
                stored = chunk  # compression did not pay: keep the raw bytes (see ItemHeader)
            append((stored, checksum(stored)))
    return out


@functools.cache
def plane_encoders(names: tuple[str, ...], n_planes: int, planes: str | None) -> list[Codec | None]:
    """Each plane's CPU codec (None: stored raw). ``planes``: what the planes hold, for codecs
    with settings tuned to it: ``"delta"`` a difference's planes (:meth:`Codec.for_sparse_planes`),
    ``"float"`` a float's byte planes (:meth:`Codec.for_float_planes`), None anything else."""
    out: list[Codec | None] = []
    for p in range(n_planes):
        name = names[p % len(names)]
        if name == "none":
            out.append(None)
        else:
            codec = cpu_codec(name)
            if planes == "delta":
                codec = codec.for_sparse_planes()
            elif planes == "float":
                codec = codec.for_float_planes()
            out.append(codec)
    return out


@functools.cache
def layout_codec_ids(names: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(codec_id(n) for n in names)


@functools.cache
def float_planes(kind: int, dtype_code: int, transform: int) -> bool:
    """Whether an item's byte planes are those of a float (or complex) dtype."""
    if kind != KIND_TENSOR or transform != TRANSFORM_BYTEPLANES:
        return False
    try:
        return is_float_like(code_dtype(dtype_code, ""))
    except CorruptCheckpointError:
        return False


def planes_hold(delta: bool, kind: int, dtype_code: int, layout: Layout) -> str | None:
    """What an item's planes hold, for :func:`plane_encoders`."""
    if delta:
        return "delta"
    return "float" if float_planes(kind, dtype_code, layout.transform) else None


#: A delta plane is compressed only when its first block's chunk shrinks at least this much:
#: the low mantissa planes of a float XOR are near-random (7.9+ bits of entropy per byte), and
#: trying every chunk of them cost as much codec time as the whole rest of the item.
PROBE_MIN_GAIN = 0.03


def _probe_planes(raw: np.ndarray, n_planes: int, layout: Layout, codecs: list[Codec | None],
                  chunk_bytes: int) -> tuple[Layout, list[Codec | None]]:
    """``layout`` with the planes whose first chunk does not compress stored raw."""
    n = raw.size // n_planes
    if n == 0:
        return layout, codecs
    first = min(n, chunk_bytes)
    sample = split_planes(np.ascontiguousarray(raw[: first * n_planes]), n_planes) if n_planes > 1 else raw[:first][None]
    names = list(layout.plane_codecs)
    out = list(codecs)
    for p, codec in enumerate(codecs):
        if codec is not None and len(codec.encode(sample[p].data)) > first * (1 - PROBE_MIN_GAIN):
            names[p % len(names)] = "none" if len(names) == n_planes else names[p % len(names)]
            out[p] = None
    return Layout(layout.transform, tuple(names)), out


def encode_item(
    raw: np.ndarray,
    *,
    kind: int,
    dtype_code: int,
    shape: tuple[int, ...],
    element_size: int,
    layout: Layout,
    pool: Executor | None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    base: np.ndarray | None = None,
    base_digest: int | None = None,
    delta_kind: int = 0,
    keep: np.ndarray | None = None,
) -> EncodedItem:
    """Encode one item's raw bytes (a flat uint8 array) with ``layout``; groups of about
    ``_GROUP_BYTES`` go to ``pool`` when there are several.

    ``base`` (the same item's raw bytes in the base checkpoint, ``raw.size`` bytes) makes a delta
    record: their delta of ``delta_kind`` (:mod:`nvdcp.transform.delta`) is stored, and
    ``base_digest`` (the base item's record digest) goes into its header (docs/FORMAT.md, "Delta
    checkpoints"). ``keep`` (with ``base``; ``raw.size`` bytes, may be ``base`` itself) receives
    ``raw`` as the difference is taken, for the next save's base."""
    _check_host_codecs(layout)
    n_planes = element_size if layout.transform == TRANSFORM_BYTEPLANES else 1
    delta: _Delta | None = None
    if base is not None:
        if base.size != raw.size or base_digest is None:
            raise ValueError(f"a delta needs a base of {raw.size} bytes and its digest, got {base.size} bytes")
        if keep is not None and keep.size != raw.size:
            raise ValueError(f"bytes kept for the next save need {raw.size} bytes, got {keep.size}")
        delta = _Delta(base, delta_kind, element_size, keep, [])  # each group takes its own difference
    codecs = plane_encoders(layout.plane_codecs, n_planes, planes_hold(base is not None, kind, dtype_code, layout))
    if base is not None:
        probe = min(raw.size, chunk_bytes * n_planes)
        first = delta_transform.encode_np(raw[:probe], base[:probe], delta_kind, element_size)
        layout, codecs = _probe_planes(first, n_planes, layout, codecs, chunk_bytes)
    job, spans = _group_job(raw, n_planes, codecs, chunk_bytes, delta)
    if pool is None or len(spans) < 2:
        results = [job(span) for span in spans]
    else:
        results = list(pool.map(job, spans))
    stored = [pair for group in results for pair in group]
    header = _header(raw, kind, dtype_code, shape, layout, chunk_bytes, [len(s) for s, _ in stored],
                     [crc for _, crc in stored], base_digest if base is not None else None,
                     delta_kind if base is not None else 0)
    unchanged = delta is not None and not delta.changed
    return EncodedItem(header, header.pack(), [s for s, _ in stored], unchanged)


def _check_host_codecs(layout: Layout) -> None:
    for name in layout.plane_codecs:
        if name in GPU_ONLY:
            raise CodecUnavailableError(f"codec {name!r} can only encode on a GPU")


def _group_job(raw: np.ndarray, n_planes: int, codecs: list[Codec | None], chunk_bytes: int, delta: _Delta | None,
               ) -> tuple[Callable[[range], list[tuple[bytes | memoryview, int]]], list[range]]:
    """The task that encodes one group of blocks of ``raw`` (:func:`_encode_blocks`) and the
    groups (:func:`_group_spans`)."""
    spans = _group_spans(raw.size, n_planes, chunk_bytes)
    # One plane buffer for the whole item, not one per group: the raw planes' chunks view it
    # until the item is written either way, and one large allocation is faulted in with huge
    # pages (where the kernel has them) instead of a fresh mapping per group (the split measured
    # about 2x faster so).
    planes_buf = PLANE_BUFFERS.take(raw.size) if n_planes > 1 and raw.size else None
    return functools.partial(_encode_blocks, raw, n_planes, codecs, chunk_bytes, planes_buf, delta), spans


def _group_spans(nbytes: int, n_planes: int, chunk_bytes: int) -> list[range]:
    """An item's blocks in groups of about ``_GROUP_BYTES`` (the codec pool's tasks), in order."""
    n_blocks = -(-(nbytes // n_planes) // chunk_bytes)
    per = max(1, _GROUP_BYTES // (chunk_bytes * n_planes))
    return [range(s, min(n_blocks, s + per)) for s in range(0, n_blocks, per)]


def _header(raw: np.ndarray, kind: int, dtype_code: int, shape: tuple[int, ...], layout: Layout, chunk_bytes: int,
            sizes: Sequence[int], crcs: Sequence[int], base_digest: int | None = None,
            delta_kind: int = 0) -> ItemHeader:
    """The header of ``raw``'s record whose chunks are ``sizes`` bytes with CRC32Cs ``crcs``."""
    return ItemHeader(
        kind=kind,
        dtype_code=dtype_code,
        shape=shape,
        raw_nbytes=raw.size,
        transform=layout.transform,
        plane_codecs=layout_codec_ids(layout.plane_codecs),
        chunks=ChunkTable.from_columns(sizes, crcs),
        chunk_bytes=chunk_bytes,
        base_digest=base_digest,
        delta_kind=delta_kind,
    )


#: A streamed item up to this size splits into one plane buffer of its size from the pooled
#: ones (``PLANE_BUFFERS``, faulted in by earlier saves), and every group is queued at once: the
#: codec threads never wait for the writer. A larger item would take a fresh buffer of its size
#: (a 1 GB tensor's save faulted in 1 GB more); it cycles through ``STREAM_RING_BYTES`` instead.
STREAM_WHOLE_MAX_BYTES = PLANE_BUFFERS.budget_bytes
#: Plane buffer of a streamed item over ``STREAM_WHOLE_MAX_BYTES``: one slot per group in flight,
#: each reused by the group a ring's length later once the caller wrote it. On the CPU machine
#: (2 cores, /dev/shm), a ring of 8 MiB made saves of 268 MB in 3 tensors as slow as without
#: streaming (0.213 s against 0.216 s; queueing every group: 0.186 s): when the ring is full the
#: codec threads wait for the writer and a core idles.
STREAM_RING_BYTES = 64 << 20


class StreamedRecord:
    """A large item's record delivered group by group (:func:`stream_item`).

    Its header's size is known before any chunk (``head_nbytes``: it depends on the chunk count,
    not on the chunks), so a writer that can fill in an earlier part of its file leaves that
    much room, writes each group's chunks as :meth:`groups` yields them (while the codec pool
    compresses the groups after it), then writes :meth:`finish`'s header into the room. The
    record's bytes are exactly :func:`encode_item`'s. Without this, nothing of an item could be
    written before all of it was compressed, and the last item's write ran alone on one core
    (CPU machine, a 268 MB save to /dev/shm).

    Each group in flight splits into a plane buffer slot of its own (``ring``). An item up to
    ``STREAM_WHOLE_MAX_BYTES`` has a slot per group, all queued at once; a larger one a ring of
    ``STREAM_RING_BYTES``, a slot reused by the group a ring's length later once the caller has
    written it. A group's chunks are valid until the caller asks for the next group;
    :meth:`finish`'s record has no chunks (they are written)."""

    def __init__(self, header_of: Callable[[list[int], list[int]], ItemHeader], head_nbytes: int,
                 n_chunks: int, job: Callable[[np.ndarray | None, range], list[tuple[bytes | memoryview, int]]],
                 spans: list[range], ring: list[np.ndarray | None], pool: Executor | None) -> None:
        self.head_nbytes = head_nbytes
        self._header_of = header_of  # the header, given every chunk's stored size and CRC32C
        self._n_chunks = n_chunks
        self._job = job
        self._spans = spans
        self._ring = ring
        self._pool = pool
        self._futures: dict[int, Future[list[tuple[bytes | memoryview, int]]]] = {}
        self._sizes: list[int] = []
        self._crcs: list[int] = []
        for i in range(min(len(ring), len(spans))):  # the first window queued now
            self._submit(i)

    def _submit(self, i: int) -> None:
        if self._pool is not None and i < len(self._spans):
            self._futures[i] = self._pool.submit(self._job, self._ring[i % len(self._ring)], self._spans[i])

    def groups(self) -> Iterator[list[bytes | memoryview]]:
        """Each group's stored chunks, in order, as soon as it is compressed (once)."""
        for i, span in enumerate(self._spans):
            future = self._futures.pop(i, None)
            pairs = future.result() if future is not None else self._job(self._ring[i % len(self._ring)], span)
            self._sizes.extend(len(chunk) for chunk, _ in pairs)
            self._crcs.extend(crc for _, crc in pairs)
            yield [chunk for chunk, _ in pairs]
            del pairs  # written: its plane buffer goes to the group a window later
            self._submit(i + len(self._ring))

    def finish(self) -> EncodedItem:
        """The record's header and size, once :meth:`groups` has yielded every group (its
        ``chunks`` are empty: the caller wrote them)."""
        if len(self._sizes) != self._n_chunks:
            raise RuntimeError("StreamedRecord.finish before every group was taken")
        header = self._header_of(self._sizes, self._crcs)
        packed = header.pack()
        if len(packed) != self.head_nbytes:  # the room left for it must fit it exactly
            raise AssertionError(f"a streamed record's header is {len(packed)} bytes, {self.head_nbytes} were left")
        return EncodedItem(header, packed, [])

    def close(self) -> None:
        """Cancel the groups not started and wait for the running ones (their results dropped)."""
        futures, self._futures = list(self._futures.values()), {}
        for future in futures:
            future.cancel()
            with contextlib.suppress(BaseException):
                future.result()


def stream_item(
    raw: np.ndarray,
    *,
    kind: int,
    dtype_code: int,
    shape: tuple[int, ...],
    element_size: int,
    layout: Layout,
    pool: Executor | None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> StreamedRecord:
    """:func:`encode_item` of an item stored whole, as a :class:`StreamedRecord`: its first
    groups (every group, up to ``STREAM_WHOLE_MAX_BYTES``) are queued on ``pool`` now and come
    back in order."""
    _check_host_codecs(layout)
    n_planes = element_size if layout.transform == TRANSFORM_BYTEPLANES else 1
    codecs = plane_encoders(layout.plane_codecs, n_planes, planes_hold(False, kind, dtype_code, layout))
    spans = _group_spans(raw.size, n_planes, chunk_bytes)
    n_chunks = sum(len(span) for span in spans) * n_planes

    def job(planes: np.ndarray | None, blocks: range) -> list[tuple[bytes | memoryview, int]]:
        return _encode_blocks(raw, n_planes, codecs, chunk_bytes, planes, None, blocks,
                              origin=blocks.start * chunk_bytes * n_planes)

    header_of = functools.partial(_header, raw, kind, dtype_code, shape, layout, chunk_bytes)
    head_nbytes = ItemHeader.packed_size(len(shape), len(layout.plane_codecs), n_chunks)
    group_bytes = len(spans[0]) * chunk_bytes * n_planes if spans else 0
    ring = _plane_slots(raw.size, group_bytes, len(spans), n_planes > 1)
    return StreamedRecord(header_of, head_nbytes, n_chunks, job, spans, ring, pool)


def _plane_slots(nbytes: int, group_bytes: int, n_groups: int, planar: bool) -> list[np.ndarray | None]:
    """A streamed item's plane buffer slots, one per group in flight (None: no planes to split)."""
    whole = nbytes <= STREAM_WHOLE_MAX_BYTES
    slots = n_groups if whole else max(1, min(n_groups, STREAM_RING_BYTES // group_bytes))
    if not planar or not nbytes:
        return [None] * max(1, slots)
    buf = PLANE_BUFFERS.take(nbytes if whole else slots * group_bytes)
    return [buf[i * group_bytes : (i + 1) * group_bytes] for i in range(slots)]


def chunk_table(header: ItemHeader) -> tuple[np.ndarray, np.ndarray]:
    """The chunk table of a parsed header as arrays: stored sizes (int64) and CRC32Cs (uint32)
    (the header holds it as one array, :class:`~nvdcp.format.header.ChunkTable`)."""
    table = header.chunks
    return table.sizes.astype(np.int64), table.crcs


@functools.cache
def plane_cpu_codecs(plane_codecs: tuple[int, ...]) -> list[Codec]:
    """The CPU codec of each plane id (one registry walk per combination, not per item)."""
    return [cpu_codec(codec_name(c)) for c in plane_codecs]


@functools.cache
def codec_problem(plane_codecs: tuple[int, ...]) -> tuple[type[Exception], str] | None:
    """Why chunks of these plane codecs cannot be decoded here (None: they can); one answer per
    combination, so a checkpoint of many items asks the registry once."""
    for cid in sorted(set(plane_codecs)):
        try:
            cls = codec_class(cid)
        except UnknownCodecError:
            return CorruptCheckpointError, f"unknown codec id {cid}"
        if not cls.cpu_decodable:
            return CodecUnavailableError, (
                f"stored with codec {cls.name!r}, which has no CPU decoder; load it on a "
                "machine with an NVIDIA GPU (or convert it there with another codec)"
            )
    return None


def check_decodable(header: ItemHeader, element_size: int, where: str) -> None:
    """Refuse, before any chunk is read, an item this machine cannot decode or whose planes do
    not fit its elements."""
    problem = codec_problem(header.plane_codecs)
    if problem is not None:
        cls, message = problem
        raise cls(f"{where}: {message}")
    if header.transform == TRANSFORM_BYTEPLANES and header.n_planes != element_size:
        raise CorruptCheckpointError(f"{where}: {header.n_planes} byte planes for {element_size}-byte elements")


def check_crcs(
    buf: np.ndarray, starts: np.ndarray, sizes: np.ndarray, crcs: np.ndarray, name_chunk: Callable[[int], str],
    threads: int | None = None,
) -> None:
    """Compare the CRC32C of every range ``buf[starts[i] : starts[i] + sizes[i]]`` with ``crcs[i]``
    in one batched call; the first mismatch raises, named by ``name_chunk(i)``. ``threads``: as
    :func:`~nvdcp.format.crc.checksum_ranges` (1 from callers already running one task per core)."""
    if not len(sizes):
        return
    bad = np.flatnonzero(checksum_ranges(buf, starts, sizes, threads) != crcs)
    if len(bad):
        raise CorruptCheckpointError(f"{name_chunk(int(bad[0]))} checksum mismatch")


def describe_chunk(where: str, chunk: int, n_planes: int) -> str:
    block, plane = divmod(chunk, n_planes)
    return f"{where}: chunk {chunk} (block {block}, plane {plane})"


def decode_blocks(
    header: ItemHeader, payload: np.ndarray, starts: list[int], sizes: list[int], out: np.ndarray,
    blocks: range, where: str,
) -> None:
    """Decode blocks ``blocks`` of an item into ``out`` (its whole raw bytes, flat uint8: a
    destination tensor's memory or a fresh buffer); chunk ``i`` is at ``payload[starts[i]:]``.

    Chunks' CRC32Cs must have been checked. Each byte of ``out`` is written once: raw planes go
    from ``payload`` straight to their interleaved place (runs of raw planes in one strided copy),
    compressed ones through a block-sized scratch buffer.
    """
    n = header.n_planes
    if not blocks:
        return
    if header.transform == TRANSFORM_BYTEPLANES and n > 1:
        _decode_planar(header, payload, starts, sizes, out, blocks, where)
        return
    cb, pn = header.chunk_bytes, header.plane_nbytes
    codecs = plane_cpu_codecs(header.plane_codecs)
    i, stop = blocks.start * n, blocks.stop * n
    while i < stop:
        block, plane = divmod(i, n)
        raw = min(cb, pn - block * cb)
        at = block * cb * n + plane * raw
        if sizes[i] == raw:  # a run of raw chunks is contiguous in both: one copy
            j, total = i + 1, raw
            while j < stop and n == 1 and sizes[j] == min(cb, pn - j * cb):
                total += sizes[j]
                j += 1
            out[at : at + total] = payload[starts[i] : starts[i] + total]
            i = j
            continue
        _decode_chunk(codecs[plane], payload, starts[i], sizes[i], out[at : at + raw], i, n, where, header)
        i += 1


def _decode_planar(
    header: ItemHeader, payload: np.ndarray, starts: list[int], sizes: list[int], out: np.ndarray,
    blocks: range, where: str,
) -> None:
    """Per block: compressed planes decoded into a scratch row, then all planes (raw ones straight
    from ``payload``) interleaved into ``out`` in one pass (:func:`merge_planes`)."""
    n, cb, pn = header.n_planes, header.chunk_bytes, header.plane_nbytes
    codecs = plane_cpu_codecs(header.plane_codecs)
    width = min(cb, pn)  # a small item's scratch is its size, not a whole block's
    scratch = np.empty((n, width), dtype=np.uint8)
    fn = _native_merge()
    if fn is not None and out.strides == (1,) and payload.strides == (1,):
        # Addresses by arithmetic: no numpy views or ctypes objects per plane.
        ptrs = (ctypes.c_void_p * n)()
        pay, scr, dst = payload.ctypes.data, scratch.ctypes.data, out.ctypes.data
        for block in blocks:
            raw = min(cb, pn - block * cb)
            i = block * n
            for p in range(n):
                if sizes[i] == raw:
                    ptrs[p] = pay + starts[i]
                else:
                    _decode_chunk(codecs[p], payload, starts[i], sizes[i], scratch[p, :raw], i, n, where, header)
                    ptrs[p] = scr + p * width
                i += 1
            fn(ptrs, raw, n, dst + block * cb * n)
        return
    for block in blocks:
        raw = min(cb, pn - block * cb)
        i = block * n
        planes = []
        for p in range(n):
            if sizes[i] == raw:
                planes.append(payload[starts[i] : starts[i] + raw])
            else:
                dst_row = scratch[p, :raw]
                _decode_chunk(codecs[p], payload, starts[i], sizes[i], dst_row, i, n, where, header)
                planes.append(dst_row)
            i += 1
        merge_planes(planes, out[block * cb * n : (block * cb + raw) * n])


def _decode_chunk(
    codec: Any, payload: np.ndarray, start: int, size: int, dst: np.ndarray, i: int, n_planes: int,
    where: str, header: ItemHeader,
) -> None:
    raw = len(dst)
    if size > raw:
        raise CorruptCheckpointError(f"{describe_chunk(where, i, n_planes)} stores {size} bytes for {raw} raw")
    name = codec.name
    try:
        codec.decode(payload[start : start + size].data, dst.data)
    except CodecUnavailableError as exc:
        raise CodecUnavailableError(f"{where}: {exc}") from None
    except ValueError as exc:
        block, plane = divmod(i, n_planes)
        raise CorruptCheckpointError(
            f"{where}: chunk {i} (block {block}, plane {plane}, codec {name}) does not decode: {exc}"
        ) from exc


def chunk_starts(sizes: np.ndarray, base: int = 0) -> np.ndarray:
    """Offsets of back-to-back chunks of ``sizes``, the first at ``base`` (int64)."""
    starts = np.empty(len(sizes), dtype=np.int64)
    if len(sizes):
        starts[0] = base
        np.cumsum(sizes[:-1], out=starts[1:])
        starts[1:] += base
    return starts


def verify_chunks(record: memoryview, where: str) -> ItemHeader:
    """Check an item record's header and every chunk's CRC32C without decoding anything."""
    header = parse_item_header(record, where)
    if not header.chunks:
        return header
    buf = np.frombuffer(record, dtype=np.uint8)
    sizes, crcs = chunk_table(header)
    starts = chunk_starts(sizes, header.header_bytes)
    check_crcs(buf, starts, sizes, crcs, lambda i: describe_chunk(where, i, header.n_planes))
    return header


def decode_item(
    record: memoryview, where: str, pool: Executor | None, element_size: int = 1, out: np.ndarray | None = None,
    checked: ItemHeader | None = None,
) -> tuple[ItemHeader, np.ndarray]:
    """Verify and decode one stored item record; returns its header and raw bytes (flat uint8:
    ``out`` when given, which must hold exactly the item's raw bytes).

    Every chunk's CRC32C is checked (in one batched call) before any bytes reach a decoder.
    ``checked``: the record's header, which the caller already parsed and checked with every
    chunk's CRC32C (:func:`verify_chunks`) and :func:`check_decodable`: none of it is redone.
    """
    header = checked if checked is not None else parse_item_header(record, where)
    if checked is None:
        check_decodable(header, element_size, where)
    if out is None:
        out = np.empty(header.raw_nbytes, dtype=np.uint8)
    elif out.size != header.raw_nbytes:
        raise CorruptCheckpointError(f"{where}: {header.raw_nbytes} stored bytes for a {out.size}-byte destination")
    if not header.chunks:
        return header, out
    buf = np.frombuffer(record, dtype=np.uint8)
    sizes, crcs = chunk_table(header)
    starts = chunk_starts(sizes, header.header_bytes)
    if checked is None:
        check_crcs(buf, starts, sizes, crcs, lambda i: describe_chunk(where, i, header.n_planes))
    spans = _block_spans(header)
    args = (header, buf, starts.tolist(), sizes.tolist(), out)
    if pool is None or len(spans) < 2:
        for span in spans:
            decode_blocks(*args, span, where)
    else:
        for f in [pool.submit(decode_blocks, *args, span, where) for span in spans]:
            f.result()
    return header, out


def _block_spans(header: ItemHeader) -> list[range]:
    """Block ranges of about ``_GROUP_BYTES`` raw bytes each: the units of parallel decoding."""
    per = max(1, _GROUP_BYTES // (header.chunk_bytes * header.n_planes))
    nb = header.n_blocks
    return [range(s, min(nb, s + per)) for s in range(0, nb, per)]

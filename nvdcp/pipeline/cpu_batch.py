"""Small host tensors encoded together: one record per tensor, the per-item work done in arrays.

A state of 20,000 small tensors spent most of its save in per-item Python: each tensor's plane
split, a codec call and a CRC32C call per chunk, its header packed field by field, its record
joined (benchmarks/cpu_pipeline_bench.py). Here the tensors of a batch that share a dtype are
concatenated, split into byte planes in one native call, each compressed plane's chunks go to
the codec in one call (zstd's batch API compresses them without the GIL), the stored chunks are
gathered into the records in one native call, every chunk and every header is checksummed in one
call each, and the chunk tables are written as one array. What stays per item is packing the
header's fixed fields and, for callers that want them, the record object itself; the writer takes
a group's records as one :class:`~nvdcp.pipeline.record_batch.RecordBatch` instead
(:func:`encode_tensor_batches`: records back to back, one write for the group).

The records are byte for byte those of :func:`nvdcp.pipeline.cpu.encode_item` (the same
layout, codecs, chunking and raw fallback; tests/pipeline/test_cpu_batch.py compares them).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nvdcp._native import load_function
from nvdcp.codecs import codec_id
from nvdcp.codecs.base import Buffer, Codec, PackedStreams
from nvdcp.codecs.zstd_blocks import block_decoder
from nvdcp.format.crc import checksum_ranges
from nvdcp.format.header import (
    DELTA_ITEM_VERSION,
    DELTA_KINDS,
    FLAG_XOR_BASE,
    FULL_ITEM_VERSION,
    ITEM_FIXED_SIZE,
    ITEM_MAGIC,
    KIND_BYTES,
    KIND_TENSOR,
    MAX_CHUNK_BYTES,
    MAX_NDIM,
    MAX_PLANES,
    MIN_CHUNK_BYTES,
    TRANSFORM_BYTEPLANES,
    ChunkTable,
    ItemHeader,
)
from nvdcp.format.header_batch import (
    CRC_SIZE,
    DELTA_FIELDS,
    ENTRY_SIZE,
    HeaderFields,
    header_layout,
    header_of,
    pack_headers_into,
)
from nvdcp.pipeline.cpu import (
    PROBE_MIN_GAIN,
    EncodedItem,
    layout_codec_ids,
    merge_planes,
    plane_cpu_codecs,
    plane_encoders,
    planes_hold,
    split_planes,
)
from nvdcp.pipeline.policy import Layout
from nvdcp.pipeline.record_batch import RecordBatch
from nvdcp.pipeline.tensors import has_lazy_bits, tensor_to_host_bytes
from nvdcp.transform import delta as delta_transform

_FORMAT_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "format")


@functools.cache
def _native_gather() -> Callable[..., int] | None:
    fn = load_function(_FORMAT_DIR, "_crc32c_batch", "nvdcp_gather")
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


@functools.cache
def _native_gather_crc() -> Callable[..., int] | None:
    fn = load_function(_FORMAT_DIR, "_crc32c_batch", "nvdcp_gather_crc32c")
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


@functools.cache
def _native_split_many() -> Callable[..., int] | None:
    fn = load_function(_FORMAT_DIR, "_crc32c_batch", "nvdcp_split_planes_many")
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int64]
        fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def copy_ranges(out: np.ndarray, dst: np.ndarray, src_buffers: list[np.ndarray], src_of: np.ndarray,
                src_off: np.ndarray, sizes: np.ndarray) -> None:
    """``out[dst[j] : dst[j] + sizes[j]] = src_buffers[src_of[j]][src_off[j] : ...]`` for every
    chunk ``j``: one native call (the GIL released), or numpy slice copies without the library."""
    fn = _native_gather()
    if fn is not None:
        srcs, dsts, lengths = _range_addresses(out, dst, src_buffers, src_of, src_off, sizes)
        fn(srcs.ctypes.data, dsts.ctypes.data, lengths.ctypes.data, len(sizes))
        return
    for d, b, o, n in zip(dst.tolist(), src_of.tolist(), src_off.tolist(), sizes.tolist()):
        out[d : d + n] = src_buffers[b][o : o + n]


def copy_ranges_checksummed(out: np.ndarray, dst: np.ndarray, src_buffers: list[np.ndarray], src_of: np.ndarray,
                            src_off: np.ndarray, sizes: np.ndarray, threads: int) -> np.ndarray:
    """:func:`copy_ranges`, and the CRC32C of each copied range (uint32): one native pass that
    checksums each chunk right after copying it, while it is in cache, on up to ``threads``
    threads (the copy and a separate checksum pass were 236 of the codec threads' 810 busy samples
    in a CPU save of 20,000 small tensors); without the library, the two steps."""
    fn = _native_gather_crc()
    if fn is None:
        copy_ranges(out, dst, src_buffers, src_of, src_off, sizes)
        return checksum_ranges(out, dst, sizes, threads)
    crcs = np.empty(len(sizes), dtype=np.uint32)
    if len(sizes):
        srcs, dsts, lengths = _range_addresses(out, dst, src_buffers, src_of, src_off, sizes)
        fn(srcs.ctypes.data, dsts.ctypes.data, lengths.ctypes.data, len(sizes), crcs.ctypes.data, threads)
    return crcs


def _range_addresses(out: np.ndarray, dst: np.ndarray, src_buffers: list[np.ndarray], src_of: np.ndarray,
                     src_off: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The native gathers' arguments: each range's source and destination address and its
    length, as int64 arrays (the caller keeps the buffers alive across the call)."""
    bases = np.array([b.ctypes.data for b in src_buffers], dtype=np.int64)
    return bases[src_of] + src_off, dst + out.ctypes.data, np.ascontiguousarray(sizes, dtype=np.int64)


def _exclusive_cumsum(values: np.ndarray) -> np.ndarray:
    out = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(values, out=out[1:])
    return out


def encode_tensor_batch(
    tensors: Sequence[torch.Tensor], dtype_codes: Sequence[int], layout_of: Callable[[torch.dtype], Layout],
    chunk_bytes: int, threads: int = 1,
) -> list[EncodedItem]:
    """Records of host tensors (whole items, no delta), in order: those of one dtype encoded
    together (see the module doc). ``dtype_codes[i]``: tensor ``i``'s dtype code;
    ``layout_of(dtype)``: its layout (a CPU codec's); ``threads``: threads a batching codec and
    the checksums may use."""
    out: list[EncodedItem | None] = [None] * len(tensors)
    for members, dtype in _by_dtype(tensors):
        group = _encode_group_arrays([tensors[i] for i in members], dtype_codes[members[0]], layout_of(dtype),
                                     chunk_bytes, threads)
        for i, record in zip(members, group.records()):
            out[i] = record
    return out  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class KeyedRecord:
    """What a :class:`RecordBatch` of CPU records holds per record: the key it was encoded for."""

    key: Any


def encode_tensor_batches(
    tensors: Sequence[torch.Tensor], keys: Sequence[Any], dtype_codes: Sequence[int],
    layout_of: Callable[[torch.dtype], Layout], chunk_bytes: int, threads: int = 1,
) -> list[RecordBatch]:
    """:func:`encode_tensor_batch`'s records as one :class:`RecordBatch` per dtype, records back
    to back in one buffer (the same bytes per record); record ``i`` of a batch is ``keys[j]``'s
    (``batch.jobs[i].key``), in the order the tensors came within each dtype."""
    batches = []
    for members, dtype in _by_dtype(tensors):
        group = _encode_group_arrays([tensors[i] for i in members], dtype_codes[members[0]], layout_of(dtype),
                                     chunk_bytes, threads)
        batches.append(group.batch([KeyedRecord(keys[i]) for i in members], chunk_bytes))
    return batches


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[tuple[list[int], torch.dtype]]:
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    return [(members, dtype) for dtype, members in by_dtype.items()]


def _planes(tensors: list[torch.Tensor], n_planes: int, plane_bytes: np.ndarray) -> np.ndarray:
    """The tensors' byte planes, back to back: ``(n_planes, plane_bytes.sum())`` uint8, tensor
    ``i``'s bytes of plane ``p`` at ``[p, offset_i : offset_i + plane_bytes[i]]``. Split straight
    from each tensor's memory by one native call; without the library, joined and then split."""
    with torch.no_grad():
        flats = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        if any(map(has_lazy_bits, flats)):
            flats = [t.resolve_conj().resolve_neg() for t in flats]
    n_total = int(plane_bytes.sum())
    planes = np.empty((n_planes, n_total), dtype=np.uint8)
    fn = _native_split_many()
    if fn is not None:
        srcs = np.fromiter((t.data_ptr() for t in flats), dtype=np.int64, count=len(flats))
        counts = np.ascontiguousarray(plane_bytes, dtype=np.int64)  # elements, or bytes when 1 plane
        offsets = _exclusive_cumsum(counts)
        fn(srcs.ctypes.data, counts.ctypes.data, len(flats), n_planes, planes.ctypes.data, offsets.ctypes.data, n_total)
        return planes
    joined = torch.cat([t.reshape(-1).view(torch.uint8) for t in flats]) if flats else torch.empty(0, dtype=torch.uint8)
    return split_planes(joined.numpy(), n_planes, planes)


@dataclass
class _Chunks:
    """Every chunk of a group, in record order (item-major, then block-major, then plane): its
    item, plane, raw length, and where its stored bytes are (``src_of``: which of ``sources``,
    ``src_off``: the offset there; the planes first, then each codec's output)."""

    item: np.ndarray
    plane: np.ndarray
    raw_len: np.ndarray
    stored: np.ndarray
    sources: list[np.ndarray]
    src_of: np.ndarray
    src_off: np.ndarray
    first: np.ndarray  # bool: a chunk of its item's first block

    def keep(self, which: np.ndarray, streams: PackedStreams, only: np.ndarray | None = None) -> None:
        """Chunks ``which`` compressed to ``streams``: each stream kept where it is smaller
        than its raw chunk (as :func:`~nvdcp.pipeline.cpu.encode_item` does), and ``only[i]``."""
        lengths, packed = streams.lengths, streams.data
        pays = lengths < self.raw_len[which]
        if only is not None:
            pays &= only
        kept = which[pays]
        self.stored[kept] = lengths[pays]
        self.src_of[kept] = len(self.sources)
        self.src_off[kept] = _exclusive_cumsum(lengths)[:-1][pays]
        self.sources.append(packed)


def _chunk_plan(planes: np.ndarray, plane_bytes: np.ndarray, cb: int) -> _Chunks:
    """The chunks of items with ``plane_bytes[i]`` bytes per plane, back to back in ``planes``
    (``(n_planes, n)``), all stored raw until compressed (:func:`_compress`)."""
    n_planes, n_total = planes.shape
    n_blocks = -(-plane_bytes // cb)
    block_item = np.repeat(np.arange(len(plane_bytes)), n_blocks)
    block_index = np.arange(len(block_item)) - np.repeat(_exclusive_cumsum(n_blocks)[:-1], n_blocks)
    block_start = _exclusive_cumsum(plane_bytes)[:-1][block_item] + block_index * cb
    block_len = np.minimum(cb, plane_bytes[block_item] - block_index * cb)
    plane = np.tile(np.arange(n_planes), len(block_item))
    raw_len = np.repeat(block_len, n_planes)
    return _Chunks(
        item=np.repeat(block_item, n_planes), plane=plane, raw_len=raw_len, stored=raw_len.copy(),
        sources=[planes.reshape(-1)], src_of=np.zeros(len(raw_len), dtype=np.int64),
        src_off=plane * n_total + np.repeat(block_start, n_planes), first=np.repeat(block_index == 0, n_planes),
    )


def _compress(chunks: _Chunks, codecs: list[Codec | None], threads: int, n_items: int,
              probe: bool = False) -> np.ndarray:
    """Compress each plane's chunks with its codec in one call; a stream is kept where it is
    smaller than the raw chunk (as :func:`~nvdcp.pipeline.cpu.encode_item` does). With
    ``probe``, as that function does for a delta, an item's plane is compressed only where its
    first chunk shrinks by at least ``PROBE_MIN_GAIN`` (the first chunks of all items in one
    call, then the rest of the planes that pass): a difference's low mantissa bytes are
    near-random, and trying all their chunks cost as much codec time as the rest of the item.
    Returns which item planes were compressed: ``(n_items, len(codecs))`` bool."""
    compressed = np.zeros((n_items, len(codecs)), dtype=bool)
    empty = np.bincount(chunks.item, minlength=n_items) == 0  # nothing to probe: the layout stands
    flat = chunks.sources[0]
    for p, codec in enumerate(codecs):
        which = np.flatnonzero(chunks.plane == p)
        if codec is None:
            continue
        compressed[empty, p] = True
        if probe:
            head = which[chunks.first[which]]
            streams = _packed(codec.encode_ranges(flat, chunks.src_off[head], chunks.raw_len[head], threads))
            passed = streams.lengths <= chunks.raw_len[head] * (1 - PROBE_MIN_GAIN)
            chunks.keep(head, streams, only=passed)
            compressed[chunks.item[head[passed]], p] = True
            which = which[~chunks.first[which] & compressed[chunks.item[which], p]]
        else:
            compressed[:, p] = True
        if len(which):
            chunks.keep(which, _packed(codec.encode_ranges(flat, chunks.src_off[which], chunks.raw_len[which], threads)))
    return compressed


def _packed(streams: Sequence[Buffer] | PackedStreams) -> PackedStreams:
    """A codec's streams as one buffer and their lengths (as they come from a batch encoder)."""
    if isinstance(streams, PackedStreams):
        return streams
    lengths = np.fromiter(map(len, streams), dtype=np.int64, count=len(streams))
    return PackedStreams(np.frombuffer(b"".join(streams), dtype=np.uint8), lengths)


@dataclass(frozen=True)
class _Deltas:
    """What makes a group's records deltas (v2 headers): each item's base digest, the group's
    delta kind, and whether each item's difference was all zero (``EncodedItem.unchanged``)."""

    digests: list[int]
    kind: int
    unchanged: list[bool]


@dataclass
class _Group:
    """One group's records, back to back in ``out``: record ``i`` at ``start[i] .. end[i]``, its
    header first (``header_bytes[i]``), then chunks ``first_chunk[i] .. first_chunk[i + 1] - 1``
    at ``chunk_dst``."""

    out: np.ndarray  # uint8
    fields: list[HeaderFields]
    start: np.ndarray  # int64 per record
    end: np.ndarray  # int64 per record
    header_bytes: np.ndarray  # int64 per record
    chunk_dst: np.ndarray  # int64 per chunk
    table: np.ndarray  # (chunks, 2) uint32
    first_chunk: np.ndarray  # int64, one more than records
    header_crcs: np.ndarray  # uint32 per record
    deltas: _Deltas | None

    def records(self) -> list[EncodedItem]:
        """One :class:`EncodedItem` per record (their chunks and ``record`` view ``out``)."""
        view = self.out.data
        deltas = self.deltas
        records = []
        for i, (f, at, size, end, c0, c1, crc) in enumerate(zip(
            self.fields, self.start.tolist(), self.header_bytes.tolist(), self.end.tolist(),
            self.first_chunk[:-1].tolist(), self.first_chunk[1:].tolist(), self.header_crcs.tolist(),
        )):
            records.append(EncodedItem(header_of(f, self.table[c0:c1], size, crc), bytes(view[at : at + size]),
                                       [view[at + size : end]], unchanged=deltas is not None and deltas.unchanged[i],
                                       record=view[at:end]))
        return records

    def batch(self, jobs: Sequence[Any], chunk_bytes: int) -> RecordBatch:
        """The records as one batch (no object per record)."""
        return RecordBatch(jobs, self.fields, self.out, self.start, self.header_crcs, self.out.data, self.chunk_dst,
                           self.table, self.first_chunk, chunk_bytes, header_sizes=self.header_bytes)


def _encode_group_arrays(tensors: list[torch.Tensor], dtype_code: int, layout: Layout, cb: int, threads: int) -> _Group:
    """:func:`_encode_group`'s records as arrays."""
    n_planes = tensors[0].element_size() if layout.transform == TRANSFORM_BYTEPLANES else 1
    raw = np.fromiter((t.numel() * t.element_size() for t in tensors), dtype=np.int64, count=len(tensors))
    plane_bytes = raw // n_planes  # each item's bytes in every plane
    return _encode_planes(_planes(tensors, n_planes, plane_bytes), raw, dtype_code, layout, cb, threads,
                          [tuple(t.shape) for t in tensors])


def _encode_planes(planes: np.ndarray, raw: np.ndarray, dtype_code: int, layout: Layout, cb: int, threads: int,
                   shapes: list[tuple[int, ...]], deltas: _Deltas | None = None) -> _Group:
    """Records of items of ``raw[i]`` bytes each, their byte planes back to back in ``planes``
    (as :func:`_planes` makes them); with ``deltas``, the planes are the items' differences from
    their bases (:func:`~nvdcp.transform.delta.delta_split`)."""
    n_planes = planes.shape[0]
    ids = layout_codec_ids(layout.plane_codecs)
    assert len(ids) == n_planes, f"layout {layout} for {n_planes} planes"
    k = len(raw)
    plane_bytes = raw // n_planes
    chunks = _chunk_plan(planes, plane_bytes, cb)
    holds = planes_hold(deltas is not None, KIND_TENSOR, dtype_code, layout)
    compressed = _compress(chunks, plane_encoders(layout.plane_codecs, n_planes, holds), threads, k,
                           probe=deltas is not None)

    # Record layout: header (its chunk table at ``table_at``), then the item's chunks.
    raw_list = raw.tolist()
    if deltas is None:
        fields = [HeaderFields(KIND_TENSOR, dtype_code, layout.transform, ids, shape, cb, nbytes)
                  for shape, nbytes in zip(shapes, raw_list)]
    else:
        # a plane not compressed is recorded as stored raw ("none"), as encode_item's probe does
        item_ids = _item_codec_ids(ids, compressed)
        fields = [HeaderFields(KIND_TENSOR, dtype_code, layout.transform, i_ids, shape, cb, nbytes, digest, deltas.kind)
                  for i_ids, shape, nbytes, digest in zip(item_ids, shapes, raw_list, deltas.digests)]
    n_chunks = np.bincount(chunks.item, minlength=k)
    table_at, header_bytes = header_layout(fields, n_chunks)
    stored_cum = _exclusive_cumsum(chunks.stored)
    first_chunk = _exclusive_cumsum(n_chunks)
    record_off = _exclusive_cumsum(header_bytes + stored_cum[first_chunk[1:]] - stored_cum[first_chunk[:-1]])
    start = record_off[:-1]
    out = np.empty(int(record_off[-1]), dtype=np.uint8)
    chunk_dst = (start + header_bytes - stored_cum[first_chunk[:-1]])[chunks.item] + stored_cum[:-1]
    table = np.empty((len(chunks.stored), 2), dtype="<u4")
    table[:, 0] = chunks.stored
    table[:, 1] = copy_ranges_checksummed(out, chunk_dst, chunks.sources, chunks.src_of, chunks.src_off,
                                          chunks.stored, threads)
    header_crcs = pack_headers_into(out, start, fields, table_at, header_bytes, table, first_chunk, threads)
    return _Group(out, fields, start, record_off[1:], header_bytes, chunk_dst, table, first_chunk, header_crcs, deltas)


def _item_codec_ids(ids: tuple[int, ...], compressed: np.ndarray) -> list[tuple[int, ...]]:
    """Each item's plane codec ids: ``ids``, with ``none`` where its plane was not compressed
    (``compressed``: items x planes); one tuple per distinct row."""
    none = codec_id("none")
    rows, inverse = np.unique(compressed, axis=0, return_inverse=True)
    distinct = [tuple(c if on else none for c, on in zip(ids, row)) for row in rows.tolist()]
    return [distinct[i] for i in inverse.reshape(-1).tolist()]


def encode_delta_batch(
    tensors: Sequence[torch.Tensor], bases: Sequence[np.ndarray], base_digests: Sequence[int],
    dtype_codes: Sequence[int], layout_of: Callable[[torch.dtype], Layout | None], chunk_bytes: int, threads: int = 1,
    keeps: Sequence[np.ndarray | None] | None = None,
) -> list[EncodedItem]:
    """Delta records of host tensors against their bases (``bases[i]``: the base item's raw
    bytes, tensor ``i``'s size; ``base_digests[i]``: its record digest), in order: the items of a
    dtype differenced and split into planes in one pass
    (:func:`~nvdcp.transform.delta.delta_split`), then encoded together, as
    :func:`encode_tensor_batch` does; a plane whose first chunk does not shrink is stored raw
    without trying its other chunks, as in :func:`~nvdcp.pipeline.cpu.encode_item`, whose records
    these are byte for byte. ``keeps[i]``: where tensor ``i``'s raw bytes go for the next save, in
    the same pass (None: not kept; it may be the item's own base). ``layout_of(dtype)``: the delta
    layout (:func:`~nvdcp.pipeline.policy.choose_delta_layout`), one codec per plane. Whether a
    delta pays is the caller's to decide."""
    out: list[EncodedItem | None] = [None] * len(tensors)
    for members, dtype in _by_dtype(tensors):
        layout = layout_of(dtype)
        assert layout is not None, f"no delta layout for {dtype}"
        kind, size = delta_transform.kind_for(dtype), dtype.itemsize
        n_planes = size if layout.transform == TRANSFORM_BYTEPLANES else 1
        raws = [tensor_to_host_bytes(tensors[i]) for i in members]
        raw = np.fromiter(map(len, raws), dtype=np.int64, count=len(raws))
        planes = np.empty((n_planes, int(raw.sum()) // n_planes), dtype=np.uint8)
        changed = delta_transform.delta_split(raws, [bases[i] for i in members],
                                              [keeps[i] if keeps else None for i in members], kind, size, planes,
                                              _exclusive_cumsum(raw // n_planes))
        deltas = _Deltas([base_digests[i] for i in members], kind, (~changed).tolist())
        group = _encode_planes(planes, raw, dtype_codes[members[0]], layout, chunk_bytes, threads,
                               [tuple(tensors[i].shape) for i in members], deltas)
        for i, record in zip(members, group.records()):
            out[i] = record
    return out  # type: ignore[return-value]


# -- loading: a batch of records parsed, checked and decoded in arrays ---------------------------
#: The fixed fields of an item header (``nvdcp.format.header._ITEM_FIXED``) as a numpy record.
_FIXED = np.dtype([
    ("magic", "S4"), ("version", "<u2"), ("kind", "u1"), ("dtype", "u1"), ("transform", "u1"),
    ("n_planes", "u1"), ("ndim", "u1"), ("flags", "u1"), ("chunk_bytes", "<u4"), ("raw", "<u8"),
    ("header_bytes", "<u4"),
])
assert _FIXED.itemsize == ITEM_FIXED_SIZE


@dataclass
class HeaderColumns:
    """The header fields of records parsed together, one row per record (int64 unless named);
    shapes and plane codecs of them all back to back (record ``i``'s from ``shape_first[i]``
    and ``codec_first[i]``)."""

    kind: np.ndarray
    dtype_code: np.ndarray
    transform: np.ndarray
    n_planes: np.ndarray
    ndim: np.ndarray
    chunk_bytes: np.ndarray
    raw: np.ndarray
    header_bytes: np.ndarray
    stored_crc: np.ndarray  # uint32
    delta: np.ndarray  # bool
    base_digest: np.ndarray  # uint32
    delta_kind: np.ndarray  # uint32
    shapes: np.ndarray  # uint64
    shape_first: np.ndarray  # one more than records
    codecs: np.ndarray  # uint8
    codec_first: np.ndarray  # one more than records

    def codec_matrix(self, width: int) -> np.ndarray:
        """Plane codecs as a ``(records, width)`` uint8 matrix, zero past each record's planes."""
        out = np.zeros((len(self.n_planes), width), dtype=np.uint8)
        item = np.repeat(np.arange(len(self.n_planes)), self.n_planes)
        out[item, np.arange(len(item)) - self.codec_first[:-1][item]] = self.codecs
        return out


@dataclass
class ParsedRecords:
    """Records of one buffer parsed together: their header fields as columns, and every chunk
    of them all (in record order): stored size, CRC32C, offset in the buffer, and the record it
    belongs to. :attr:`headers` builds an :class:`ItemHeader` per record, once, when asked."""

    fields: HeaderColumns
    table: np.ndarray  # (chunks, 2) <u4: stored size and CRC32C, as in the records
    sizes: np.ndarray  # int64
    crcs: np.ndarray  # uint32
    starts: np.ndarray  # int64, in the buffer
    first_chunk: np.ndarray  # record i's chunks are [first_chunk[i], first_chunk[i + 1])

    @functools.cached_property
    def headers(self) -> list[ItemHeader]:
        f, table = self.fields, self.table
        shapes, codecs = f.shapes.tolist(), f.codecs.tolist()
        headers = []
        for (kd, code, tf, c, r, h, crc, s0, s1, p0, p1, c0, c1, is_delta, digest, dk) in zip(
            f.kind.tolist(), f.dtype_code.tolist(), f.transform.tolist(), f.chunk_bytes.tolist(), f.raw.tolist(),
            f.header_bytes.tolist(), f.stored_crc.tolist(), f.shape_first[:-1].tolist(), f.shape_first[1:].tolist(),
            f.codec_first[:-1].tolist(), f.codec_first[1:].tolist(), self.first_chunk[:-1].tolist(),
            self.first_chunk[1:].tolist(), f.delta.tolist(), f.base_digest.tolist(), f.delta_kind.tolist(),
        ):
            headers.append(ItemHeader(
                kind=kd, dtype_code=code, shape=tuple(shapes[s0:s1]), raw_nbytes=r, transform=tf,
                plane_codecs=tuple(codecs[p0:p1]), chunks=ChunkTable.of_array(table[c0:c1]),
                chunk_bytes=c, base_digest=digest if is_delta else None, delta_kind=dk if is_delta else 0,
                header_bytes=h, stored_crc=crc,
            ))
        return headers


def _gather_fields(buf: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """``(len(at), width)`` bytes of ``buf`` starting at each offset of ``at``."""
    return buf[at[:, None] + np.arange(width)]


def _ragged(starts: np.ndarray, counts: np.ndarray, width: int) -> np.ndarray:
    """Offsets of ``counts[i]`` consecutive fields of ``width`` bytes from ``starts[i]``, for all i."""
    local = np.arange(int(counts.sum())) - np.repeat(_exclusive_cumsum(counts)[:-1], counts)
    return np.repeat(starts, counts) + width * local


def parse_records(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> ParsedRecords | None:
    """Parse the item records ``buf[starts[i] : starts[i] + lengths[i]]`` together, with every
    check :func:`~nvdcp.format.header.parse_item_header` makes (magic, version, field ranges, the
    declared header size, the header CRC32C, the chunks against the record's length).

    Version 2 (delta) records are parsed too: their headers carry ``base_digest`` and
    ``delta_kind``; whether a delta is expected where one was found is the caller's to check.

    Returns None when any record does not pass them all: the caller parses those records one by
    one, which names the problem."""
    k = len(starts)
    if not k or int((starts + lengths).max()) > buf.size or int(lengths.min()) < ITEM_FIXED_SIZE + DELTA_FIELDS:
        # (no valid record is shorter: its plane codes, padded, and its CRC follow the fixed fields)
        return None
    fixed = np.ascontiguousarray(_gather_fields(buf, starts, ITEM_FIXED_SIZE)).view(_FIXED).reshape(k)
    kind, transform = fixed["kind"].astype(np.int64), fixed["transform"].astype(np.int64)
    n_planes, ndim = fixed["n_planes"].astype(np.int64), fixed["ndim"].astype(np.int64)
    cb, raw = fixed["chunk_bytes"].astype(np.int64), fixed["raw"]
    delta = fixed["version"] == DELTA_ITEM_VERSION
    if (
        (fixed["magic"] != ITEM_MAGIC).any() or ((fixed["version"] != FULL_ITEM_VERSION) & ~delta).any()
        or (fixed["flags"] != np.where(delta, FLAG_XOR_BASE, 0)).any()
        or (kind > 1).any() or (transform > 1).any() or (n_planes < 1).any() or (n_planes > MAX_PLANES).any()
        or (ndim > MAX_NDIM).any() or (cb < MIN_CHUNK_BYTES).any() or (cb > MAX_CHUNK_BYTES).any()
        or (raw > (1 << 62)).any()
    ):
        return None
    raw = raw.astype(np.int64)
    if (raw % n_planes).any():
        return None
    blobs = kind == KIND_BYTES
    if blobs.any() and ((n_planes[blobs] != 1) | (transform[blobs] != 0) | (ndim[blobs] != 0)
                        | (fixed["dtype"][blobs] != 0) | delta[blobs]).any():
        return None
    base_fields = np.ascontiguousarray(_gather_fields(buf, starts + ITEM_FIXED_SIZE, DELTA_FIELDS)).view("<u4")
    base_digest, delta_kind = base_fields.reshape(k, 2).T
    if (delta & ~np.isin(delta_kind, DELTA_KINDS)).any():
        return None
    shape_at = ITEM_FIXED_SIZE + DELTA_FIELDS * delta  # per record, from its start
    n_chunks = n_planes * -(-(raw // n_planes) // cb)
    table_at = shape_at + 8 * ndim + n_planes + (-n_planes) % 4
    header_bytes = table_at + ENTRY_SIZE * n_chunks + CRC_SIZE
    if (fixed["header_bytes"] != header_bytes).any() or (header_bytes > lengths).any():
        return None
    crc_at = starts + header_bytes - CRC_SIZE
    stored_crc = np.ascontiguousarray(_gather_fields(buf, crc_at, CRC_SIZE)).view("<u4").reshape(k)
    if (checksum_ranges(buf, starts, header_bytes - CRC_SIZE, threads=1) != stored_crc).any():
        return None
    entries = np.ascontiguousarray(_gather_fields(buf, _ragged(starts + table_at, n_chunks, ENTRY_SIZE), ENTRY_SIZE))
    table = entries.view("<u4").reshape(-1, 2)
    sizes = table[:, 0].astype(np.int64)
    first = _exclusive_cumsum(n_chunks)
    size_cum = _exclusive_cumsum(sizes)
    if ((size_cum[first[1:]] - size_cum[first[:-1]]) != lengths - header_bytes).any():
        return None
    chunk_item = np.repeat(np.arange(k), n_chunks)
    chunk_starts = (starts + header_bytes - size_cum[first[:-1]])[chunk_item] + size_cum[:-1]
    shapes = np.ascontiguousarray(_gather_fields(buf, _ragged(starts + shape_at, ndim, 8), 8)).view("<u8").reshape(-1)
    codecs = buf[_ragged(starts + shape_at + 8 * ndim, n_planes, 1)]
    fields = HeaderColumns(
        kind, fixed["dtype"].astype(np.int64), transform, n_planes, ndim, cb, raw, header_bytes, stored_crc, delta,
        base_digest, delta_kind, shapes, _exclusive_cumsum(ndim), codecs, _exclusive_cumsum(n_planes),
    )
    return ParsedRecords(fields, table, sizes, table[:, 1].astype(np.uint32), chunk_starts, first)


@functools.cache
def _native_merge_many() -> Callable[..., int] | None:
    fn = load_function(_FORMAT_DIR, "_crc32c_batch", "nvdcp_merge_planes_many")
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_ZSTD_ID = codec_id("zstd")


@functools.cache
def _native_merge_apply_many() -> Callable[..., int] | None:
    fn = load_function(_FORMAT_DIR, "_crc32c_batch", "nvdcp_merge_apply_many")
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def decode_records(buf: np.ndarray, parsed: ParsedRecords, outs: Sequence[np.ndarray | int], threads: int = 1,
                   apply: Sequence[tuple[int, int] | None] | None = None) -> None:
    """Decode every record of ``parsed`` into ``outs[i]`` (its raw bytes: flat contiguous uint8
    of the record's size, or the address of such memory, e.g. a dense tensor's ``data_ptr()``,
    whose size the caller checked). The chunks' CRC32Cs must have been checked and the codecs be decodable
    here (:func:`~nvdcp.pipeline.cpu.check_decodable`). Where every compressed chunk is a zstd
    frame, one native call per plane count decodes each block into a small scratch and
    interleaves its planes into place (:func:`~nvdcp.codecs.zstd_blocks.block_decoder`); else each
    codec decodes all its chunks in one call (:meth:`~nvdcp.codecs.base.Codec.decode_ranges`) and
    the planes of every block are then interleaved into place by one native call per plane count.
    ``apply[i]``, when given as ``(delta kind, element size)``: record ``i`` is a delta, applied to the bytes ``outs[i]``
    already holds (its base's, :func:`~nvdcp.transform.delta.apply_np`) as its planes are
    interleaved, instead of written there.

    Raises:
        ValueError: a chunk does not decode to its size (the caller decodes the records one by
            one to name it).
    """
    fields = parsed.fields
    k = len(fields.raw)
    n_planes = fields.n_planes
    plane_bytes = fields.raw // n_planes
    cb = fields.chunk_bytes
    counts = parsed.first_chunk[1:] - parsed.first_chunk[:-1]
    chunk_item = np.repeat(np.arange(k), counts)
    local = np.arange(len(chunk_item)) - parsed.first_chunk[:-1][chunk_item]
    e = n_planes[chunk_item]
    block, plane = local // e, local % e
    block_raw = np.minimum(cb[chunk_item], plane_bytes[chunk_item] - block * cb[chunk_item])
    if (parsed.sizes > block_raw).any():
        raise ValueError("a chunk stores more bytes than it holds")
    pointers = buf.ctypes.data + parsed.starts
    keep: list[object] = []  # the decoded streams' memory, until merged
    compressed = parsed.sizes != block_raw
    in_place = None  # decodes zstd frames block by block into place (nvdcp.codecs.zstd_blocks)
    if compressed.any():
        ids = fields.codec_matrix(MAX_PLANES)[chunk_item[compressed], plane[compressed]].astype(np.int64)
        in_place = block_decoder() if (ids == _ZSTD_ID).all() else None
        if in_place is None:
            which = np.flatnonzero(compressed)
            for cid in np.unique(ids).tolist():
                sel = which[ids == cid]
                decoded = plane_cpu_codecs((cid,))[0].decode_ranges(buf, parsed.starts[sel], parsed.sizes[sel],
                                                                    block_raw[sel], threads)
                keep.append(decoded.owner)
                pointers[sel] = decoded.addresses
    out_addr = np.fromiter((o if isinstance(o, int) else o.ctypes.data for o in outs), dtype=np.int64, count=len(outs))
    firsts = local % e == 0  # the first chunk of every block
    dsts = out_addr[chunk_item[firsts]] + block[firsts] * cb[chunk_item[firsts]] * e[firsts]
    # per block: its plane count, and the delta kind and element size its record applies (-1, 0: none)
    how = np.full((k, 2), (-1, 0), dtype=np.int64)
    for i, kind_size in enumerate(apply or ()):
        if kind_size is not None:
            how[i] = kind_size
    block_firsts = np.flatnonzero(firsts)
    keys = np.column_stack((e[firsts], how[chunk_item[firsts]]))
    for width, kind, size in np.unique(keys, axis=0).tolist():
        mine = (keys == (width, kind, size)).all(axis=1)
        blocks = block_firsts[mine]
        if in_place is not None:
            chunks = (blocks[:, None] + np.arange(width)).reshape(-1)
            in_place.decode(pointers[chunks], parsed.sizes[chunks], compressed[chunks], block_raw[blocks], dsts[mine],
                            width, kind, _apply_width(kind, size), threads)
        elif kind < 0:
            _merge_blocks(pointers, blocks, block_raw[blocks], dsts[mine], width)
        else:
            _merge_apply_blocks(pointers, blocks, block_raw[blocks], dsts[mine], width, kind, size)


def _apply_width(kind: int, element_size: int) -> int:
    """The width of the elements a delta of ``kind`` is applied over: the element for a zigzag
    difference, a byte for XOR."""
    return element_size if kind == delta_transform.ZIGZAG_DIFF else 1


def _merge_apply_blocks(pointers: np.ndarray, first: np.ndarray, ns: np.ndarray, dsts: np.ndarray, width: int,
                        kind: int, element_size: int) -> None:
    """:func:`_merge_blocks`, each block applied as a delta of ``kind`` over ``element_size``-byte
    elements to the bytes at ``dsts[i]`` (one native pass; else merged, then applied with numpy)."""
    fn = _native_merge_apply_many()
    apply_width = _apply_width(kind, element_size)
    if fn is not None:
        planes = np.ascontiguousarray(pointers[first[:, None] + np.arange(width)])
        done = fn(planes.ctypes.data, np.ascontiguousarray(ns, dtype=np.int64).ctypes.data,
                  np.ascontiguousarray(dsts).ctypes.data, len(ns), width, kind, apply_width)
        if done != 0:
            raise ValueError(f"delta kind {kind} over {element_size}-byte elements cannot be applied")
        return
    for block, n, dst in zip(first.tolist(), ns.tolist(), dsts.tolist()):
        merged = np.empty(n * width, dtype=np.uint8)
        _merge_blocks(pointers, np.array([block]), np.array([n]), np.array([merged.ctypes.data]), width)
        value = np.ctypeslib.as_array((ctypes.c_uint8 * (n * width)).from_address(dst))
        delta_transform.apply_np(value, merged, kind, element_size)


def _merge_blocks(pointers: np.ndarray, first: np.ndarray, ns: np.ndarray, dsts: np.ndarray, width: int) -> None:
    """Interleave the ``width`` planes of each block (plane pointers ``pointers[first[i] + p]``,
    ``ns[i]`` bytes each) into ``ns[i]`` elements at address ``dsts[i]``."""
    planes = np.ascontiguousarray(pointers[first[:, None] + np.arange(width)])
    fn = _native_merge_many()
    if fn is not None:
        ns = np.ascontiguousarray(ns, dtype=np.int64)
        fn(planes.ctypes.data, ns.ctypes.data, np.ascontiguousarray(dsts).ctypes.data, len(ns), width)
        return
    for row, n, dst in zip(planes.tolist(), ns.tolist(), dsts.tolist()):
        views = [np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(p)) for p in row]
        merge_planes(views, np.ctypeslib.as_array((ctypes.c_uint8 * (n * width)).from_address(dst)))


__all__ = ["ParsedRecords", "decode_records", "encode_tensor_batch", "parse_records"]

"""CPU item encoder and decoder: numpy byte planes + CPU codecs on a thread pool.

The codecs release the GIL, so chunks of one item compress on all cores at once. Work goes to
the pool in groups of chunks (``_GROUP_BYTES``) to keep per-task overhead small.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from nvdcp.codecs import GPU_ONLY, codec_class, codec_id, codec_name, cpu_codec
from nvdcp.errors import CodecUnavailableError, CorruptCheckpointError, UnknownCodecError
from nvdcp.format.crc import checksum_ranges
from nvdcp.format.header import (
    DEFAULT_CHUNK_BYTES,
    TRANSFORM_BYTEPLANES,
    ItemHeader,
    checksum,
    parse_item_header,
)
from nvdcp.pipeline.policy import Layout
from nvdcp.transform import byteplanes

_GROUP_BYTES = 1 << 20


@dataclass
class EncodedItem:
    """An item ready to append to a data file: its header and its stored chunks, in order."""

    header: ItemHeader
    header_bytes: bytes
    chunks: list[bytes | memoryview]

    @property
    def nbytes(self) -> int:
        return len(self.header_bytes) + self.header.stored_nbytes


def block_chunks(planes: np.ndarray, chunk_bytes: int) -> list[memoryview]:
    """Chunks of a ``(n_planes, n)`` plane array in stored (block-major) order."""
    n_planes, n = planes.shape
    views = [memoryview(plane) for plane in planes]
    return [views[p][b : b + chunk_bytes] for b in range(0, n, chunk_bytes) for p in range(n_planes)]


def _encode_group(jobs: Sequence[tuple[str, memoryview]]) -> list[tuple[bytes | memoryview, int]]:
    out: list[tuple[bytes | memoryview, int]] = []
    for name, chunk in jobs:
        stored: bytes | memoryview = cpu_codec(name).encode(chunk) if name != "none" else chunk
        if len(stored) >= len(chunk):
            stored = chunk  # compression did not pay: keep the raw bytes (see ItemHeader)
        out.append((stored, checksum(stored)))
    return out


def _groups(jobs: list[tuple[str, memoryview]], chunk_bytes: int) -> list[list[tuple[str, memoryview]]]:
    per = max(1, _GROUP_BYTES // chunk_bytes)
    return [jobs[i : i + per] for i in range(0, len(jobs), per)]


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
) -> EncodedItem:
    """Encode one item's raw bytes (a flat uint8 array) with ``layout``."""
    if layout.transform == TRANSFORM_BYTEPLANES:
        planes = byteplanes.split(raw, element_size)
    else:
        planes = raw.reshape(1, -1)
    for name in layout.plane_codecs:
        if name in GPU_ONLY:
            raise CodecUnavailableError(f"codec {name!r} can only encode on a GPU")
    names = layout.plane_codecs
    chunks = block_chunks(planes, chunk_bytes)
    groups = _groups([(names[i % len(names)], c) for i, c in enumerate(chunks)], chunk_bytes)
    if pool is None or len(groups) < 2:
        results = [_encode_group(g) for g in groups]
    else:
        results = list(pool.map(_encode_group, groups))
    stored = [pair for group in results for pair in group]
    header = ItemHeader(
        kind=kind,
        dtype_code=dtype_code,
        shape=shape,
        raw_nbytes=raw.size,
        transform=layout.transform,
        plane_codecs=tuple(codec_id(n) for n in layout.plane_codecs),
        chunks=tuple((len(s), crc) for s, crc in stored),
        chunk_bytes=chunk_bytes,
    )
    return EncodedItem(header, header.pack(), [s for s, _ in stored])


def _decode_group(
    header: ItemHeader, payload: memoryview, staging: memoryview, where: str,
    start: int, stop: int, offsets: list[int],
) -> None:
    """Verify and decode chunks ``start:stop`` into ``staging`` (block-major, plane-major within)."""
    n_planes = header.n_planes
    for i in range(start, stop):
        block, plane = divmod(i, n_planes)
        size, crc = header.chunks[i]
        data = payload[offsets[i] : offsets[i] + size]
        if checksum(data) != crc:
            raise CorruptCheckpointError(f"{where}: chunk {i} (block {block}, plane {plane}) checksum mismatch")
        raw_size = header.block_elements(block)
        dst_start = (block * header.chunk_bytes * n_planes) + plane * raw_size
        dst = staging[dst_start : dst_start + raw_size]
        if size == raw_size:
            dst[:] = data
            continue
        if size > raw_size:
            raise CorruptCheckpointError(
                f"{where}: chunk {i} (block {block}, plane {plane}) stores {size} bytes for {raw_size} raw"
            )
        name = codec_name(header.plane_codecs[plane])
        try:
            cpu_codec(name).decode(data, dst)
        except CodecUnavailableError as exc:
            raise CodecUnavailableError(f"{where}: {exc}") from None
        except ValueError as exc:
            raise CorruptCheckpointError(
                f"{where}: chunk {i} (block {block}, plane {plane}, codec {name}) does not decode: {exc}"
            ) from exc


def verify_chunks(record: memoryview, where: str) -> ItemHeader:
    """Check an item record's header and every chunk's CRC32C without decoding anything."""
    header = parse_item_header(record, where)
    if not header.chunks:
        return header
    payload = np.frombuffer(record[header.header_bytes :], dtype=np.uint8)
    sizes = np.asarray([size for size, _ in header.chunks], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    bad = np.flatnonzero(checksum_ranges(payload, offsets, sizes) != np.asarray([c for _, c in header.chunks], dtype=np.uint32))
    if len(bad):
        block, plane = divmod(int(bad[0]), header.n_planes)
        raise CorruptCheckpointError(f"{where}: chunk {int(bad[0])} (block {block}, plane {plane}) checksum mismatch")
    return header


def decode_item(
    record: memoryview, where: str, pool: Executor | None, element_size: int = 1
) -> tuple[ItemHeader, np.ndarray]:
    """Verify and decode one stored item record; returns its header and raw bytes (flat uint8).

    Every chunk's CRC32C is checked before its bytes reach a decoder.
    """
    header = parse_item_header(record, where)
    for cid in set(header.plane_codecs):
        try:
            cls = codec_class(cid)
        except UnknownCodecError:
            raise CorruptCheckpointError(f"{where}: unknown codec id {cid}") from None
        if not cls.cpu_decodable:
            raise CodecUnavailableError(
                f"{where}: stored with codec {cls.name!r}, which has no CPU decoder; load it on a "
                "machine with an NVIDIA GPU (or convert it there with another codec)"
            )
    n_planes = len(header.plane_codecs)
    if header.transform == TRANSFORM_BYTEPLANES and n_planes != element_size:
        raise CorruptCheckpointError(f"{where}: {n_planes} byte planes for {element_size}-byte elements")
    payload = record[header.header_bytes :]
    offsets = [0]
    for size, _ in header.chunks:
        offsets.append(offsets[-1] + size)
    buf = np.empty(header.raw_nbytes, dtype=np.uint8)
    out = buf.data
    n = len(header.chunks)
    per = max(1, _GROUP_BYTES // header.chunk_bytes)
    spans = [(s, min(n, s + per)) for s in range(0, n, per)]
    args = (header, payload, out, where)
    if pool is None or len(spans) < 2:
        for s, e in spans:
            _decode_group(*args, s, e, offsets)
    else:
        for f in [pool.submit(_decode_group, *args, s, e, offsets) for s, e in spans]:
            f.result()
    if header.transform == TRANSFORM_BYTEPLANES:
        merged = np.empty_like(buf)
        block_bytes = header.chunk_bytes * n_planes
        for start in range(0, header.raw_nbytes, block_bytes):
            stop = min(start + block_bytes, header.raw_nbytes)
            byteplanes.merge(buf[start:stop], n_planes, merged[start:stop])
        buf = merged
    return header, buf

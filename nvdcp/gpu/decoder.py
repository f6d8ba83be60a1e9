"""GPU item decoder: chunks go host -> device in one copy, nvCOMP decodes them in batched calls,
and the byte planes are merged back into elements on the device.

Many items are decoded together: their chunks share one staging buffer, one host-to-device copy
and one nvCOMP call per codec, which matters for the hundreds of small tensors (biases, norms)
of a model. Items larger than the scratch budget are decoded in block ranges. Chunk bytes land
in their staging slots straight from storage (a scatter read), and each chunk's CRC32C is checked
there before the copy to the device, so nvCOMP never sees bytes that differ from what was written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import nvidia.nvcomp as nv
import torch

from nvdcp.codecs import codec_name
from nvdcp.errors import CorruptCheckpointError
from nvdcp.format.crc import checksum_ranges
from nvdcp.format.header import TRANSFORM_BYTEPLANES, ItemHeader
from nvdcp.gpu.nvcomp_codecs import CodecCache, typed_data_type
from nvdcp.gpu.pinned import PinnedPool

#: Staging and decoded slots start at multiples of this many bytes: nvCOMP refuses unaligned inputs
#: (GDeflate wants 4 bytes; a checkpoint written with chunk_bytes=1025 failed to decode), and 256
#: keeps every codec's alignment wish.
SLOT_ALIGN = 256


@dataclass
class DecodeRequest:
    """One item to decode: its header, what it holds, and where its chunk bytes come from.

    ``payload`` holds the chunk bytes (everything after the header) in memory; or ``fill`` reads
    them straight into staging: ``fill(first_chunk, buffers)`` fills ``buffers`` with the stored
    bytes of chunks ``first_chunk, first_chunk + 1, ...`` (a scatter read from storage).
    """

    header: ItemHeader
    dtype: torch.dtype | None
    where: str
    payload: np.ndarray | None = None
    fill: Callable[[int, list[memoryview]], None] | None = None

    def read_chunks(self, first: int, offsets: np.ndarray, buffers: list[memoryview]) -> None:
        if self.fill is not None:
            self.fill(first, buffers)
            return
        assert self.payload is not None
        pos = int(offsets[first])
        for buf in buffers:
            buf[:] = self.payload[pos : pos + len(buf)].data
            pos += len(buf)


@dataclass
class _Segment:
    req: DecodeRequest
    offsets: np.ndarray
    first: int  # first block
    last: int  # one past the last block
    out: torch.Tensor

    @property
    def slots(self) -> int:
        return (self.last - self.first) * self.req.header.n_planes


class GpuDecoder:
    """Decodes container records into raw element bytes on one device (one per thread)."""

    def __init__(self, device: torch.device, *, budget_bytes: int, gdeflate_type: int = 0,
                 pinned_bytes: int = 512 << 20, pinned: PinnedPool | None = None) -> None:
        self.device = device
        #: Pinned staging buffers (the reader passes a pool its decoders share).
        self.pinned = pinned if pinned is not None else PinnedPool(pinned_bytes)
        # A pass holds staging + decoded slots on the device and its staging in pinned memory.
        self.budget = min(budget_bytes, 2 * pinned_bytes)
        self.gdeflate_type = gdeflate_type
        self.stream = torch.cuda.Stream(device)
        self.codecs: dict[int, CodecCache] = {}

    def decode(self, payload: np.ndarray, header: ItemHeader, dtype: torch.dtype | None, where: str) -> torch.Tensor:
        """Decode one in-memory item; returns a flat uint8 tensor of ``header.raw_nbytes`` here."""
        return self.decode_many([DecodeRequest(header, dtype, where, payload=payload)])[0]

    def decode_many(self, requests: list[DecodeRequest]) -> list[torch.Tensor]:
        """Decode several items in as few passes (staging copies, nvCOMP calls) as the budget allows."""
        outs = []
        passes: list[list[_Segment]] = [[]]
        used = 0
        with torch.cuda.stream(self.stream):
            for req in requests:
                h = req.header
                out = torch.empty(h.raw_nbytes, dtype=torch.uint8, device=self.device)
                outs.append(out)
                offsets = np.zeros(len(h.chunks) + 1, dtype=np.int64)
                np.cumsum([s for s, _ in h.chunks], out=offsets[1:])
                slot_cost = 2 * _slot_stride(h.chunk_bytes)  # staging on the device + decoded slot
                per_pass = max(1, self.budget // (slot_cost * h.n_planes))
                for first in range(0, h.n_blocks, per_pass):
                    last = min(h.n_blocks, first + per_pass)
                    seg = _Segment(req, offsets, first, last, out)
                    cost = seg.slots * slot_cost
                    if passes[-1] and (used + cost > self.budget or passes[-1][0].req.header.chunk_bytes != h.chunk_bytes):
                        passes.append([])
                        used = 0
                    passes[-1].append(seg)
                    used += cost
            for segments in passes:
                if segments:
                    self._run_pass(segments)
        self.stream.synchronize()
        return outs

    def _run_pass(self, segments: list[_Segment]) -> None:
        c = segments[0].req.header.chunk_bytes
        stride = _slot_stride(c)
        n = sum(seg.slots for seg in segments)
        staging = self.pinned.acquire(n * stride)
        try:
            host = staging.numpy().data
            raw_sizes: list[int] = []
            groups: dict[tuple[str, str | None], list[int]] = {}
            raw_slots: list[int] = []
            k = 0
            for seg in segments:
                h = seg.req.header
                p = h.n_planes
                for i in range(seg.first * p, seg.last * p):
                    size = h.chunks[i][0]
                    raw = h.block_elements(i // p)
                    raw_sizes.append(raw)
                    if size == raw:
                        raw_slots.append(k)
                    elif size > raw:  # checked before reading: a chunk never spills into the next slot
                        raise CorruptCheckpointError(f"{seg.req.where}: chunk {i} stores {size} bytes for {raw} raw")
                    else:
                        name = codec_name(h.plane_codecs[i % p])
                        groups.setdefault((name, typed_data_type(name, seg.req.dtype)), []).append(k)
                    k += 1
            k = 0
            for seg in segments:
                h = seg.req.header
                first, last = seg.first * h.n_planes, seg.last * h.n_planes
                views = [host[(k + j) * stride : (k + j) * stride + h.chunks[i][0]]
                         for j, i in enumerate(range(first, last))]
                seg.req.read_chunks(first, seg.offsets, views)
                k += last - first
            _check_crcs(staging.numpy(), stride, segments)
            up = torch.empty((n, stride), dtype=torch.uint8, device=self.device)
            up.view(-1).copy_(staging[: n * stride], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
            dec = self._decode_slots(up, c, groups, raw_slots, raw_sizes, segments)
            base = 0
            for seg in segments:
                _merge(dec[base : base + seg.slots, :c], seg.req.header, seg.first, seg.last, seg.out)
                base += seg.slots
            copied.synchronize()  # the pinned staging buffer may be reused after this
        finally:
            self.pinned.release(staging)

    def _decode_slots(self, up: torch.Tensor, c: int, groups: dict[tuple[str, str | None], list[int]],
                      raw_slots: list[int], raw_sizes: list[int], segments: list[_Segment]) -> torch.Tensor:
        """Decode the staged slots (rows of ``up``, chunk size ``c``) into rows of the same layout."""
        if not groups:
            return up
        stride = up.shape[1]
        dec = torch.empty_like(up)
        if raw_slots:
            idx = torch.tensor(raw_slots, device=self.device)
            dec[idx] = up[idx]
        cache = self.codecs.setdefault(c, CodecCache(self.device.index or 0, self.stream, c, self.gdeflate_type))
        comp_sizes = [0] * len(raw_sizes)
        k = 0
        for seg in segments:
            h = seg.req.header
            for i in range(seg.first * h.n_planes, seg.last * h.n_planes):
                comp_sizes[k] = h.chunks[i][0]
                k += 1
        for (name, data_type), ks in groups.items():
            codec, _cap = cache.get(name, data_type)
            src = nv.as_arrays(up.view(-1), [k * stride for k in ks], [comp_sizes[k] for k in ks],
                               cuda_stream=self.stream.cuda_stream)
            dst = nv.as_arrays(dec.view(-1), [k * stride for k in ks], [raw_sizes[k] for k in ks],
                               cuda_stream=self.stream.cuda_stream)
            try:
                got = codec.decode(src, out=dst).buffer_sizes
            except Exception as exc:  # nvCOMP reports bad streams as RuntimeError/ValueError
                where = segments[0].req.where if len(segments) == 1 else f"{len(segments)} items"
                raise CorruptCheckpointError(f"{where}: nvCOMP {name} decode failed: {exc}") from exc
            bad = [k for k, g in zip(ks, got) if g != raw_sizes[k]]
            if bad:
                raise CorruptCheckpointError(f"{_owner(segments, bad[0])}: a {name} chunk decoded to the wrong size on the GPU")
        return dec


def _slot_stride(chunk_bytes: int) -> int:
    """Bytes between consecutive slots: the chunk size rounded up to :data:`SLOT_ALIGN`."""
    return -(-chunk_bytes // SLOT_ALIGN) * SLOT_ALIGN


def _check_crcs(staging: np.ndarray, c: int, segments: list[_Segment]) -> None:
    """Every staged chunk's CRC32C against its header (one batched call for the whole pass)."""
    stored: list[int] = []
    expected: list[int] = []
    for seg in segments:
        chunks = seg.req.header.chunks[seg.first * seg.req.header.n_planes : seg.last * seg.req.header.n_planes]
        stored.extend(size for size, _ in chunks)
        expected.extend(crc for _, crc in chunks)
    got = checksum_ranges(staging, np.arange(len(stored), dtype=np.int64) * c, np.asarray(stored, dtype=np.int64))
    bad = np.flatnonzero(got != np.asarray(expected, dtype=np.uint32))
    if len(bad):
        slot = int(bad[0])
        for seg in segments:
            if slot < seg.slots:
                p = seg.req.header.n_planes
                i = seg.first * p + slot
                block, plane = divmod(i, p)
                raise CorruptCheckpointError(f"{seg.req.where}: chunk {i} (block {block}, plane {plane}) checksum mismatch")
            slot -= seg.slots


def _owner(segments: list[_Segment], slot: int) -> str:
    for seg in segments:
        if slot < seg.slots:
            return seg.req.where
        slot -= seg.slots
    return "?"


def _merge(dec: torch.Tensor, header: ItemHeader, first: int, last: int, out: torch.Tensor) -> None:
    """Write blocks ``first:last`` (decoded slots ``dec``) into ``out`` as element bytes."""
    c = header.chunk_bytes
    p = header.n_planes
    start = first * c * p
    m = min(header.plane_nbytes, last * c) - first * c
    full, tail = divmod(m, c)
    dst = out[start : start + m * p]
    if header.transform != TRANSFORM_BYTEPLANES:
        dst.copy_(dec.reshape(-1)[:m])  # a copy when the slots are padded (dec is then a strided view)
        return
    if full:
        dst[: full * c * p].view(full, c, p).copy_(dec[: full * p].view(full, p, c).permute(0, 2, 1))
    if tail:
        dst[full * c * p :].view(tail, p).copy_(dec[full * p : (full + 1) * p, :tail].t())

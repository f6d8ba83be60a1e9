"""GPU item decoder: chunks go host -> device in one copy, nvCOMP decodes them in batched calls,
and the byte planes are merged back into elements on the device.

Many items are decoded together: their chunks share one staging buffer, one host-to-device copy
and one nvCOMP call per codec, which matters for the hundreds of small tensors (biases, norms)
of a model. Items larger than the scratch budget are decoded in *passes* over block ranges.
Chunk bytes land in their staging slots straight from storage (a scatter read). Each chunk's
CRC32C is checked before nvCOMP sees it: on the device after the host-to-device copy (a Triton
kernel, :mod:`nvdcp.gpu.crc32c`; only a mismatch count and the first failing chunk come back),
or on the host before the copy where that kernel does not run. Either way nvCOMP never decodes
bytes that differ from what was written.

Passes overlap: while the host reads pass k+1 into its staging buffer, the device copies pass k
in and checks it; pass k is decoded once its check came back clean (by then the host has read the
next pass), and nvCOMP's output sizes are checked one pass later. Decoded items go straight into
the caller's destination tensors when given (``DecodeRequest.out``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import nvidia.nvcomp as nv
import torch

from nvdcp.codecs import codec_name
from nvdcp.errors import CorruptCheckpointError
from nvdcp.format.crc import checksum_ranges
from nvdcp.format.header import TRANSFORM_BYTEPLANES, ItemHeader
from nvdcp.gpu import crc32c
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
    ``out``: where the item's raw bytes go (a contiguous uint8 tensor of ``header.raw_nbytes`` on
    the decoder's device, e.g. a flat view of the destination tensor); None: a new tensor.
    """

    header: ItemHeader
    dtype: torch.dtype | None
    where: str
    payload: np.ndarray | None = None
    fill: Callable[[int, list[memoryview]], None] | None = None
    out: torch.Tensor | None = None

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
    sizes: np.ndarray  # stored bytes of every chunk of the item (int64)
    crcs: np.ndarray  # CRC32C of every chunk of the item (uint32)

    @property
    def slots(self) -> int:
        return (self.last - self.first) * self.req.header.n_planes


def _chunk_table(header: ItemHeader) -> tuple[np.ndarray, np.ndarray]:
    """Stored size (int64) and CRC32C (uint32) of every chunk of ``header``."""
    table = np.asarray(header.chunks, dtype=np.uint32).reshape(-1, 2)
    return table[:, 0].astype(np.int64), np.ascontiguousarray(table[:, 1])


@dataclass(eq=False)
class _Pass:
    """One staging buffer's worth of chunks, from the host read to nvCOMP's size check."""

    segments: list[_Segment]
    stride: int
    staging: torch.Tensor  # pinned; released once the upload is done
    stored: np.ndarray  # stored bytes per slot
    raw: np.ndarray  # raw bytes per slot
    expected: np.ndarray  # CRC32C per slot (uint32)
    groups: dict[tuple[str, str | None], np.ndarray]  # compressed slots per codec
    raw_slots: np.ndarray
    up: torch.Tensor | None = None
    bad: torch.Tensor | None = None  # pinned host copy of the device check: [mismatches, first slot]
    checked: torch.cuda.Event | None = None
    decoded: list[tuple[str, np.ndarray, Any]] = field(default_factory=list)  # nvCOMP results to check
    keep: list[Any] = field(default_factory=list)  # nvCOMP arrays alive until their decode is checked


class GpuDecoder:
    """Decodes container records into raw element bytes on one device (one per thread)."""

    def __init__(self, device: torch.device, *, budget_bytes: int, gdeflate_type: int = 0,
                 pinned_bytes: int = 512 << 20, pinned: PinnedPool | None = None) -> None:
        self.device = device
        #: Pinned staging buffers (the reader passes a pool its decoders share).
        self.pinned = pinned if pinned is not None else PinnedPool(pinned_bytes)
        # Up to three passes hold device memory at once (one checked, one decoding, one uploaded;
        # each: staging + decoded slots) and two hold pinned staging (one uploading, one filling).
        self.budget = max(8 * _slot_stride(65536), min(budget_bytes // 3, pinned_bytes))
        self.gdeflate_type = gdeflate_type
        self.stream = torch.cuda.Stream(device)
        self.codecs: dict[int, CodecCache] = {}
        #: chunk checksums checked on the device (the Triton kernel) rather than on the host
        self.device_crc = crc32c.device_crc_available()

    def decode(self, payload: np.ndarray, header: ItemHeader, dtype: torch.dtype | None, where: str) -> torch.Tensor:
        """Decode one in-memory item; returns a flat uint8 tensor of ``header.raw_nbytes`` here."""
        return self.decode_many([DecodeRequest(header, dtype, where, payload=payload)])[0]

    def decode_many(self, requests: list[DecodeRequest]) -> list[torch.Tensor]:
        """Decode several items in as few passes (staging copies, nvCOMP calls) as the budget
        allows; returns each item's raw bytes (its ``out`` when given), complete on return."""
        outs = []
        passes: list[list[_Segment]] = [[]]
        used = 0
        # destinations may have been written on the caller's stream (e.g. zeroed)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for req in requests:
                h = req.header
                out = req.out
                if out is None:
                    out = torch.empty(h.raw_nbytes, dtype=torch.uint8, device=self.device)
                elif out.dtype != torch.uint8 or out.numel() != h.raw_nbytes or not out.is_contiguous() or out.device != self.device:
                    raise ValueError(f"{req.where}: out must be a contiguous uint8 tensor of {h.raw_nbytes} bytes on {self.device}")
                outs.append(out)
                sizes, crcs = _chunk_table(h)
                offsets = np.zeros(len(h.chunks) + 1, dtype=np.int64)
                np.cumsum(sizes, out=offsets[1:])
                slot_cost = 2 * _slot_stride(h.chunk_bytes)  # staging on the device + decoded slot
                per_pass = max(1, self.budget // (slot_cost * h.n_planes))
                for first in range(0, h.n_blocks, per_pass):
                    last = min(h.n_blocks, first + per_pass)
                    seg = _Segment(req, offsets, first, last, out.view(-1), sizes, crcs)
                    cost = seg.slots * slot_cost
                    if passes[-1] and (used + cost > self.budget or passes[-1][0].req.header.chunk_bytes != h.chunk_bytes):
                        passes.append([])
                        used = 0
                    passes[-1].append(seg)
                    used += cost
            self._run([segs for segs in passes if segs])
        return outs

    def _run(self, passes: list[list[_Segment]]) -> None:
        uploaded: _Pass | None = None  # copied in, its check queued, not decoded yet
        decoding: _Pass | None = None  # decode queued, nvCOMP's sizes not checked yet
        held: list[_Pass] = []
        try:
            for segments in passes:
                staged = self._stage(segments)
                held.append(staged)
                if uploaded is not None:
                    self._await_check(uploaded)
                    if decoding is not None:
                        self._check_decoded(decoding)
                        held.remove(decoding)
                    self._decode(uploaded)
                    decoding = uploaded
                self._upload(staged)
                uploaded = staged
            if uploaded is not None:
                self._await_check(uploaded)
                if decoding is not None:
                    self._check_decoded(decoding)
                    held.remove(decoding)
                self._decode(uploaded)
                self._check_decoded(uploaded)
                held.remove(uploaded)
            self.stream.synchronize()
        except BaseException:
            self.stream.synchronize()  # nothing may still copy out of staging buffers we give back
            raise
        finally:
            for p in held:
                self._release(p)

    # -- host: read and lay out one pass -------------------------------------------------------
    def _stage(self, segments: list[_Segment]) -> _Pass:
        c = segments[0].req.header.chunk_bytes
        stride = _slot_stride(c)
        stored_l, raw_l, crc_l, key_l = [], [], [], []
        keys: dict[tuple[str, str | None], int] = {}
        for seg in segments:
            h = seg.req.header
            p = h.n_planes
            lo, hi = seg.first * p, seg.last * p
            stored_l.append(seg.sizes[lo:hi])
            crc_l.append(seg.crcs[lo:hi])
            blocks = np.arange(seg.first, seg.last, dtype=np.int64)
            raw_l.append(np.repeat(np.minimum(c, h.plane_nbytes - blocks * c), p))
            plane_keys = []
            for cid in h.plane_codecs:
                name = codec_name(cid)
                plane_keys.append(-1 if name == "none" else keys.setdefault((name, typed_data_type(name, seg.req.dtype)), len(keys)))
            key_l.append(np.tile(np.asarray(plane_keys, dtype=np.int64), seg.last - seg.first))
        stored, raw, expected, key = (np.concatenate(x) for x in (stored_l, raw_l, crc_l, key_l))
        over = np.flatnonzero((stored > raw) | ((key < 0) & (stored != raw)))
        if len(over):  # checked before reading: a chunk never spills into the next slot
            seg, i = _slot_owner(segments, int(over[0]))
            raise CorruptCheckpointError(
                f"{seg.req.where}: chunk {i} stores {int(stored[over[0]])} bytes for {int(raw[over[0]])} raw"
            )
        compressed = stored < raw
        groups = {k: np.flatnonzero(compressed & (key == kid)) for k, kid in keys.items()}
        raw_slots = np.flatnonzero(~compressed)
        n = len(stored)
        staging = self.pinned.acquire(n * stride)
        try:
            host = staging.numpy().data
            starts = (np.arange(n, dtype=np.int64) * stride).tolist()
            sizes_l = stored.tolist()
            k = 0
            for seg in segments:
                p = seg.req.header.n_planes
                first, m = seg.first * p, seg.slots
                views = [host[starts[j] : starts[j] + sizes_l[j]] for j in range(k, k + m)]
                seg.req.read_chunks(first, seg.offsets, views)
                k += m
            if not self.device_crc:
                got = checksum_ranges(staging.numpy(), np.arange(n, dtype=np.int64) * stride, stored)
                bad = np.flatnonzero(got != expected)
                if len(bad):
                    _raise_checksum(segments, int(bad[0]))
        except BaseException:
            self.pinned.release(staging)
            raise
        return _Pass(segments, stride, staging, stored, raw, expected, groups, raw_slots)

    # -- device: upload, check, decode, merge --------------------------------------------------
    def _upload(self, p: _Pass) -> None:
        n = len(p.stored)
        p.up = torch.empty((n, p.stride), dtype=torch.uint8, device=self.device)
        p.up.view(-1).copy_(p.staging[: n * p.stride], non_blocking=True)
        if self.device_crc:
            expected = torch.from_numpy(p.expected.view(np.int32))
            _, bad = crc32c.checksum_ranges_device(p.up.view(-1), np.arange(n, dtype=np.int64) * p.stride,
                                                   p.stored, expected)
            assert bad is not None
            p.bad = torch.empty(2, dtype=torch.int32, pin_memory=True)
            p.bad.copy_(bad, non_blocking=True)
        p.checked = torch.cuda.Event()
        p.checked.record(self.stream)

    def _await_check(self, p: _Pass) -> None:
        """Wait for the pass's upload (and device check); raise on a checksum mismatch."""
        assert p.checked is not None
        p.checked.synchronize()
        self._release(p)  # the upload is done: the staging buffer may be reused
        if p.bad is not None and int(p.bad[0]):
            _raise_checksum(p.segments, int(p.bad[1]))

    def _release(self, p: _Pass) -> None:
        if p.staging is not None:
            self.pinned.release(p.staging)
            p.staging = None  # type: ignore[assignment]

    def _decode(self, p: _Pass) -> None:
        assert p.up is not None
        c = p.segments[0].req.header.chunk_bytes
        up, stride = p.up, p.stride
        if not p.groups or all(len(ks) == 0 for ks in p.groups.values()):
            dec = up
        else:
            dec = torch.empty_like(up)
            if len(p.raw_slots):
                idx = torch.from_numpy(p.raw_slots).to(self.device, non_blocking=True)
                dec[idx] = up[idx]
            cache = self.codecs.setdefault(c, CodecCache(self.device.index or 0, self.stream, c, self.gdeflate_type))
            for (name, data_type), ks in p.groups.items():
                if not len(ks):
                    continue
                codec, _cap = cache.get(name, data_type)
                starts = (ks * stride).tolist()
                src = nv.as_arrays(up.view(-1), starts, p.stored[ks].tolist(), cuda_stream=self.stream.cuda_stream)
                dst = nv.as_arrays(dec.view(-1), starts, p.raw[ks].tolist(), cuda_stream=self.stream.cuda_stream)
                try:
                    result = codec.decode(src, out=dst)
                except Exception as exc:  # nvCOMP reports bad streams as RuntimeError/ValueError
                    raise CorruptCheckpointError(f"{_where(p.segments)}: nvCOMP {name} decode failed: {exc}") from exc
                p.decoded.append((name, ks, result))
                p.keep += [src, dst]
        base = 0
        for seg in p.segments:
            _merge(dec[base : base + seg.slots, :c], seg.req.header, seg.first, seg.last, seg.out)
            base += seg.slots
        p.up = None

    def _check_decoded(self, p: _Pass) -> None:
        """nvCOMP's output sizes for the pass (waits for its decode)."""
        for name, ks, result in p.decoded:
            try:
                got = np.asarray(result.buffer_sizes, dtype=np.int64)
            except Exception as exc:
                raise CorruptCheckpointError(f"{_where(p.segments)}: nvCOMP {name} decode failed: {exc}") from exc
            bad = np.flatnonzero(got != p.raw[ks])
            if len(bad):
                seg, i = _slot_owner(p.segments, int(ks[bad[0]]))
                raise CorruptCheckpointError(f"{seg.req.where}: chunk {i}: a {name} chunk decoded to the wrong size on the GPU")
        p.decoded.clear()
        p.keep.clear()


def _slot_stride(chunk_bytes: int) -> int:
    """Bytes between consecutive slots: the chunk size rounded up to :data:`SLOT_ALIGN`."""
    return -(-chunk_bytes // SLOT_ALIGN) * SLOT_ALIGN


def _slot_owner(segments: list[_Segment], slot: int) -> tuple[_Segment, int]:
    """The segment holding a pass's ``slot``, and that slot's chunk index in its item."""
    for seg in segments:
        if slot < seg.slots:
            return seg, seg.first * seg.req.header.n_planes + slot
        slot -= seg.slots
    raise IndexError(slot)


def _raise_checksum(segments: list[_Segment], slot: int) -> None:
    seg, i = _slot_owner(segments, slot)
    block, plane = divmod(i, seg.req.header.n_planes)
    raise CorruptCheckpointError(f"{seg.req.where}: chunk {i} (block {block}, plane {plane}) checksum mismatch")


def _where(segments: list[_Segment]) -> str:
    names = list(dict.fromkeys(seg.req.where for seg in segments))
    return names[0] if len(names) == 1 else f"{len(names)} items ({names[0]}, ...)"


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

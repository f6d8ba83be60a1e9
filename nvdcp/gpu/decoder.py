"""GPU item decoder: chunks go host -> device in one copy, nvCOMP decodes them in batched calls,
and the byte planes are merged back into elements on the device.

Many items are decoded together: their chunks share one staging buffer, one host-to-device copy
and one nvCOMP call per codec, which matters for the thousands of small tensors (biases, norms,
MoE experts) of a model. Items larger than the scratch budget are decoded in *passes* over block
ranges. Chunk bytes land in their staging slots straight from storage (a scatter read). Each
chunk's CRC32C is checked before nvCOMP sees it: on the device after the host-to-device copy (a
Triton kernel, :mod:`nvdcp.gpu.crc32c`; only a mismatch count and the first failing chunk come
back), or on the host before the copy where that kernel does not run. Either way nvCOMP never
decodes bytes that differ from what was written.

Per pass, not per item: the slot tables are built with numpy over all the pass's items; the
checksum offsets, expected values and the merge table travel in the tail of the pinned staging
buffer with the chunks (one host-to-device copy, no pageable copies that could wait for the
stream); one Triton kernel per plane count (:mod:`nvdcp.gpu.merge`) writes every block of every
item of the pass into its destination, reading raw chunks from the staging slots and compressed
ones from nvCOMP's output. Without Triton the decoder merges item by item with torch.

Passes overlap: while the host reads pass k+1 into its staging buffer, the device copies pass k
in and checks it; pass k is decoded once its check came back clean (by then the host has read the
next pass), and nvCOMP's output sizes are checked one pass later. Decoded items go straight into
the caller's destination tensors when given (``DecodeRequest.out``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import nvidia.nvcomp as nv
import torch

from nvdcp.codecs import codec_name
from nvdcp.errors import CorruptCheckpointError
from nvdcp.format.crc import checksum_ranges
from nvdcp.format.header import MAX_PLANES, TRANSFORM_BYTEPLANES, ItemHeader
from nvdcp.gpu import crc32c
from nvdcp.gpu.allocator import install_allocator
from nvdcp.gpu.merge import PLANE_COUNTS, merge_available, merge_rows
from nvdcp.gpu.nvcomp_codecs import CodecCache, typed_data_type
from nvdcp.gpu.pinned import PinnedPool
from nvdcp.pipeline.cpu_batch import copy_ranges
from nvdcp.storage.spans import ChunkSpans

#: Staging and decoded slots start at multiples of this many bytes: nvCOMP refuses unaligned inputs
#: (GDeflate wants 4 bytes; a checkpoint written with chunk_bytes=1025 failed to decode), and 256
#: keeps every codec's alignment wish.
SLOT_ALIGN = 256
#: Pinned rows for the device check's result ([mismatches, first failing slot]) per decoder: more
#: than the passes alive at once (staged, uploaded, decoding).
_BAD_RING = 8


@dataclass
class DecodeRequest:
    """One item to decode: its header, what it holds, and where its chunk bytes come from.

    ``payload`` holds the chunk bytes (everything after the header) in memory; or ``fill`` reads
    them straight into staging: ``fill(first_chunk, buffers)`` fills ``buffers`` with the stored
    bytes of chunks ``first_chunk, first_chunk + 1, ...`` (a scatter read from storage).
    ``out``: where the item's raw bytes go (a contiguous tensor of ``header.raw_nbytes`` bytes on
    the decoder's device, of any dtype and shape: e.g. the destination tensor itself); None: a
    new flat uint8 tensor.
    ``where`` names the item in errors (a string, or any object whose ``str`` does: built only
    when an error needs it). ``table``: the chunk table as arrays (stored sizes int64, CRC32Cs
    uint32) when the caller has it (e.g. read in place from the record); else built from the header.
    """

    header: ItemHeader
    dtype: torch.dtype | None
    where: Any
    payload: np.ndarray | None = None
    fill: Callable[[int, Sequence[memoryview]], None] | None = None
    out: torch.Tensor | None = None
    table: tuple[np.ndarray, np.ndarray] | None = None

    def read_chunks(self, first: int, sizes: np.ndarray, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` with the stored bytes of chunks ``first, first + 1, ...`` (``sizes``:
        every chunk's stored size)."""
        if self.fill is not None:
            self.fill(first, buffers)
            return
        assert self.payload is not None
        src = self.payload.data
        pos = int(sizes[:first].sum()) if first else 0
        for buf in buffers:
            n = len(buf)
            buf[:] = src[pos : pos + n]
            pos += n


@dataclass(eq=False)
class _Segment:
    req: DecodeRequest
    first: int  # first block
    last: int  # one past the last block
    out: torch.Tensor  # the item's flat uint8 destination
    out_addr: int  # its address
    sizes: np.ndarray  # stored bytes of every chunk of the item (int64)
    crcs: np.ndarray  # CRC32C of every chunk of the item (uint32)

    @property
    def slots(self) -> int:
        return (self.last - self.first) * self.req.header.n_planes


def _copy_payloads(staging: np.ndarray, starts: np.ndarray, stored: np.ndarray,
                   in_memory: list[tuple[int, _Segment]]) -> None:
    """Copy the chunks of segments whose bytes are in memory (``(first slot, segment)``) into
    their staging slots (``starts``: each slot's offset; ``stored``: its stored bytes): one
    native call for all of them, with the GIL released (a slice copy per chunk held it for
    every byte of a small-tensor load, and made a view per chunk)."""
    firsts = np.fromiter((k for k, _ in in_memory), dtype=np.int64, count=len(in_memory))
    counts = np.fromiter((seg.slots for _, seg in in_memory), dtype=np.int64, count=len(in_memory))
    # where each segment's first chunk starts in its payload (not 0 for a later block range)
    skip = np.fromiter((int(seg.sizes[: seg.first * seg.req.header.n_planes].sum()) if seg.first else 0
                        for _, seg in in_memory), dtype=np.int64, count=len(in_memory))
    slots = np.repeat(firsts - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()), dtype=np.int64)
    sizes = stored[slots]
    before = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=before[1:])
    seg_of = np.repeat(np.arange(len(in_memory)), counts)
    src_off = before[:-1] - np.repeat(before[np.cumsum(counts) - counts], counts) + skip[seg_of]
    payloads = [seg.req.payload for _, seg in in_memory]
    has = counts > 0
    last = (np.cumsum(counts) - 1)[has]  # each segment's last slot
    lengths = np.fromiter((len(p) for p in payloads), dtype=np.int64, count=len(payloads))[has]  # type: ignore[arg-type]
    short = np.flatnonzero(src_off[last] + sizes[last] > lengths)
    if len(short):  # a chunk table that claims more than the record holds: nothing copied
        seg = in_memory[int(np.flatnonzero(has)[short[0]])][1]
        raise CorruptCheckpointError(f"{seg.req.where}: its chunks claim more bytes than its record holds")
    copy_ranges(staging, starts[slots], payloads, seg_of, src_off, sizes)  # type: ignore[arg-type]


def _chunk_table(header: ItemHeader) -> tuple[np.ndarray, np.ndarray]:
    """Stored size (int64) and CRC32C (uint32) of every chunk of ``header``."""
    return header.chunks.sizes.astype(np.int64), np.ascontiguousarray(header.chunks.crcs)


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
    checked: Any = None  # event recorded after the upload and its check
    decoded: list[tuple[str, np.ndarray, Any]] = field(default_factory=list)  # nvCOMP results to check
    keep: list[Any] = field(default_factory=list)  # nvCOMP arrays alive until their decode is checked
    # the fused layout (device check and merge kernel): a device buffer per pass holding the
    # uploaded slots and the tables that came with them, and one for nvCOMP's output slots
    dev: torch.Tensor | None = None
    dec: torch.Tensor | None = None
    tail: int = 0  # where the tables start (in staging and dev)
    tail_end: int = 0  # bytes uploaded
    merges: list[tuple[int, int, int, int]] = field(default_factory=list)  # planes, table offset, rows, max count


class _HostStream:
    """Stands in for a CUDA stream when the decoder runs on CPU tensors (tests, with
    ``TRITON_INTERPRET=1`` and a stand-in for nvCOMP)."""

    cuda_stream = 0

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


class _HostEvent:
    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class GpuDecoder:
    """Decodes container records into raw element bytes on one device (one per thread)."""

    def __init__(self, device: torch.device, *, budget_bytes: int, gdeflate_type: int = 0,
                 pinned_bytes: int = 512 << 20, pinned: PinnedPool | None = None) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        if self._cuda:
            # nvCOMP's temporaries from caching allocators: its default cudaFree/cudaFreeHost
            # synchronize the whole device, serializing the decoders of all threads.
            install_allocator(device)
        #: Pinned staging buffers (the reader passes a pool its decoders share).
        self.pinned = pinned if pinned is not None else PinnedPool(pinned_bytes)
        # Up to three passes hold device memory at once (one staged, one checked, one decoding;
        # each: staging + decoded slots) and two hold pinned staging (one uploading, one filling).
        self.budget = max(8 * _slot_stride(65536), min(budget_bytes // 3, pinned_bytes))
        self.gdeflate_type = gdeflate_type
        self.stream: Any = torch.cuda.Stream(device) if self._cuda else _HostStream()
        self.codecs: dict[int, CodecCache] = {}
        #: chunk checksums checked on the device (the Triton kernel) rather than on the host
        self.device_crc = crc32c.device_crc_available()
        #: the fused layout: device check, tables in the staging tail, one merge kernel per pass
        self.fused = self.device_crc and merge_available()
        self._bad = torch.zeros((_BAD_RING, 2), dtype=torch.int32, pin_memory=self._cuda)
        self._bad_next = 0
        # codec key (name, nvCOMP data_type) -> id, and per (plane codecs, dtype) a row of plane keys
        self._key_ids: dict[tuple[str, str | None], int] = {}
        self._key_names: list[tuple[str, str | None]] = []
        self._row_of: dict[tuple[tuple[int, ...], torch.dtype | None], int] = {}
        self._rows: list[list[int]] = []
        self._key_table: np.ndarray | None = None

    def decode(self, payload: np.ndarray, header: ItemHeader, dtype: torch.dtype | None, where: str) -> torch.Tensor:
        """Decode one in-memory item; returns a flat uint8 tensor of ``header.raw_nbytes`` here."""
        return self.decode_many([DecodeRequest(header, dtype, where, payload=payload)])[0]

    def decode_many(self, requests: list[DecodeRequest]) -> list[torch.Tensor]:
        """Decode several items in as few passes (staging copies, nvCOMP calls) as the budget
        allows; returns each item's raw bytes (its ``out`` when given), complete on return."""
        # new outputs on the caller's stream (it uses them after this returns), one allocation
        outs = self._outputs(requests)
        passes = self._plan(requests, outs)
        if self._cuda:
            # destinations may have been written on the caller's stream (e.g. zeroed)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._on_stream():
            self._run(passes)
        return outs

    def _on_stream(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream) if self._cuda else contextlib.nullcontext()

    def _event(self) -> Any:
        if not self._cuda:
            return _HostEvent()
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def _outputs(self, requests: list[DecodeRequest]) -> list[torch.Tensor]:
        outs: list[Any] = []
        fresh: list[int] = []
        for i, req in enumerate(requests):
            out = req.out
            n = req.header.raw_nbytes
            if out is None:
                fresh.append(i)
            elif out.numel() * out.element_size() != n or not out.is_contiguous() or out.device != self.device:
                raise ValueError(f"{req.where}: out must be a contiguous tensor of {n} bytes on {self.device}")
            elif not self.fused and (out.dtype != torch.uint8 or out.dim() != 1):
                # the fused merge writes by address; _merge copies into flat bytes
                out = out.reshape(-1).view(torch.uint8)
            outs.append(out)
        if fresh:
            # aligned starts: the caller views each as its dtype
            sizes = np.asarray([requests[i].header.raw_nbytes for i in fresh], dtype=np.int64)
            room = -(-sizes // SLOT_ALIGN) * SLOT_ALIGN
            starts = (np.cumsum(room) - room).tolist()
            block = torch.empty(int(room.sum()), dtype=torch.uint8, device=self.device)
            for i, at, n in zip(fresh, starts, sizes.tolist()):
                outs[i] = block[at : at + n]
        return outs

    def _plan(self, requests: list[DecodeRequest], outs: list[torch.Tensor]) -> list[list[_Segment]]:
        """Cut the requests into passes of at most the budget (and of one chunk size each)."""
        passes: list[list[_Segment]] = [[]]
        used = 0
        budget = self.budget
        pass_chunk = 0  # chunk size of the open pass
        for req, out in zip(requests, outs):
            h = req.header
            c = h.chunk_bytes
            p = len(h.plane_codecs)
            n_blocks = -(-(h.raw_nbytes // p) // c)
            if n_blocks == 0:
                continue
            if p not in PLANE_COUNTS or (h.transform != TRANSFORM_BYTEPLANES and p != 1):
                raise CorruptCheckpointError(f"{req.where}: {p} planes with transform {h.transform} cannot be decoded")
            sizes, crcs = req.table if req.table is not None else _chunk_table(h)
            addr = out.data_ptr()
            slot_cost = 2 * _slot_stride(c)  # staging on the device + decoded slot
            per_pass = max(1, budget // (slot_cost * p))
            for first in range(0, n_blocks, per_pass):
                last = min(n_blocks, first + per_pass)
                cost = (last - first) * p * slot_cost
                if passes[-1] and (used + cost > budget or pass_chunk != c):
                    passes.append([])
                    used = 0
                passes[-1].append(_Segment(req, first, last, out, addr, sizes, crcs))
                pass_chunk = c
                used += cost
        return [segs for segs in passes if segs]

    def _decode_after(self, uploaded: _Pass, decoding: _Pass | None, held: list[_Pass]) -> _Pass:
        """Queue the decode of ``uploaded`` once its CRC check came back clean, after checking
        (and giving back) the pass decoded before it; returns the pass now decoding."""
        self._await_check(uploaded)
        if decoding is not None:
            self._check_decoded(decoding)
            held.remove(decoding)
        self._decode(uploaded)
        return uploaded

    def _run(self, passes: list[list[_Segment]]) -> None:
        uploaded: _Pass | None = None  # copied in, its check queued, not decoded yet
        decoding: _Pass | None = None  # decode queued, nvCOMP's sizes not checked yet
        held: list[_Pass] = []
        try:
            for segments in passes:
                staged = self._stage(segments)
                held.append(staged)
                if uploaded is not None:
                    decoding = self._decode_after(uploaded, decoding, held)
                self._upload(staged)
                uploaded = staged
            if uploaded is not None:
                self._decode_after(uploaded, decoding, held)
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
    def _plane_row(self, plane_codecs: tuple[int, ...], dtype: torch.dtype | None) -> int:
        """The row of plane keys (codec key id per plane, -1: stored raw) for these plane codecs
        and dtype; one dictionary look-up per item once seen."""
        k = (plane_codecs, dtype)
        row = self._row_of.get(k)
        if row is None:
            keys = []
            for cid in plane_codecs:
                name = codec_name(cid)
                if name == "none":
                    keys.append(-1)
                    continue
                key = (name, typed_data_type(name, dtype))
                if key not in self._key_ids:
                    self._key_ids[key] = len(self._key_names)
                    self._key_names.append(key)
                keys.append(self._key_ids[key])
            row = self._row_of[k] = len(self._rows)
            self._rows.append(keys + [-1] * (MAX_PLANES - len(keys)))
            self._key_table = None
        return row

    def _stage(self, segments: list[_Segment]) -> _Pass:
        c = segments[0].req.header.chunk_bytes
        stride = _slot_stride(c)
        # per segment: python scalars and one slice of its chunk table; per slot: numpy
        stored_l, crc_l, counts, firsts, planes, plane_bytes, rows = [], [], [], [], [], [], []
        for seg in segments:
            h = seg.req.header
            p = h.n_planes
            lo, hi = seg.first * p, seg.last * p
            stored_l.append(seg.sizes[lo:hi])
            crc_l.append(seg.crcs[lo:hi])
            counts.append(hi - lo)
            firsts.append(seg.first)
            planes.append(p)
            plane_bytes.append(h.plane_nbytes)
            rows.append(self._plane_row(h.plane_codecs, seg.req.dtype))
        stored = np.concatenate(stored_l) if len(stored_l) > 1 else stored_l[0]
        expected = np.concatenate(crc_l) if len(crc_l) > 1 else crc_l[0]
        n = len(stored)
        per_seg = np.asarray(counts, dtype=np.int64)
        seg_of = np.repeat(np.arange(len(segments)), per_seg)
        j = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(per_seg) - per_seg, per_seg)
        p_slot = np.asarray(planes, dtype=np.int64)[seg_of]
        block = np.asarray(firsts, dtype=np.int64)[seg_of] + j // p_slot
        plane = j % p_slot
        raw = np.minimum(c, np.asarray(plane_bytes, dtype=np.int64)[seg_of] - block * c)
        if self._key_table is None:
            self._key_table = np.asarray(self._rows, dtype=np.int64).reshape(-1, MAX_PLANES)
        key = self._key_table[np.asarray(rows, dtype=np.int64)[seg_of], plane]
        over = np.flatnonzero((stored > raw) | ((key < 0) & (stored != raw)))
        if len(over):  # checked before reading: a chunk never spills into the next slot
            seg, i = _slot_owner(segments, int(over[0]))
            raise CorruptCheckpointError(
                f"{seg.req.where}: chunk {i} stores {int(stored[over[0]])} bytes for {int(raw[over[0]])} raw"
            )
        compressed = stored < raw
        groups = {self._key_names[int(k)]: np.flatnonzero(compressed & (key == k))
                  for k in np.unique(key[compressed]).tolist()}
        raw_slots = np.flatnonzero(~compressed)
        pas = _Pass(segments, stride, None, stored, raw, expected, groups, raw_slots)  # type: ignore[arg-type]
        if self.fused:
            staging = self._lay_out_fused(pas, seg_of, block, plane, p_slot, compressed)
        else:
            staging = self.pinned.acquire(n * stride)
        pas.staging = staging
        try:
            host = staging.numpy().data
            starts = np.arange(n, dtype=np.int64) * stride
            in_memory: list[tuple[int, _Segment]] = []  # (first slot, segment) of payloads
            k = 0
            for seg in segments:
                m = seg.slots
                if seg.req.payload is not None:
                    in_memory.append((k, seg))
                else:
                    # the segment's slots as spans of the staging buffer (local files read them
                    # with one vectored call over numpy iovec rows: no Python object per chunk)
                    slots = ChunkSpans()
                    slots.add(host, starts[k : k + m], stored[k : k + m])
                    seg.req.read_chunks(seg.first * seg.req.header.n_planes, seg.sizes, slots)
                k += m
            if in_memory:
                _copy_payloads(staging.numpy(), starts, stored, in_memory)
            if not self.device_crc:
                got = checksum_ranges(staging.numpy(), np.arange(n, dtype=np.int64) * stride, stored)
                bad = np.flatnonzero(got != expected)
                if len(bad):
                    _raise_checksum(segments, int(bad[0]))
        except BaseException:
            self._release(pas)
            raise
        return pas

    def _lay_out_fused(self, p: _Pass, seg_of: np.ndarray, block: np.ndarray, plane: np.ndarray,
                       p_slot: np.ndarray, compressed: np.ndarray) -> torch.Tensor:
        """The pass's device buffer and its staging buffer, whose tail holds the tables the device
        needs (checksum ranges and expected values, the merge table), written here."""
        n, stride, c = len(p.stored), p.stride, p.segments[0].req.header.chunk_bytes
        firsts = np.flatnonzero(plane == 0)  # each block's first slot
        p_block = p_slot[firsts]
        kinds = np.unique(p_block).tolist()
        tail = n * stride
        table_bytes = 8 * n + 8 * n + 4 * (n + (n & 1))  # offsets, lengths, expected (int32, padded)
        sel_of: dict[int, np.ndarray] = {}
        for planes in kinds:
            sel_of[planes] = firsts[p_block == planes]
            table_bytes += 8 * len(sel_of[planes]) * (2 + planes)
        tail_end = tail + table_bytes
        p.dev = torch.empty(tail_end, dtype=torch.uint8, device=self.device)
        if compressed.any():
            p.dec = torch.empty(n * stride, dtype=torch.uint8, device=self.device)
        p.tail, p.tail_end = tail, tail_end
        staging = self.pinned.acquire(tail_end)
        try:
            host = staging.numpy()
            at = tail
            host[at : at + 8 * n].view(np.int64)[:] = np.arange(n, dtype=np.int64) * stride
            at += 8 * n
            host[at : at + 8 * n].view(np.int64)[:] = p.stored
            at += 8 * n
            host[at : at + 4 * n].view(np.uint32)[:] = p.expected
            at += 4 * (n + (n & 1))
            base = p.dev.data_ptr()
            dec_base = p.dec.data_ptr() if p.dec is not None else base
            src = np.where(compressed, dec_base, base) + np.arange(n, dtype=np.int64) * stride
            out_addr = np.asarray([seg.out_addr for seg in p.segments], dtype=np.int64)
            for planes in kinds:
                sel = sel_of[planes]
                rows = len(sel)
                table = host[at : at + 8 * rows * (2 + planes)].view(np.int64).reshape(rows, 2 + planes)
                table[:, 0] = out_addr[seg_of[sel]] + block[sel] * (c * planes)
                table[:, 1] = p.raw[sel]
                table[:, 2:] = src[sel[:, None] + np.arange(planes, dtype=np.int64)[None, :]]
                p.merges.append((planes, at, rows, int(p.raw[sel].max())))
                at += 8 * rows * (2 + planes)
            assert at == tail_end
        except BaseException:
            self.pinned.release(staging)
            raise
        return staging

    # -- device: upload, check, decode, merge --------------------------------------------------
    def _upload(self, p: _Pass) -> None:
        n = len(p.stored)
        bad = self._bad[self._bad_next % _BAD_RING]
        self._bad_next += 1
        if self.fused:
            assert p.dev is not None
            p.dev[: p.tail_end].copy_(p.staging[: p.tail_end], non_blocking=True)
            at = p.tail
            offsets = p.dev[at : at + 8 * n].view(torch.int64)
            lengths = p.dev[at + 8 * n : at + 16 * n].view(torch.int64)
            expected = p.dev[at + 16 * n : at + 20 * n].view(torch.int32)
            crcs, _ = crc32c.checksum_ranges_device(p.dev[: n * p.stride], offsets, lengths)
            mismatch = crcs != expected
            bad.copy_(torch.stack((mismatch.sum(dtype=torch.int32), mismatch.to(torch.int32).argmax().to(torch.int32))),
                      non_blocking=True)
            p.bad = bad
        else:
            p.up = torch.empty((n, p.stride), dtype=torch.uint8, device=self.device)
            p.up.view(-1).copy_(p.staging[: n * p.stride], non_blocking=True)
            if self.device_crc:
                expected_host = torch.from_numpy(p.expected.view(np.int32))
                _, dev_bad = crc32c.checksum_ranges_device(p.up.view(-1), np.arange(n, dtype=np.int64) * p.stride,
                                                           p.stored, expected_host)
                assert dev_bad is not None
                bad.copy_(dev_bad, non_blocking=True)
                p.bad = bad
        p.checked = self._event()

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

    def _codec_cache(self, chunk_bytes: int) -> CodecCache:
        cache = self.codecs.get(chunk_bytes)
        if cache is None:
            cache = self.codecs[chunk_bytes] = CodecCache(self.device.index or 0, self.stream, chunk_bytes,
                                                          self.gdeflate_type)
        return cache

    def _decode_groups(self, p: _Pass, src_buf: torch.Tensor, dst_buf: torch.Tensor) -> None:
        """One nvCOMP call per codec over the pass's compressed slots, ``src_buf`` -> ``dst_buf``
        (flat, slot ``k`` at ``k * stride`` in both)."""
        cache = self._codec_cache(p.segments[0].req.header.chunk_bytes)
        for (name, data_type), ks in p.groups.items():
            codec, _cap = cache.get(name, data_type)
            starts = (ks * p.stride).tolist()
            src = nv.as_arrays(src_buf, starts, p.stored[ks].tolist(), cuda_stream=self.stream.cuda_stream)
            dst = nv.as_arrays(dst_buf, starts, p.raw[ks].tolist(), cuda_stream=self.stream.cuda_stream)
            try:
                result = codec.decode(src, out=dst)
            except Exception as exc:  # nvCOMP reports bad streams as RuntimeError/ValueError
                raise CorruptCheckpointError(f"{_where(p.segments)}: nvCOMP {name} decode failed: {exc}") from exc
            p.decoded.append((name, ks, result))
            p.keep += [src, dst]

    def _decode(self, p: _Pass) -> None:
        if self.fused:
            dev = p.dev
            assert dev is not None
            n = len(p.stored)
            if p.groups:
                assert p.dec is not None
                self._decode_groups(p, dev[: n * p.stride], p.dec)
            for planes, at, rows, longest in p.merges:
                merge_rows(dev[at : at + 8 * rows * (2 + planes)].view(torch.int64).view(rows, 2 + planes),
                           planes, longest)
            p.dev = p.dec = None  # stream-ordered: reused only by work queued after the merge
            return
        assert p.up is not None
        c = p.segments[0].req.header.chunk_bytes
        up = p.up
        if not p.groups:
            dec = up
        else:
            dec = torch.empty_like(up)
            if len(p.raw_slots):
                idx = torch.from_numpy(p.raw_slots).to(self.device, non_blocking=True)
                dec[idx] = up[idx]
            self._decode_groups(p, up.view(-1), dec.view(-1))
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

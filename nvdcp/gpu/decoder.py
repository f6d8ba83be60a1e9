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
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nvdcp.codecs import codec_name
from nvdcp.errors import CorruptCheckpointError
from nvdcp.format.crc import checksum_ranges
from nvdcp.format.dtypes import code_dtype
from nvdcp.format.header import MAX_PLANES, TRANSFORM_BYTEPLANES, ItemHeader
from nvdcp.gpu import crc32c
from nvdcp.gpu.columns import RecordColumns
from nvdcp.gpu.merge import PLANE_COUNTS, merge_available, merge_rows
from nvdcp.gpu.nvcomp_batch import WORKSPACES, BatchResult, NvcompCallError, side_streams_on
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
class _Owners:
    """Which item and chunk each slot of a pass holds, for error messages only: slot ``k`` holds
    chunk ``chunk[k]`` (of ``planes[k]`` planes per block) of item ``item[k]``, named by
    ``name(item[k])``."""

    item: np.ndarray
    chunk: np.ndarray
    planes: np.ndarray
    name: Callable[[int], Any]

    def where(self, slot: int) -> tuple[Any, int, int]:
        """The slot's item name, chunk index and planes per block."""
        return self.name(int(self.item[slot])), int(self.chunk[slot]), int(self.planes[slot])

    def all(self) -> str:
        """The pass's items, named for an error about the whole pass."""
        first, last = int(self.item[0]), int(self.item[-1])
        count = len(np.unique(self.item)) if first != last else 1
        return str(self.name(first)) if count == 1 else f"{count} items ({self.name(first)}, ...)"


@dataclass(eq=False)
class _Pass:
    """One staging buffer's worth of chunks, from the host read to nvCOMP's size check."""

    segments: list[_Segment] | None  # None: a pass of record columns (merged by the kernel only)
    owners: _Owners
    chunk_bytes: int
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
    decoded: list[tuple[str, np.ndarray, BatchResult]] = field(default_factory=list)  # nvCOMP results to check
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
                 pinned_bytes: int = 512 << 20, pinned: PinnedPool | None = None,
                 workspace_bytes: int | None = None) -> None:
        self.device = device
        #: the most nvCOMP workspace a decode call may use (a user's GPU bound: calls that would
        #: need more are split, see :meth:`BatchedCodec.decompress`); None: whatever it asks for
        self.workspace_bytes = workspace_bytes
        self._cuda = device.type == "cuda"
        #: Pinned staging buffers (the reader passes a pool its decoders share).
        self.pinned = pinned if pinned is not None else PinnedPool(pinned_bytes)
        # Up to three passes hold device memory at once (one staged, one checked, one decoding;
        # each: staging + decoded slots) and two hold pinned staging (one uploading, one filling).
        self.budget = max(8 * _slot_stride(65536), min(budget_bytes // 3, pinned_bytes))
        self.gdeflate_type = gdeflate_type
        self.stream: Any = torch.cuda.Stream(device) if self._cuda else _HostStream()
        #: a pass's codec groups after its first, each on its own stream (:meth:`_decode_groups`)
        self._side_streams: dict[int, Any] = {}
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
        passes = [functools.partial(self._stage, segments) for segments in self._plan(requests, outs)]
        if self._cuda:
            # destinations may have been written on the caller's stream (e.g. zeroed)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._on_stream():
            self._run(passes)
        return outs

    def takes_whole(self, n_chunks: np.ndarray, chunk_bytes: np.ndarray) -> np.ndarray:
        """Which items of ``n_chunks`` chunks of ``chunk_bytes`` fit one pass whole: those
        :meth:`decode_columns` takes (the others go through :meth:`decode_many`, which cuts an
        item into block ranges). False everywhere unless the fused path runs here."""
        if not self.fused:
            return np.zeros(len(n_chunks), dtype=bool)
        return n_chunks * 2 * (-(-chunk_bytes // SLOT_ALIGN) * SLOT_ALIGN) <= self.budget

    def decode_columns(self, cols: RecordColumns) -> list[torch.Tensor | None]:
        """Decode records given as columns (every item whole in one pass: :meth:`takes_whole`),
        each into ``cols.out_addr[i]`` or, where that is 0, a new flat uint8 tensor returned at
        ``i`` (None where the caller's memory received it); complete on return. The caller keeps
        the memory at the addresses it gave alive until then.

        What :meth:`decode_many` does per pass, with the per-item work done by numpy over the
        columns: many small records cost a few microseconds each instead of tens."""
        assert self.fused, "record columns are decoded by the fused path (see takes_whole)"
        k = len(cols.raw)
        planes, transform = cols.n_planes, cols.transform
        wrong = np.flatnonzero(~np.isin(planes, PLANE_COUNTS) | ((transform != TRANSFORM_BYTEPLANES) & (planes != 1)))
        if len(wrong):
            i = int(wrong[0])
            raise CorruptCheckpointError(
                f"{cols.where(i)}: {int(planes[i])} planes with transform {int(transform[i])} cannot be decoded"
            )
        outs: list[torch.Tensor | None] = [None] * k
        fresh = np.flatnonzero(cols.out_addr == 0)
        if len(fresh):
            sizes = cols.raw[fresh]
            room = -(-sizes // SLOT_ALIGN) * SLOT_ALIGN  # aligned starts: the caller views each as its dtype
            starts = np.cumsum(room) - room
            block = torch.empty(max(1, int(room.sum())), dtype=torch.uint8, device=self.device)
            cols = dataclasses.replace(cols, out_addr=cols.out_addr.copy())
            cols.out_addr[fresh] = block.data_ptr() + starts
            for i, at, n in zip(fresh.tolist(), starts.tolist(), sizes.tolist()):
                outs[i] = block[at : at + n]
        rows = self._plane_rows(cols)
        passes = [functools.partial(self._stage_columns, cols, sel, rows) for sel in self._plan_columns(cols)]
        if self._cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._on_stream():
            self._run(passes)
        return outs

    def _plane_rows(self, cols: RecordColumns) -> np.ndarray:
        """:meth:`_plane_row` of every item, asked once per distinct (plane codecs, dtype)."""
        key = np.column_stack([cols.codecs.astype(np.int64), cols.n_planes, cols.dtype_codes])
        # One int per row (a polynomial of its fields), then its distinct values: sorting ints is
        # far cheaper than np.unique(axis=0)'s sort of rows; rows that share an int but differ
        # (a wrap-around collision, never seen) fall back to that.
        weights = np.uint64(1_000_003) ** np.arange(key.shape[1], dtype=np.uint64)
        _, first, inverse = np.unique((key.astype(np.uint64) * weights).sum(axis=1), return_index=True,
                                      return_inverse=True)
        distinct = key[first]
        if not np.array_equal(distinct[inverse.reshape(-1)], key):
            distinct, inverse = np.unique(key, axis=0, return_inverse=True)
        rows = [self._plane_row(tuple(u[: u[MAX_PLANES]]), None if u[-1] < 0 else code_dtype(u[-1], ""))
                for u in distinct.tolist()]
        return np.asarray(rows, dtype=np.int64)[inverse.reshape(-1)]

    def _plan_columns(self, cols: RecordColumns) -> list[np.ndarray]:
        """The items of ``cols`` that hold chunks, in order, cut into passes of at most the
        budget and of one chunk size each (whole items: :meth:`takes_whole`)."""
        n_chunks = cols.first_chunk[1:] - cols.first_chunk[:-1]
        take = np.flatnonzero(n_chunks > 0)
        c = cols.chunk_bytes[take]
        cost = n_chunks[take] * 2 * (-(-c // SLOT_ALIGN) * SLOT_ALIGN)
        if (cost > self.budget).any():
            raise ValueError("decode_columns: an item does not fit one pass (see takes_whole)")
        passes: list[np.ndarray] = []
        start, used, budget = 0, 0, self.budget
        c_list, cost_list = c.tolist(), cost.tolist()
        for i, (ci, cost_i) in enumerate(zip(c_list, cost_list)):
            if i > start and (used + cost_i > budget or ci != c_list[start]):
                passes.append(take[start:i])
                start, used = i, 0
            used += cost_i
        if start < len(take):
            passes.append(take[start:])
        return passes

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

    def _run(self, passes: Sequence[Callable[[], _Pass]]) -> None:
        """Stage each pass (``passes[k]()`` reads it into a staging buffer), upload and check it
        while the host stages the next, then decode it (nvCOMP's workspace held throughout)."""
        with WORKSPACES.held():
            self._run_passes(passes)

    def _run_passes(self, passes: Sequence[Callable[[], _Pass]]) -> None:
        uploaded: _Pass | None = None  # copied in, its check queued, not decoded yet
        decoding: _Pass | None = None  # decode queued, nvCOMP's sizes not checked yet
        held: list[_Pass] = []
        try:
            for stage in passes:
                staged = stage()
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
        per_seg = np.asarray(counts, dtype=np.int64)
        seg_of, j = _slots_of(per_seg)
        p_seg = np.asarray(planes, dtype=np.int64)
        chunk = np.asarray(firsts, dtype=np.int64)[seg_of] * p_seg[seg_of] + j
        owners = _Owners(seg_of, chunk, p_seg[seg_of], lambda k: segments[k].req.where)
        out_addr = np.fromiter((seg.out_addr for seg in segments), dtype=np.int64, count=len(segments))
        pas = self._new_pass(segments, owners, seg_of, c, stored, expected, p_seg, np.asarray(plane_bytes, dtype=np.int64),
                             np.asarray(rows, dtype=np.int64), out_addr)
        n, stride = len(stored), pas.stride
        try:
            host = pas.staging.numpy().data
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
                _copy_payloads(pas.staging.numpy(), starts, stored, in_memory)
            self._check_on_host(pas)
        except BaseException:
            self._release(pas)
            raise
        return pas

    def _stage_columns(self, cols: RecordColumns, sel: np.ndarray, rows: np.ndarray) -> _Pass:
        """:meth:`_stage` for the records ``sel`` of ``cols`` (whole items, one chunk size): the
        slot table from the columns with numpy, the chunks copied in with one native call."""
        c = int(cols.chunk_bytes[sel[0]])
        counts = cols.first_chunk[sel + 1] - cols.first_chunk[sel]
        seg_of, j = _slots_of(counts)
        ids = cols.first_chunk[sel][seg_of] + j  # the pass's chunks, as rows of the columns' chunk table
        p_seg = cols.n_planes[sel]
        owners = _Owners(sel[seg_of], j, p_seg[seg_of], cols.where)
        pas = self._new_pass(None, owners, seg_of, c, cols.sizes[ids], cols.crcs[ids], p_seg, cols.raw[sel] // p_seg,
                             rows[sel], cols.out_addr[sel])
        try:
            n = len(ids)
            copy_ranges(pas.staging.numpy(), np.arange(n, dtype=np.int64) * pas.stride, cols.buffers,
                        cols.chunk_src[ids], cols.chunk_at[ids], pas.stored)
            self._check_on_host(pas)
        except BaseException:
            self._release(pas)
            raise
        return pas

    def _new_pass(self, segments: list[_Segment] | None, owners: _Owners, seg: np.ndarray, c: int, stored: np.ndarray,
                  expected: np.ndarray, p_seg: np.ndarray, plane_bytes: np.ndarray, rows: np.ndarray,
                  out_addr: np.ndarray) -> _Pass:
        """A pass's slot table (per slot: its block, plane, raw bytes, codec) from its items'
        planes, bytes per plane, plane-key rows and destination addresses (``seg``: each slot's
        item, counted within the pass), and its staging buffer
        (with the device's tables in its tail, when fused). Stored sizes are checked against raw
        sizes before anything is read: a chunk never spills into the next slot."""
        stride = _slot_stride(c)
        n = len(stored)
        chunk = owners.chunk
        p_slot = p_seg[seg]
        block = chunk // p_slot
        plane = chunk % p_slot
        raw = np.minimum(c, plane_bytes[seg] - block * c)
        if self._key_table is None:
            self._key_table = np.asarray(self._rows, dtype=np.int64).reshape(-1, MAX_PLANES)
        key = self._key_table[rows[seg], plane]
        over = np.flatnonzero((stored > raw) | ((key < 0) & (stored != raw)))
        if len(over):
            where, i, _ = owners.where(int(over[0]))
            raise CorruptCheckpointError(f"{where}: chunk {i} stores {int(stored[over[0]])} bytes for {int(raw[over[0]])} raw")
        compressed = stored < raw
        groups = {self._key_names[int(k)]: np.flatnonzero(compressed & (key == k))
                  for k in np.unique(key[compressed]).tolist()}
        pas = _Pass(segments, owners, c, stride, None, stored, raw, expected, groups,  # type: ignore[arg-type]
                    np.flatnonzero(~compressed))
        if self.fused:
            pas.staging = self._lay_out_fused(pas, seg, block, plane, p_slot, compressed, out_addr)
        else:
            pas.staging = self.pinned.acquire(n * stride)
        return pas

    def _check_on_host(self, pas: _Pass) -> None:
        """The chunks' CRC32Cs on the host, where the device does not check them."""
        if self.device_crc:
            return
        n = len(pas.stored)
        got = checksum_ranges(pas.staging.numpy(), np.arange(n, dtype=np.int64) * pas.stride, pas.stored)
        bad = np.flatnonzero(got != pas.expected)
        if len(bad):
            _raise_checksum(pas, int(bad[0]))

    def _lay_out_fused(self, p: _Pass, seg_of: np.ndarray, block: np.ndarray, plane: np.ndarray,
                       p_slot: np.ndarray, compressed: np.ndarray, out_addr: np.ndarray) -> torch.Tensor:
        """The pass's device buffer and its staging buffer, whose tail holds the tables the device
        needs (checksum ranges and expected values, the merge table), written here."""
        n, stride, c = len(p.stored), p.stride, p.chunk_bytes
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
            _raise_checksum(p, int(p.bad[1]))

    def _release(self, p: _Pass) -> None:
        if p.staging is not None:
            self.pinned.release(p.staging)
            p.staging = None  # type: ignore[assignment]

    def _codec_cache(self, chunk_bytes: int) -> CodecCache:
        cache = self.codecs.get(chunk_bytes)
        if cache is None:
            cache = self.codecs[chunk_bytes] = CodecCache(chunk_bytes, self.gdeflate_type)
        return cache

    def _decode_groups(self, p: _Pass, src_buf: torch.Tensor, dst_buf: torch.Tensor) -> None:
        """One nvCOMP call per codec over the pass's compressed slots, ``src_buf`` -> ``dst_buf``
        (flat, slot ``k`` at ``k * stride`` in both): the first on the decoder's stream, each
        other on a side stream of its own, as the encoder does (a delta's Zstd planes decode
        beside its GDeflate planes); the decoder's stream joins them before the merge, and
        before anything frees the buffers."""
        cache = self._codec_cache(p.chunk_bytes)
        start = self._event() if self._cuda and len(p.groups) > 1 and side_streams_on() else None
        sides: list[Any] = []
        try:
            for i, ((name, data_type), ks) in enumerate(p.groups.items()):
                on = self.stream
                if i and start is not None:
                    on = self._side_stream(i)
                    on.wait_event(start)
                    sides.append(on)
                starts = ks * p.stride
                try:
                    result = cache.get(name, data_type).decompress(src_buf, starts, p.stored[ks], dst_buf, starts,
                                                                   p.raw[ks], on, temp_limit=self.workspace_bytes)
                except NvcompCallError as exc:  # refused at launch (a stream's own faults come back per chunk)
                    raise CorruptCheckpointError(f"{p.owners.all()}: nvCOMP {name} decode failed: {exc}") from exc
                p.decoded.append((name, ks, result))
        finally:
            for side in sides:
                self.stream.wait_stream(side)

    def _side_stream(self, group: int) -> Any:
        side = self._side_streams.get(group)
        if side is None:
            side = self._side_streams[group] = torch.cuda.Stream(self.device)
        return side

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
        assert p.up is not None and p.segments is not None  # record columns go through the fused path only
        c = p.chunk_bytes
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
            got = result.sizes()
            failed = result.failed()
            if len(failed):
                where, i, _ = p.owners.where(int(ks[failed[0]]))
                raise CorruptCheckpointError(f"{where}: chunk {i}: nvCOMP {name} decode failed on the GPU: "
                                             f"{result.status_text(int(failed[0]))}")
            bad = np.flatnonzero(got != p.raw[ks])
            if len(bad):
                where, i, _ = p.owners.where(int(ks[bad[0]]))
                raise CorruptCheckpointError(f"{where}: chunk {i}: a {name} chunk decoded to the wrong size on the GPU")
        p.decoded.clear()


def _slot_stride(chunk_bytes: int) -> int:
    """Bytes between consecutive slots: the chunk size rounded up to :data:`SLOT_ALIGN`."""
    return -(-chunk_bytes // SLOT_ALIGN) * SLOT_ALIGN


def _slots_of(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For items of ``counts[i]`` slots each, back to back: each slot's item and its index there."""
    item = np.repeat(np.arange(len(counts)), counts)
    return item, np.arange(len(item), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


def _raise_checksum(p: _Pass, slot: int) -> None:
    where, i, planes = p.owners.where(slot)
    block, plane = divmod(i, planes)
    raise CorruptCheckpointError(f"{where}: chunk {i} (block {block}, plane {plane}) checksum mismatch")


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

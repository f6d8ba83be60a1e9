"""GPU item encoder: byte planes with torch, chunks compressed by nvCOMP in batched calls.

Items are cut into block ranges and packed into *buckets* whose GPU footprint stays under the
configured budget. A bucket's chunks sit in fixed 64 KiB slots of one device buffer; every codec
gets one batched nvCOMP call per bucket, however many tensors it holds. Compressed chunks are
moved back into their slots on the device and the slot array crosses to the host in one copy
into a pinned buffer, where each chunk's CRC32C is computed and its stored bytes are written. Two CUDA streams alternate between buckets, so bucket k+1 compresses
while bucket k is compacted, copied and written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import nvidia.nvcomp as nv
import torch

from nvdcp.codecs import codec_id
from nvdcp.format.header import TRANSFORM_BYTEPLANES, ItemHeader, checksum
from nvdcp.gpu.nvcomp_codecs import CodecCache, typed_data_type
from nvdcp.gpu.pinned import POOL
from nvdcp.pipeline.cpu import EncodedItem
from nvdcp.pipeline.policy import Layout


@dataclass
class GpuJob:
    """One tensor to encode on its device."""

    key: Any
    data: torch.Tensor  # flat, contiguous uint8 view of the tensor's elements, on the GPU
    layout: Layout
    dtype: torch.dtype
    dtype_code: int
    shape: tuple[int, ...]
    kind: int = 0

    @property
    def n_planes(self) -> int:
        return len(self.layout.plane_codecs)

    @property
    def elements(self) -> int:
        """Bytes per plane: elements for byte planes, bytes without a transform."""
        return self.data.numel() // self.n_planes


@dataclass
class _Segment:
    job: int
    first_block: int
    n_blocks: int
    first_slot: int


@dataclass
class _Bucket:
    segments: list[_Segment] = field(default_factory=list)
    slots: int = 0
    cost: int = 0


@dataclass
class _Launched:
    bucket: _Bucket
    stream: torch.cuda.Stream
    slots: torch.Tensor
    raw_sizes: np.ndarray  # uncompressed bytes per slot
    groups: list[tuple[np.ndarray, torch.Tensor, int, Any]]  # slot ids, comp buffer, cap, nvcomp result


class GpuEncoder:
    """Encodes CUDA tensors into container records (one encoder per device and writer thread)."""

    def __init__(self, device: torch.device, *, chunk_bytes: int, budget_bytes: int,
                 gdeflate_type: int, pool: Executor | None, pinned_bytes: int = 512 << 20) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        # Two buckets are in flight at once (one compressing, one being copied out).
        self.bucket_budget = max(budget_bytes // 2, 64 * chunk_bytes)
        # A bucket's slots cross to one pinned buffer; two are held at once.
        self.max_slots = max(16 * 16, pinned_bytes // 2 // chunk_bytes)
        self.gdeflate_type = gdeflate_type
        self.pool = pool
        self.streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        self.codecs = [CodecCache(device.index or 0, s, chunk_bytes, gdeflate_type) for s in self.streams]

    # -- planning ------------------------------------------------------------------------------
    def _block_cost(self, job: GpuJob) -> int:
        c = self.chunk_bytes
        compressed = sum(name != "none" for name in job.layout.plane_codecs)
        # per plane: its slot; per compressed plane: nvCOMP's output slot (its bound is up to
        # two chunks) and the gather that moves the result back into the slot
        return job.n_planes * c + compressed * 3 * c

    def _plan(self, jobs: list[GpuJob]) -> list[_Bucket]:
        """Pack block ranges of the jobs, in order, into buckets under the budget."""
        buckets = [_Bucket()]
        for j, job in enumerate(jobs):
            blocks = -(-job.elements // self.chunk_bytes)
            per_block = self._block_cost(job)
            if blocks == 0:
                buckets[-1].segments.append(_Segment(j, 0, 0, buckets[-1].slots))
                continue
            b = 0
            while b < blocks:
                cur = buckets[-1]
                room = min((self.bucket_budget - cur.cost) // per_block, (self.max_slots - cur.slots) // job.n_planes)
                if room <= 0 and cur.segments:
                    buckets.append(_Bucket())
                    continue
                take = min(blocks - b, max(room, 1))
                cur.segments.append(_Segment(j, b, take, cur.slots))
                cur.slots += take * job.n_planes
                cur.cost += take * per_block
                b += take
        return [b for b in buckets if b.segments]

    # -- device work ---------------------------------------------------------------------------
    def _launch(self, jobs: list[GpuJob], bucket: _Bucket, parity: int) -> _Launched:
        stream = self.streams[parity]
        c = self.chunk_bytes
        # Per-slot bookkeeping in numpy: a GB is ~16k slots, too many for Python loops.
        raw_sizes = np.empty(bucket.slots, dtype=np.int64)
        slot_key = np.full(bucket.slots, -1, dtype=np.int32)
        keys: dict[tuple[str, str | None], int] = {}
        with torch.cuda.stream(stream):
            slots = torch.empty((max(bucket.slots, 1), c), dtype=torch.uint8, device=self.device)
            for seg in bucket.segments:
                job = jobs[seg.job]
                p = job.n_planes
                start = seg.first_block * c
                m = min(job.elements, (seg.first_block + seg.n_blocks) * c) - start
                full, tail = divmod(m, c)
                src = job.data[start * p : (start + m) * p]
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
                span = slice(seg.first_slot, seg.first_slot + seg.n_blocks * p)
                raw_sizes[span] = c
                if tail:
                    raw_sizes[seg.first_slot + full * p : span.stop] = tail
                plane_keys = [
                    -1 if name == "none" else keys.setdefault((name, typed_data_type(name, job.dtype)), len(keys))
                    for name in job.layout.plane_codecs
                ]
                slot_key[span] = np.tile(np.asarray(plane_keys, dtype=np.int32), seg.n_blocks)
            groups = []
            for key, kid in sorted(keys.items(), key=lambda kv: str(kv[0])):
                ids = np.flatnonzero(slot_key == kid)
                codec, cap = self.codecs[parity].get(key[0], key[1])
                comp = torch.empty(len(ids) * cap, dtype=torch.uint8, device=self.device)
                src_b = nv.as_arrays(slots.view(-1), (ids * c).tolist(), raw_sizes[ids].tolist(), cuda_stream=stream.cuda_stream)
                dst_b = nv.as_arrays(comp, list(range(0, len(ids) * cap, cap)), [cap] * len(ids), cuda_stream=stream.cuda_stream)
                groups.append((ids, comp, cap, codec.encode(src_b, out=dst_b)))
        return _Launched(bucket, stream, slots, raw_sizes, groups)

    def _finish(self, jobs: list[GpuJob], launched: _Launched, partial: dict[int, list]) -> Iterator[tuple[GpuJob, EncodedItem]]:
        c = self.chunk_bytes
        stored = launched.raw_sizes.copy()
        n = len(stored)
        pinned = POOL.acquire(max(1, n * c))
        try:
            with torch.cuda.stream(launched.stream):
                for ids, comp, cap, result in launched.groups:
                    sizes = np.asarray(result.buffer_sizes, dtype=np.int64)  # waits for this encode only
                    used = sizes < launched.raw_sizes[ids]  # compression paid: keep it
                    if used.any():
                        stored[ids[used]] = sizes[used]
                        dst = torch.from_numpy(ids[used]).to(self.device)
                        src = torch.from_numpy(np.flatnonzero(used)).to(self.device)
                        launched.slots[dst] = comp.view(-1, cap)[src, :c]
                # One copy of the whole slot array: cheaper than compacting on the device
                # (boolean-mask compaction materializes 16 bytes of indices per byte kept), and
                # the host writes each chunk's stored prefix straight from pinned memory.
                pinned[: n * c].view(n, c).copy_(launched.slots[:n], non_blocking=True)
                done = torch.cuda.Event()
                done.record(launched.stream)
            done.synchronize()
            host = memoryview(pinned.numpy())
            views = [host[i * c : i * c + size] for i, size in enumerate(stored.tolist())]
            crcs = self._checksums(views)
            for seg in launched.bucket.segments:
                job = jobs[seg.job]
                first = seg.first_slot
                count = seg.n_blocks * job.n_planes
                chunks = [(views[i], crcs[i]) for i in range(first, first + count)]
                whole = seg.first_block == 0 and (seg.first_block + seg.n_blocks) * c >= job.elements
                if not whole:
                    # Spans buckets: its bytes must outlive this pinned buffer.
                    partial.setdefault(seg.job, []).extend((bytes(v), crc) for v, crc in chunks)
                    if (seg.first_block + seg.n_blocks) * c < job.elements:
                        continue
                    chunks = partial.pop(seg.job)
                yield job, self._item(job, chunks)
        finally:
            POOL.release(pinned)

    def _checksums(self, views: list[memoryview]) -> list[int]:
        if self.pool is None or len(views) < 64:
            return [checksum(v) for v in views]
        step = 256
        parts = self.pool.map(lambda i: [checksum(v) for v in views[i : i + step]], range(0, len(views), step))
        return [crc for part in parts for crc in part]

    def _item(self, job: GpuJob, chunks: list[tuple[Any, int]]) -> EncodedItem:
        header = ItemHeader(
            kind=job.kind, dtype_code=job.dtype_code, shape=job.shape, raw_nbytes=job.data.numel(),
            transform=job.layout.transform, plane_codecs=tuple(codec_id(n) for n in job.layout.plane_codecs),
            chunks=tuple((len(v), crc) for v, crc in chunks), chunk_bytes=self.chunk_bytes,
        )
        return EncodedItem(header, header.pack(), [v for v, _ in chunks])

    # -- entry point ---------------------------------------------------------------------------
    def encode(self, jobs: list[GpuJob], ready: torch.cuda.Event | None = None) -> Iterator[tuple[GpuJob, EncodedItem]]:
        """Yield ``(job, encoded item)`` for every job, in order of completion.

        ``ready`` is an event recorded on the caller's stream after the tensors were produced;
        our streams wait on it, so compression never reads a tensor before it is written.
        """
        if ready is not None:
            for s in self.streams:
                s.wait_event(ready)
        partial: dict[int, list] = {}
        prev: _Launched | None = None
        for k, bucket in enumerate(self._plan(jobs)):
            cur = self._launch(jobs, bucket, k % 2)
            if prev is not None:
                yield from self._finish(jobs, prev, partial)
            prev = cur
        if prev is not None:
            yield from self._finish(jobs, prev, partial)


def encode_on_devices(
    jobs: list[GpuJob], encoder_for: Callable[[torch.device], GpuEncoder]
) -> Iterator[tuple[GpuJob, EncodedItem]]:
    """Encode ``jobs`` with one encoder per device, in device order.

    Each device's encoder waits on an event recorded on the caller's current stream there, so
    compression reads tensors only after the work that produced them (e.g. the optimizer step).
    """
    by_device: dict[torch.device, list[GpuJob]] = {}
    for job in jobs:
        by_device.setdefault(job.data.device, []).append(job)
    for device, device_jobs in by_device.items():
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        yield from encoder_for(device).encode(device_jobs, ready)

"""``NvcompStager``: the staging step of ``dcp.async_save``, compressing on the GPU.

``dcp.async_save`` first *stages* the state dict (makes a copy that later training steps cannot
change), then saves that copy in the background. torch's ``DefaultStager`` copies every tensor
to host memory. ``NvcompStager.stage`` instead compresses each tensor shard where it lives (nvCOMP
on the GPU), copies only the compressed bytes into host buffers that it keeps and reuses across
saves, and returns; the background save then just writes those bytes. Without a GPU it copies
tensors into the same reusable host buffers (``cpu_mode="copy"``, compression happens in the
background) or compresses them on the CPU (``cpu_mode="compress"``).

How DCP sees the staged state dict: the same nesting, with every tensor replaced by a
:class:`StagedTensor`, a storage-less (``meta``) ``torch.Tensor`` subclass of the original's
global shape and dtype. Being a tensor, DCP flattens and traverses it exactly like the original
(same keys, lists of tensors stay lists of tensors). It implements DCP's checkpointable hooks:
``__create_write_items__`` returns the write items torch computed for the original (DTensor and
ShardedTensor shards, uneven and empty shards, replicated tensors deduplicated as usual), so the
``.metadata`` is the one a plain save would write; ``__get_tensor_shard__`` returns the
:class:`StagedShard` that ``planner.resolve_data`` hands to :class:`~nvdcp.NvcompWriter`, which
writes its pre-encoded record as is (or compresses its host copy). Other leaves (numbers, strings,
tuples, param groups) are deep-copied, tensors inside them to the CPU, as DefaultStager does.
A staged state dict can only be saved by ``NvcompWriter``.

Memory: one :class:`HostBuffers` per stager, reused by every save. It keeps up to
``buffer_bytes`` (pinned when CUDA is present); a save that needs more gets temporary pageable
memory for the rest, freed when that save's data is written. Buffers of save N are reused by
save N+1 only once save N no longer needs them: ``stage`` waits for that (the writer releases them
when its ``write_data`` ends, or they are released when the staged dict is garbage-collected at
the end of the save).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import threading
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem

from nvdcp.dcp.collector import collector_paused
from nvdcp.errors import StagingError
from nvdcp.format.dtypes import dtype_code
from nvdcp.format.header import DEFAULT_CHUNK_BYTES, ItemHeader
from nvdcp.gpu import gpu_available
from nvdcp.gpu.config import GpuConfig
from nvdcp.gpu.pinned import return_cached_pinned_memory
from nvdcp.pipeline.config import EncodeConfig
from nvdcp.pipeline.cpu import EncodedItem
from nvdcp.pipeline.encoder import ItemEncoder
from nvdcp.pipeline.tensors import plain

if TYPE_CHECKING:
    from nvdcp.gpu.encoder import GpuJob

logger = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30
_ALIGN = 64
_SNAP_ALIGN = 256  # snapshot tensors start here: any dtype views them, nvCOMP reads them aligned
CPU_MODES = ("copy", "compress")
GPU_MODES = ("compress", "copy")


# -- host buffers ------------------------------------------------------------------------------
class HostBuffers:
    """Byte buffers kept across saves: segments carved front to back, reset before each save.

    Segments are pinned when ``pin`` is true (needs CUDA). They grow in powers of two from 1 MiB
    up to ``segment_bytes`` (pinned allocations are rounded up to a power of two: other sizes
    would pin more than they hold). At most ``keep_bytes`` of segments are kept; allocations
    beyond that come from temporary pageable segments dropped at :meth:`reset`.
    """

    def __init__(self, keep_bytes: int, segment_bytes: int = 8 * MiB, pin: bool = False) -> None:
        self.keep_bytes = keep_bytes
        self.segment_bytes = segment_bytes
        self.pin = pin
        self._kept: list[torch.Tensor] = []
        self._temp: list[torch.Tensor] = []
        self._cursor = [0, 0]  # segment index into kept + temp, offset in it
        self.kept_bytes = 0
        self.used_bytes = 0
        self.temp_bytes = 0

    @property
    def pinned_bytes(self) -> int:
        return self.kept_bytes if self.pin else 0

    def reset(self) -> None:
        self._temp.clear()
        self._cursor = [0, 0]
        self.used_bytes = 0
        self.temp_bytes = 0

    def close(self) -> None:
        self.reset()
        self._kept.clear()
        self.kept_bytes = 0

    def reserve(self, nbytes: int) -> None:
        """Replace the kept segments by the fewest that hold ``nbytes`` (plus 0.1% + 256 KiB,
        rounded up to 1 MiB: alignment and segment ends; never past ``keep_bytes``), each a
        power of two so that the pinned allocator
        reserves no more than asked: a save of about that size then pins about its own size,
        where growing segment by segment would leave the last one partly used. Only between
        saves (nothing may view the kept segments)."""
        had_pinned = self.pin and bool(self._kept)
        self.close()
        if had_pinned:
            # torch's pinned allocator caches freed blocks: hand the old segments back to the
            # system, or the process would pin them and the new ones.
            return_cached_pinned_memory()
        # Slack for 64-byte alignment and segment ends (pieces never straddle two segments).
        left = min(-(-(nbytes + nbytes // 1024 + 256 * 1024) // MiB) * MiB, self.keep_bytes)
        while left >= MiB:
            bit = 1 << (left.bit_length() - 1)
            self._kept.append(torch.empty(bit, dtype=torch.uint8, pin_memory=self.pin))
            self.kept_bytes += bit
            left -= bit

    def alloc(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes as a uint8 tensor, starting at a 64-byte aligned address."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        while True:
            segments = self._kept + self._temp
            seg, pos = self._cursor
            if seg < len(segments):
                if pos + nbytes <= segments[seg].numel():
                    return self._take(segments, seg, pos, nbytes)
                self._cursor = [seg + 1, 0]
                continue
            self._grow(nbytes)

    def place(self, sizes: np.ndarray) -> list[tuple[torch.Tensor, int, int]]:
        """Memory for consecutive pieces (e.g. a GPU bucket's packed chunks), split across
        segments only between pieces: runs ``(buffer, lo, hi)`` hold pieces ``lo..hi-1`` back to
        back in ``buffer`` (exactly their total size), covering every piece in order."""
        ends = np.cumsum(sizes, dtype=np.int64)
        runs: list[tuple[torch.Tensor, int, int]] = []
        lo, base = 0, 0
        while lo < len(sizes):
            segments = self._kept + self._temp
            seg, pos = self._cursor
            if seg == len(segments):
                self._grow(int(sizes[lo]))
                continue
            room = segments[seg].numel() - pos
            hi = int(np.searchsorted(ends, base + room, side="right"))
            if hi <= lo:
                self._cursor = [seg + 1, 0]
                continue
            runs.append((self._take(segments, seg, pos, int(ends[hi - 1]) - base), lo, hi))
            lo, base = hi, int(ends[hi - 1])
        return runs

    def _grow(self, at_least: int) -> None:
        """Add a segment of at least ``at_least`` bytes after the last one."""
        size = max(at_least, min(self.segment_bytes, max(MiB, self.kept_bytes)))
        footprint = _pinned_footprint(size) if self.pin else size
        if not self._temp and self.kept_bytes + footprint <= self.keep_bytes:
            # Still inside the kept run (kept segments always precede temporary ones).
            self._kept.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
            self.kept_bytes += footprint
        else:
            self._temp.append(torch.empty(max(at_least, min(self.segment_bytes, max(MiB, self.temp_bytes))),
                                          dtype=torch.uint8))
            self.temp_bytes += self._temp[-1].numel()

    def _take(self, segments: list[torch.Tensor], seg: int, pos: int, nbytes: int) -> torch.Tensor:
        # The next piece starts 64-byte aligned, but never past the segment's end.
        self._cursor = [seg, min(segments[seg].numel(), pos + -(-nbytes // _ALIGN) * _ALIGN)]
        self.used_bytes += nbytes
        return segments[seg][pos : pos + nbytes]


def _pinned_footprint(nbytes: int) -> int:
    """Bytes torch's pinned host allocator reserves for ``nbytes`` (the next power of two)."""
    return 1 << max(0, nbytes - 1).bit_length()


# -- what the staged state dict holds ----------------------------------------------------------
class StagedShard:
    """One write item's staged data: a pre-encoded record, or a host copy to compress later.

    A GPU-staged shard's record is finished in the background (checksums and header over bytes
    already in host memory); :attr:`encoded` waits for it.
    """

    __slots__ = ("__weakref__", "_encoded", "lease", "pending", "tensor")

    def __init__(self, encoded: EncodedItem | None = None, tensor: torch.Tensor | None = None,
                 lease: _Lease | None = None) -> None:
        self._encoded = encoded
        self.tensor = tensor
        self.lease = lease
        self.pending: Future[None] | None = None

    @property
    def encoded(self) -> EncodedItem | None:
        """The pre-encoded record (None for a host copy); raises what finishing it raised."""
        if self.pending is not None:
            self.pending.result()
        return self._encoded

    @encoded.setter
    def encoded(self, value: EncodedItem | None) -> None:
        self._encoded = value

    @property
    def host_tensor(self) -> torch.Tensor:
        """The host copy of a shard staged without compression."""
        if self.tensor is None:
            raise StagingError("this staged shard holds an encoded record, not a host copy")
        return self.tensor

    @property
    def nbytes(self) -> int:
        """Host bytes this shard holds."""
        if self.encoded is not None:
            return self.encoded.nbytes
        return 0 if self.tensor is None else self.tensor.numel() * self.tensor.element_size()

    def __reduce__(self) -> tuple[Any, ...]:
        # async_save PROCESS mode pickles the staged dict into the checkpoint process: send the
        # bytes themselves (the host buffers stay here and are reused).
        if self.encoded is not None:
            e = self.encoded
            return (_rebuild_encoded, (e.header, e.header_bytes, b"".join(e.chunks)))  # one copy
        assert self.tensor is not None
        t = self.tensor
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return (_rebuild_tensor, (raw, t.dtype, tuple(t.shape)))

    def __repr__(self) -> str:
        if self.tensor is not None:
            return f"StagedShard(host copy, {self.nbytes} bytes)"
        if self._encoded is None:  # being finished in the background: do not wait here
            return "StagedShard(encoded, pending)"
        return f"StagedShard(encoded, {self._encoded.nbytes} bytes)"


def _rebuild_encoded(header: ItemHeader, header_bytes: bytes, payload: bytes) -> StagedShard:
    return StagedShard(EncodedItem(header, header_bytes, [payload]))


def _rebuild_tensor(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> StagedShard:
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return StagedShard(tensor=flat.view(dtype).reshape(shape))


class StagedTensor(torch.Tensor):
    """Stands in for one tensor of the state dict: no data here, its shards are staged.

    A ``meta`` tensor of the original's (global) shape and dtype, so DCP traverses it as it would
    the original; ``__create_write_items__`` and ``__get_tensor_shard__`` are DCP's hooks for
    checkpointable objects (DTensor implements the same two).
    """

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    _nvdcp_items: list[WriteItem]
    _nvdcp_shards: dict[tuple[int, ...] | None, StagedShard]

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype, items: list[WriteItem],
                shards: dict[tuple[int, ...] | None, StagedShard]) -> StagedTensor:
        t = torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype, device="meta"))
        t._nvdcp_items = items
        t._nvdcp_shards = shards
        return t

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        return [
            dataclasses.replace(item, index=MetadataIndex(fqn, item.index.offset, item.index.index))
            for item in self._nvdcp_items
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> StagedShard:
        key = None if index.offset is None else tuple(index.offset)
        try:
            return self._nvdcp_shards[key]
        except KeyError:
            raise StagingError(
                f"{index.fqn!r}: no staged shard at offset {key}; the plan being saved is not the one "
                "this state dict was staged for"
            ) from None

    @property
    def staged_shards(self) -> list[StagedShard]:
        return list(self._nvdcp_shards.values())

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return (StagedTensor, (tuple(self.shape), self.dtype, self._nvdcp_items, self._nvdcp_shards))

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"StagedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, shards={len(self._nvdcp_shards)})"


class _Lease:
    """The host buffers of one staged state dict; released once, explicitly or when collected."""

    def __init__(self, stager: NvcompStager, generation: int) -> None:
        self.stager = stager  # the writer reads its on_identical_save
        self._finalizer = weakref.finalize(self, stager._release, generation)

    def release(self) -> None:
        self._finalizer()


def release_staged(shards: list[StagedShard]) -> None:
    """Hand the host buffers behind ``shards`` back to their stager (the writer calls this once
    its ``write_data`` is over: nothing reads staged bytes after that)."""
    for lease in {id(s.lease): s.lease for s in shards if s.lease is not None}.values():
        lease.release()


# -- the stager --------------------------------------------------------------------------------
@dataclasses.dataclass
class StageStats:
    """What the last :meth:`NvcompStager.stage` did; ``seconds`` is the time the caller was blocked."""

    seconds: float = 0.0
    wait_seconds: float = 0.0
    gpu_seconds: float = 0.0  # GPU compression and the copy of stored bytes to host memory
    raw_bytes: int = 0
    staged_bytes: int = 0
    shards: int = 0
    gpu_shards: int = 0
    compressed_shards: int = 0
    copied_shards: int = 0
    pinned_bytes: int = 0
    temp_bytes: int = 0
    #: Host buffer bytes allocated (pinned when CUDA is present) by this save: 0 once warm.
    grown_bytes: int = 0
    #: Overlapped staging (``async_staging=True``): bytes of the device (or host) snapshot the
    #: background compresses from, shards staged before the call returned because the snapshot
    #: budget was spent, seconds from the call until the snapshot was complete on the device
    #: (``staging_completion``), and seconds the background took to compress and copy to host.
    snapshot_bytes: int = 0
    sync_shards: int = 0
    snapshot_seconds: float = 0.0
    background_seconds: float = 0.0

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.staged_bytes if self.staged_bytes else 1.0


class _Snapshot:
    """One device's part of an overlapped save: the copy of its tensors that the background
    compresses, and the event after which that copy is complete."""

    __slots__ = ("buffer", "device", "entries", "event")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None
        #: (shard, source tensor, where); the source is replaced by its copy once it is taken
        self.entries: list[tuple[StagedShard, torch.Tensor, str]] = []


class NvcompStager:
    """DCP ``AsyncStager`` that compresses on the GPU into reusable host buffers.

    Use with ``dcp.async_save(state_dict, storage_writer=nvdcp.NvcompWriter(url),
    async_stager=stager)``; one stager serves every save of a run (its buffers are reused), close
    it at the end. ``NvcompWriter`` itself is an ``AsyncStager`` that delegates to a stager shared
    per process, so ``async_stager`` may be left out.

    Overlapped staging (``async_staging=True``, docs/TRAINING.md): ``stage`` queues a copy of
    every GPU tensor into GPU scratch memory on the caller's current stream (a device-to-device
    copy, about a millisecond per GB on an H200) and returns a future at once, so
    ``dcp.async_save`` answers an ``AsyncSaveResponse``. Compression and the device-to-host copy
    run on background CUDA streams from that copy, while training goes on. The copy is queued on
    the stream that runs the training step, so kernels queued there after the call (the next
    optimizer step writing the parameters in place) run after it: the checkpoint holds the state
    at the call, bit for bit. ``staging_completion`` resolves when the copy is complete on the
    device; wait for it before the optimizer step (torch's recipe) and tensors written by other
    streams or threads are covered too.

    Args:
        codec: as :class:`~nvdcp.NvcompWriter`'s ``codec`` (``"auto"``: GDeflate byte planes on the
            GPU, zstd on the CPU).
        chunk_bytes: uncompressed bytes per chunk (1 KiB..64 KiB).
        gpu: GPU path settings; ``gpu_memory_bytes`` bounds the scratch GPU memory of compression.
        cpu_mode: for tensors not compressed on a GPU: ``"copy"`` (a host copy now, compressed by
            the background save; the shortest stall) or ``"compress"`` (compressed on the CPU,
            now, or with ``async_staging`` in the background from a host copy taken now).
        buffer_bytes: host buffer memory kept across saves, pinned when CUDA is present. A save
            whose staged bytes exceed it uses temporary pageable memory for the rest.
        codec_threads: CPU threads for CPU compression and checksums (default: all cores).
        wait_timeout_s: how long ``stage`` waits for the previous save to release the buffers.
            After that it logs a warning and stages into fresh buffers (the old ones are freed
            when that save's objects go away), so a failed save can never hang training.
        return_future: ``stage`` returns a completed ``concurrent.futures.Future`` holding the
            staged dict instead of the dict itself (staging is as synchronous as ever). torch's
            ``dcp.async_save`` then returns an ``AsyncSaveResponse`` (``staging_completion``,
            ``upload_completion``) instead of a plain future, which callers written for
            ``DefaultStager``'s async staging expect (torchtitan's ``async_with_pinned_mem``).
        gpu_mode: ``"compress"`` (default: GPU tensors are compressed on the GPU while staging)
            or ``"copy"`` (host copies of their raw bytes, compressed by the background save:
            what a writer saving deltas (``NvcompWriter(delta=...)``) stages through, since each
            item's base is only known once the save is planned).
        async_staging: overlapped staging (above); implies a future from ``stage``, so
            ``dcp.async_save`` returns an ``AsyncSaveResponse``.
        snapshot_bytes: GPU memory per device the overlapped snapshot may use in one save
            (default None: half of what is free on the device, counting memory torch's allocator
            caches, at the save). Tensors beyond it are staged before the call returns, as
            without ``async_staging``; so are all tensors when the copy cannot be allocated.
        on_identical_save: what a save staged through this stager does when every item is
            byte-identical to the previous save of the process: ``"warn"``, ``"error"``
            (:class:`~nvdcp.StaleSaveError`, nothing committed) or ``"ignore"``; None (default)
            leaves it to the writer's ``on_identical_save``. Applies where the save's
            ``finish`` runs in this process (sync and THREAD ``async_save``); in PROCESS mode set
            it on the writer, which travels to the checkpoint process (docs/RELIABILITY.md).
    """

    _synchronize_after_execute: bool = False

    def __init__(
        self,
        *,
        codec: str = "auto",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        gpu: GpuConfig | None = None,
        cpu_mode: str = "copy",
        buffer_bytes: int = GiB,
        codec_threads: int | None = None,
        wait_timeout_s: float = 300.0,
        return_future: bool = False,
        on_identical_save: str | None = None,
        async_staging: bool = False,
        snapshot_bytes: int | None = None,
        gpu_mode: str = "compress",
    ) -> None:
        from nvdcp.dcp.commit import identical_save_policy

        if cpu_mode not in CPU_MODES:
            raise ValueError(f"cpu_mode must be one of {CPU_MODES}, got {cpu_mode!r}")
        if gpu_mode not in GPU_MODES:
            raise ValueError(f"gpu_mode must be one of {GPU_MODES}, got {gpu_mode!r}")
        self.gpu_mode = gpu_mode
        if buffer_bytes < 0:
            raise ValueError(f"buffer_bytes must be >= 0, got {buffer_bytes}")
        if snapshot_bytes is not None and snapshot_bytes < 0:
            raise ValueError(f"snapshot_bytes must be >= 0 or None, got {snapshot_bytes}")
        self.encoding = EncodeConfig(codec, chunk_bytes, codec_threads)
        self.gpu = gpu or GpuConfig()
        self.cpu_mode = cpu_mode
        self.buffer_bytes = buffer_bytes
        self.wait_timeout_s = wait_timeout_s
        self.return_future = return_future
        self.async_staging = async_staging
        self.snapshot_bytes = snapshot_bytes
        self.on_identical_save = identical_save_policy(on_identical_save, allow_none=True)
        self.last_stats: StageStats | None = None
        #: What :meth:`warm_up` did (None before it ran).
        self.warm_up_stats: StageStats | None = None
        self._init_runtime()

    def _init_runtime(self) -> None:
        # Nothing here touches CUDA: a stager may be built (and pickled) before any GPU work.
        # Reentrant: a lease's finalizer (_release) may run from a garbage collection that
        # happens while _acquire holds the lock.
        self._lock = threading.RLock()
        self._idle = threading.Event()
        self._idle.set()
        self._generation = 0
        self._buffers: HostBuffers | None = None
        # One background thread: finishes records, and runs overlapped saves' compression.
        self._finish_pool: ThreadPoolExecutor | None = None
        self._finishing: list[Future[None]] = []
        # The last staging future, weakly: holding it would hold the staged dict and its buffers.
        self._staging: weakref.ref[Future[dict[str, Any]]] | None = None
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}
        #: Compresses what is staged (CPU threads, GPU encoders); closed with the stager.
        self.encoder = ItemEncoder(self.encoding, self.gpu)
        self._gpu_ok = False

    @property
    def codec(self) -> str:
        return self.encoding.codec

    @property
    def chunk_bytes(self) -> int:
        return self.encoding.chunk_bytes

    def __getstate__(self) -> dict[str, Any]:
        keep = ("encoding", "gpu", "cpu_mode", "buffer_bytes", "wait_timeout_s", "return_future", "on_identical_save",
                "async_staging", "snapshot_bytes")
        return {k: self.__dict__[k] for k in keep} | {"last_stats": None, "warm_up_stats": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("async_staging", False)
        state.setdefault("snapshot_bytes", None)
        self.__dict__.update(state)
        self._init_runtime()

    # -- AsyncStager protocol ------------------------------------------------------------------
    @property
    def should_synchronize_after_execute(self) -> bool:
        """False: a dict from :meth:`stage` is complete; a future tells when it is."""
        return self._synchronize_after_execute

    def synchronize_staging(self) -> None:
        """Wait until the last staged state no longer reads the caller's tensors."""
        staging = self._staging() if self._staging is not None else None
        if staging is not None:
            staging.exception()  # its error, if any, goes to the save

    def close(self) -> None:
        """Wait for the last save to release the buffers, then free them."""
        self.wait()
        self._wait_background()
        with self._lock:
            if self._buffers is not None:
                self._buffers.close()
            self._buffers = None
        if self._finish_pool is not None:
            self._finish_pool.shutdown(wait=True)
        self._finish_pool = None
        self._side_streams.clear()
        self.encoder.close()

    @collector_paused
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | Future[dict[str, Any]]:
        """Return a staged copy of ``state_dict`` that later training steps cannot change
        (with ``return_future`` or ``async_staging``: a future of it).

        Blocks for: waiting until the previous save released the buffers, then GPU compression
        and the copy of the compressed bytes to host memory (or, without a GPU, the host copy /
        CPU compression). Checksums and headers of GPU-staged records follow in the background.
        With ``async_staging`` it blocks only to queue the device snapshot (and for tensors past
        the snapshot budget); the returned future resolves once the snapshot is complete.
        """
        started = time.perf_counter()
        lease = self._acquire()
        stats = StageStats(wait_seconds=time.perf_counter() - started)
        self._gpu_ok = gpu_available()  # once per save, not per tensor
        buffers = self._buffers
        assert buffers is not None
        kept_before = buffers.kept_bytes
        snapshots: dict[torch.device, _Snapshot] = {}
        host_snapshot: list[tuple[StagedShard, torch.Tensor, str]] = []
        try:
            gpu_jobs: list[GpuJob] = []
            copies: list[tuple[torch.Tensor, torch.Tensor]] = []
            staged = self._walk(state_dict, (), lease, _Walk(gpu_jobs, copies, snapshots, host_snapshot), stats)
            if copies:
                self._finish_copies(copies)
            for snap in snapshots.values():
                self._take_snapshot(snap, gpu_jobs, stats)
            if gpu_jobs:
                t0 = time.perf_counter()
                stats.sync_shards = len(gpu_jobs) if self.async_staging else 0
                self._encode_on_gpu(gpu_jobs, stats, buffers)
                stats.gpu_seconds = time.perf_counter() - t0
        except BaseException:
            lease.release()
            raise
        stats.seconds = time.perf_counter() - started
        stats.pinned_bytes = buffers.pinned_bytes
        stats.temp_bytes = buffers.temp_bytes
        stats.grown_bytes = buffers.kept_bytes - kept_before
        self.last_stats = stats
        deferred = [s for s in snapshots.values() if s.entries]
        if deferred or host_snapshot:
            future: Future[dict[str, Any]] = Future()
            if not deferred:
                future.set_result(staged)  # host copies only: they are complete already
            task = self._finisher().submit(self._background, deferred, host_snapshot, future, staged, stats,
                                           buffers, started, kept_before)
            self._finishing.append(task)
            for snap in deferred:
                for shard, _, _ in snap.entries:
                    shard.pending = task
            for shard, _, _ in host_snapshot:
                shard.pending = task
            self._staging = weakref.ref(future)
            self._log(stats, "queued")
            return future
        self._log(stats, "staged")
        if self.return_future or self.async_staging:
            done: Future[dict[str, Any]] = Future()
            done.set_result(staged)
            self._staging = weakref.ref(done)
            return done
        return staged

    def warm_up(self, state_dict: dict[str, Any]) -> StageStats:
        """Stage ``state_dict`` once without saving it, so the first checkpoint costs what later
        ones do: host buffers are allocated (and pinned) for its compressed size, the GPU
        encoders, nvCOMP codecs and CUDA streams are made, and the caching allocator holds the
        GPU scratch memory. Call it before training starts, with the state dict you will save.
        Returns (and keeps in :attr:`warm_up_stats`) what that staging did; ``seconds`` of it is
        the first-save cost moved out of the training loop."""
        started = time.perf_counter()
        staged = self.stage(state_dict)
        if isinstance(staged, Future):
            staged = staged.result()
        shards = _staged_shards(staged)
        try:
            _wait_finished(shards)
        finally:
            release_staged(shards)
        # The staged records view the segments about to be replaced: drop them first, so those
        # segments go back to torch's pinned cache and reserve() can hand them to the system.
        del staged, shards
        if self.last_stats is not None and self._buffers is not None and self.wait(self.wait_timeout_s):
            with self._lock:  # pin what this state needs, not the segments grown while staging it
                self._buffers.reserve(self.last_stats.staged_bytes)
                self.last_stats.pinned_bytes = self._buffers.pinned_bytes
        stats = dataclasses.replace(self.last_stats or StageStats(), seconds=time.perf_counter() - started)
        self.warm_up_stats = stats
        logger.info("nvdcp: stager warmed up in %.3fs (%d bytes of host buffers, %d pinned)",
                    stats.seconds, self._buffers.kept_bytes if self._buffers else 0, stats.pinned_bytes)
        return stats

    def _log(self, stats: StageStats, what: str) -> None:
        logger.info(
            "nvdcp %s %d shards (%d on GPU, %d compressed on CPU, %d copied, %d snapshot bytes): %d -> %d bytes "
            "(ratio %.3f) in %.3fs (%.3fs waiting for the previous save); pinned %d, temporary %d",
            what, stats.shards, stats.gpu_shards, stats.compressed_shards, stats.copied_shards, stats.snapshot_bytes,
            stats.raw_bytes, stats.staged_bytes, stats.ratio, stats.seconds, stats.wait_seconds,
            stats.pinned_bytes, stats.temp_bytes,
        )

    # -- buffers and their lease ---------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the last staged state dict's buffers are released; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        collected = False
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if self._idle.wait(1.0 if remaining is None else max(0.0, min(1.0, remaining))):
                return True
            if not collected:
                # The staged dict may only be held by a reference cycle (a failed save's traceback).
                gc.collect()
                collected = True
            if remaining is not None and remaining <= 0:
                return False

    def _wait_background(self) -> None:
        """Wait for every background task of earlier saves (they write into the buffers)."""
        finishing, self._finishing = self._finishing, []
        for task in finishing:
            task.exception()  # waits; its error, if any, went to that save

    def _acquire(self) -> _Lease:
        if not self.wait(self.wait_timeout_s):
            logger.warning(
                "nvdcp: the previous async save still holds its staging buffers after %.0fs (did it "
                "fail, or was its future not waited for?); staging into fresh buffers",
                self.wait_timeout_s,
            )
            with self._lock:
                self._buffers = None  # the old ones go away with the save that holds them
                self._generation += 1
        # A save that failed early may not have waited for its records: they read the buffers.
        self._wait_background()
        with self._lock:
            if self._buffers is None:
                self._buffers = HostBuffers(self.buffer_bytes, pin=torch.cuda.is_available())
            self._buffers.reset()
            self._generation += 1
            self._idle.clear()
            return _Lease(self, self._generation)

    def _release(self, generation: int) -> None:
        with self._lock:
            if generation != self._generation:
                return
            if self._buffers is not None:
                self._buffers.reset()  # temporary memory goes now; kept segments stay for reuse
            self._idle.set()

    # -- the walk: same structure, tensors become StagedTensors --------------------------------
    def _walk(self, obj: Any, path: tuple[Any, ...], lease: _Lease, out: _Walk, stats: StageStats) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._stage_tensor(obj, path, lease, out, stats)
        if isinstance(obj, Mapping):
            return {k: self._walk(v, (*path, k), lease, out, stats) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._walk(v, (*path, i), lease, out, stats) for i, v in enumerate(obj)]
        # DCP pickles every other leaf whole (tuples included): a deep copy on the host.
        return _host_deepcopy(obj)

    def _stage_tensor(self, obj: torch.Tensor, path: tuple[Any, ...], lease: _Lease, out: _Walk,
                      stats: StageStats) -> StagedTensor:
        from torch.distributed.checkpoint.planner_helpers import _create_write_items
        from torch.distributed.checkpoint.utils import find_tensor_shard
        from torch.distributed.tensor import DTensor

        where = ".".join(map(str, path))
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            items: list[WriteItem] = []  # this rank holds no part of it (DCP skips it too)
        else:
            items = _create_write_items(where, obj)
        shards: dict[tuple[int, ...] | None, StagedShard] = {}
        for item in items:
            data = find_tensor_shard(obj, item.index).detach()
            try:
                dtype_code(data.dtype)  # refuse a dtype the format cannot store, naming the entry
            except ValueError as exc:
                raise ValueError(f"state_dict entry {where!r}: {exc}") from None
            shard = StagedShard(lease=lease)
            shards[None if item.index.offset is None else tuple(item.index.offset)] = shard
            nbytes = data.numel() * data.element_size()
            stats.shards += 1
            stats.raw_bytes += nbytes
            label = f"state_dict entry {where!r}"
            if data.is_cuda and self._gpu_ok and self.gpu_mode == "compress":
                stats.gpu_shards += 1
                if self.async_staging and nbytes:
                    snap = out.snapshots.get(data.device)
                    if snap is None:
                        snap = out.snapshots[data.device] = _Snapshot(data.device)
                    snap.entries.append((shard, data, label))
                else:
                    out.gpu_jobs.append(self.encoder.gpu_job(shard, data, label))
            elif self.cpu_mode == "compress" and not data.is_cuda and not self.encoding.gpu_only:
                stats.compressed_shards += 1
                if self.async_staging and nbytes:
                    # A host copy now; compression in the background (it reads only the copy).
                    copy_ = torch.empty(data.shape, dtype=data.dtype)
                    copy_.copy_(plain(data))
                    out.host_snapshot.append((shard, copy_, label))
                    stats.snapshot_bytes += nbytes
                else:
                    shard.encoded = self._keep(self.encoder.encode_tensor(data, label))
                    stats.staged_bytes += shard.encoded.nbytes
            else:
                shard.tensor = self._copy_to_host(data, out.copies)
                stats.copied_shards += 1
                stats.staged_bytes += nbytes
        items = [dataclasses.replace(i, index=MetadataIndex("", i.index.offset, i.index.index)) for i in items]
        return StagedTensor(tuple(obj.shape), obj.dtype, items, shards)

    # -- overlapped staging ----------------------------------------------------------------------
    def _snapshot_budget(self, device: torch.device) -> int:
        if self.snapshot_bytes is not None:
            return self.snapshot_bytes
        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return (free + max(0, cached)) // 2

    def _take_snapshot(self, snap: _Snapshot, gpu_jobs: list[GpuJob], stats: StageStats) -> None:
        """Queue the copy of ``snap``'s tensors on the device's current stream. Tensors past the
        budget, or all of them when the copy cannot be allocated, go to ``gpu_jobs`` (staged now)."""
        budget = self._snapshot_budget(snap.device)
        offsets: list[int] = []
        total = 0
        keep = 0
        for _, data, _ in snap.entries:
            size = data.numel() * data.element_size()
            if total + size > budget:
                break
            offsets.append(total)
            total += -(-size // _SNAP_ALIGN) * _SNAP_ALIGN
            keep += 1
        overflow, snap.entries = snap.entries[keep:], snap.entries[:keep]
        if snap.entries:
            try:
                snap.buffer = torch.empty(total, dtype=torch.uint8, device=snap.device)
            except torch.cuda.OutOfMemoryError:
                logger.warning("nvdcp: no GPU memory for a %d-byte snapshot on %s; staging those tensors "
                               "before async_save returns", total, snap.device)
                overflow, snap.entries = snap.entries + overflow, []
        if overflow:
            logger.info("nvdcp: %d tensors past the snapshot budget on %s are staged before async_save returns",
                        len(overflow), snap.device)
            gpu_jobs.extend(self.encoder.gpu_job(shard, data, label) for shard, data, label in overflow)
        if not snap.entries:
            return
        assert snap.buffer is not None
        dsts: list[torch.Tensor] = []
        by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for (_, data, _), off in zip(snap.entries, offsets):
            size = data.numel() * data.element_size()
            dsts.append(snap.buffer[off : off + size].view(data.dtype).view(data.shape))
            group = by_dtype.setdefault(data.dtype, ([], []))
            group[0].append(dsts[-1])
            group[1].append(plain(data))
        with torch.cuda.device(snap.device):
            # Multi-tensor launches (one per dtype and few dozen tensors), in order after the work
            # queued on the caller's stream (what produced the tensors) and before anything
            # queued there later (the next optimizer step).
            for group_dsts, group_srcs in by_dtype.values():
                torch._foreach_copy_(group_dsts, group_srcs)
            snap.event = torch.cuda.Event()
            snap.event.record(torch.cuda.current_stream(snap.device))
        snap.entries = [(shard, dst, label) for (shard, _, label), dst in zip(snap.entries, dsts)]
        stats.snapshot_bytes += total

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        # Priority 0 is CUDA's lowest (torch.cuda.Stream.priority_range()): the encoder's streams,
        # made with the default priority, already yield to any higher-priority training stream.
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device, priority=0)
        return self._side_streams[device]

    def _background(self, snapshots: list[_Snapshot], host_snapshot: list[tuple[StagedShard, torch.Tensor, str]],
                    future: Future[dict[str, Any]], staged: dict[str, Any], stats: StageStats,
                    buffers: HostBuffers, started: float, kept_before: int) -> None:
        """The overlapped part of a save, on the stager's background thread: resolve the staging
        future once the snapshot is complete, then compress it into ``buffers``."""
        if not future.done():
            try:
                for snap in snapshots:
                    assert snap.event is not None
                    snap.event.synchronize()  # releases the GIL
            except BaseException as exc:
                future.set_exception(exc)
                raise
            stats.snapshot_seconds = time.perf_counter() - started
            future.set_result(staged)
        del staged
        t0 = time.perf_counter()
        try:
            for snap in snapshots:
                jobs = [self.encoder.gpu_job(shard, data, label) for shard, data, label in snap.entries]
                side = self._side_stream(snap.device)
                assert snap.event is not None
                side.wait_event(snap.event)
                before = buffers.used_bytes
                with torch.cuda.stream(side):  # the encoder's streams wait for the snapshot only
                    items = self.encoder.stage_gpu_jobs(jobs, buffers)
                stats.staged_bytes += buffers.used_bytes - before
                # stage_gpu_jobs returned: every read of the snapshot is over, its memory may go
                snap.entries.clear()
                snap.buffer = None
                for job, encoded in items():
                    job.key.encoded = encoded
                jobs.clear()
            for shard, data, label in host_snapshot:
                encoded = self._keep(self.encoder.encode_tensor(data, label), buffers)
                shard.encoded = encoded  # not shard.encoded: that waits for this very task
                stats.staged_bytes += encoded.nbytes
            host_snapshot.clear()
        except BaseException:
            logger.exception("nvdcp: overlapped staging failed; the save fails with this error")
            raise
        finally:
            stats.background_seconds = time.perf_counter() - t0
            stats.pinned_bytes = buffers.pinned_bytes
            stats.temp_bytes = buffers.temp_bytes
            stats.grown_bytes = buffers.kept_bytes - kept_before

    # -- host copies -----------------------------------------------------------------------------
    def _copy_to_host(self, data: torch.Tensor, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        assert self._buffers is not None
        nbytes = data.numel() * data.element_size()
        dst = self._buffers.alloc(nbytes).view(data.dtype).reshape(data.shape)
        copies.append((dst, data))
        return dst

    @staticmethod
    def _finish_copies(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        devices = set()
        for dst, src in copies:
            if src.numel():
                dst.copy_(src.resolve_conj().resolve_neg(), non_blocking=src.is_cuda and dst.is_pinned())
                if src.is_cuda:
                    devices.add(src.device)
        for device in devices:
            torch.cuda.current_stream(device).synchronize()

    def _keep(self, encoded: EncodedItem, buffers: HostBuffers | None = None) -> EncodedItem:
        """Copy an encoded item's chunks into the host buffers (they may view memory that is
        about to be reused: the encoder's pinned slots, or the source tensor itself)."""
        buffers = buffers or self._buffers
        assert buffers is not None
        chunks = list(encoded.chunks)
        views: list[bytes | memoryview] = []
        for host, lo, hi in buffers.place(np.array([len(c) for c in chunks], dtype=np.int64)):
            buf = host.numpy().data
            pos = 0
            for c in chunks[lo:hi]:
                buf[pos : pos + len(c)] = c
                pos += len(c)
            # Chunks lie back to back in each run: one view per run (the writer only needs their
            # concatenation), not one garbage-collected object per chunk (nvdcp.storage.spans).
            views.append(buf)
        return EncodedItem(encoded.header, encoded.header_bytes, views)

    # -- GPU compression -------------------------------------------------------------------------
    def _encode_on_gpu(self, jobs: list[GpuJob], stats: StageStats, buffers: HostBuffers) -> None:
        # When stage_gpu_jobs() returns, every read of the tensors is over (training may go on)
        # and the stored chunks are in our host buffers; checksums and headers are host work on
        # bytes that no longer change, so they run in the background, before the writer needs them.
        before = buffers.used_bytes
        items = self.encoder.stage_gpu_jobs(jobs, buffers)
        stats.staged_bytes += buffers.used_bytes - before  # stored chunks, granule-padded

        def finish() -> None:
            for job, encoded in items():
                job.key.encoded = encoded

        pending = self._finisher().submit(finish)
        self._finishing.append(pending)
        for job in jobs:
            job.key.pending = pending
        jobs.clear()

    def _finisher(self) -> ThreadPoolExecutor:
        if self._finish_pool is None:
            self._finish_pool = ThreadPoolExecutor(1, thread_name_prefix="nvdcp-stage-finish")
        return self._finish_pool


@dataclasses.dataclass
class _Walk:
    """Where the walk puts work: jobs staged now, host copies, snapshots for the background."""

    gpu_jobs: list[GpuJob]
    copies: list[tuple[torch.Tensor, torch.Tensor]]
    snapshots: dict[torch.device, _Snapshot]
    host_snapshot: list[tuple[StagedShard, torch.Tensor, str]]


def _staged_shards(obj: Any) -> list[StagedShard]:
    """Every staged shard in a staged state dict."""
    if isinstance(obj, StagedTensor):
        return obj.staged_shards
    if isinstance(obj, Mapping):
        return [s for v in obj.values() for s in _staged_shards(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in _staged_shards(v)]
    return []


def _wait_finished(shards: list[StagedShard]) -> None:
    """Wait until every shard's record is finished; raises what finishing one raised."""
    for shard in shards:
        shard.encoded  # noqa: B018 - waits for the background


def _host_deepcopy(obj: Any) -> Any:
    """A deep copy with every tensor copied to the CPU (DefaultStager does the same)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_host_deepcopy(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _host_deepcopy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_host_deepcopy(v) for v in obj]
    return copy.deepcopy(obj)


# -- NvcompWriter as an AsyncStager ------------------------------------------------------------
_SHARED: dict[tuple[EncodeConfig, GpuConfig, str], NvcompStager] = {}
_SHARED_LOCK = threading.Lock()


def shared_stager(encoding: EncodeConfig, gpu: GpuConfig, gpu_mode: str = "compress") -> NvcompStager:
    """The process-wide stager for these settings: writers made per save share its buffers.

    :func:`close_shared_stagers` (and :func:`nvdcp.release_resources`) frees them."""
    key = (encoding, gpu, gpu_mode)
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = NvcompStager(
                codec=encoding.codec, chunk_bytes=encoding.chunk_bytes, gpu=gpu, codec_threads=encoding.codec_threads,
                gpu_mode=gpu_mode,
            )
        return _SHARED[key]


def close_shared_stagers() -> None:
    """Close and forget every shared stager (each waits for its last save to release its buffers)."""
    with _SHARED_LOCK:
        stagers = list(_SHARED.values())
        _SHARED.clear()
    for stager in stagers:
        stager.close()


class WriterStagingMixin:
    """Makes :class:`~nvdcp.NvcompWriter` a DCP ``AsyncStager``: ``dcp.async_save(sd,
    storage_writer=NvcompWriter(url))`` stages through the writer's ``stager`` or, when it has
    none, the process-wide :func:`shared_stager` for its settings (CPU fallback: host copies)."""

    _synchronize_after_execute: bool = False
    encoding: EncodeConfig
    gpu: GpuConfig
    stager: NvcompStager | None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | Future[dict[str, Any]]:
        # A writer saving deltas stages raw host copies: the base of each item is chosen when
        # the save is planned, after staging, so the background save XORs and compresses them.
        deltas = getattr(self, "delta", None) is not None or getattr(self, "base", None) is not None
        return (self.stager or shared_stager(self.encoding, self.gpu, "copy" if deltas else "compress")).stage(state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to do: staging is synchronous."""

    def close(self) -> None:
        """Nothing to close here: a ``stager`` you passed is yours to close, and the process-wide
        one is freed by :func:`nvdcp.release_resources`."""


__all__ = [
    "HostBuffers", "NvcompStager", "StageStats", "StagedShard", "StagedTensor", "WriterStagingMixin",
    "close_shared_stagers", "release_staged", "shared_stager",
]

"""nvCOMP's device and pinned allocations through caching allocators instead of cudaMalloc/cudaFree.

nvCOMP's Python binding allocates its temporary buffers (batch workspaces, pointer and size
tables, result arrays) with ``cudaMalloc``/``cudaFree`` and ``cudaMallocHost``/``cudaFreeHost``
by default. ``cudaFree`` and ``cudaFreeHost`` synchronize the whole device: every encode or
decode call then waits for all work on the GPU, the training stream's included (a stall of the
training step during an async checkpoint), and encoders on several threads serialize on each
other.

:func:`install_allocator` (called once per process on first GPU use, by
:class:`~nvdcp.gpu.encoder.GpuEncoder` and :class:`~nvdcp.gpu.decoder.GpuDecoder`) hands nvCOMP
two allocators:

- device memory from torch's CUDA caching allocator, on the stream nvCOMP names for the
  allocation (``torch.cuda.caching_allocator_alloc(n, device, stream)``): a freed block goes back
  to that stream's pool and is only reused by later work on that stream, so reuse is
  stream-ordered, as with ``cudaFreeAsync``. Nothing synchronizes.
- pinned host memory from :class:`PinnedBlockCache`: page-locked blocks (from torch's pinned
  host allocator, which never calls ``cudaFreeHost`` while it caches) kept in size classes. A
  freed block records a CUDA event on nvCOMP's stream and is handed out again only once that
  event has completed, so work nvCOMP queued on the block before freeing it is done before
  anyone else writes it.

``NVDCP_NVCOMP_ALLOCATOR=torch`` installs the above (experimental, off by default: on the H200
with nvCOMP 6.0.0.12 reading the stream argument inside the hook crashed the process, see
``requested_mode``); ``nvcomp`` (the default) keeps nvCOMP's own allocators. The env var is read
once, when the allocators are installed.
When the stream of an allocation cannot be worked out, a free synchronizes the device before the
memory is reused: what ``cudaFree`` does, so never less safe than nvCOMP's default.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Any

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "NVDCP_NVCOMP_ALLOCATOR"
MODES = ("torch", "nvcomp")

_install_lock = threading.Lock()
_installed: str | None = None  # the mode in effect once installed


def requested_mode() -> str:
    """The allocator ``NVDCP_NVCOMP_ALLOCATOR`` asks for (``nvcomp`` when unset or unknown).

    Not ``torch`` by default: on the H200 (nvCOMP 6.0.0.12, torch 2.11) the first allocation
    through the hook segfaulted reading the ``CudaStream`` argument's attributes."""
    value = os.environ.get(ENV_VAR, "").strip().lower() or "nvcomp"
    if value not in MODES:
        logger.warning("%s=%r is not one of %s; using 'nvcomp'", ENV_VAR, value, "/".join(MODES))
        return "nvcomp"
    return value


def installed_mode() -> str | None:
    """The allocators nvCOMP uses in this process: ``"torch"``, ``"nvcomp"``, or None before
    :func:`install_allocator` ran."""
    return _installed


def install_allocator(device: torch.device | int | None = None) -> str:
    """Install nvdcp's allocators into nvCOMP, once per process (thread-safe, idempotent).

    ``device`` is accepted for the callers' convenience (the GPU they are about to use); the
    allocators serve every device: each allocation goes to the device of the stream nvCOMP
    names. Returns the mode in effect: ``"torch"`` or ``"nvcomp"`` (the env var asked for it,
    or nvCOMP refused ours; a warning says so).
    """
    global _installed
    if _installed is not None:
        return _installed
    with _install_lock:
        if _installed is not None:
            return _installed
        mode = requested_mode()
        if mode == "torch":
            try:
                import nvidia.nvcomp as nv

                nv.set_device_allocator(_allocate_device)
                nv.set_pinned_allocator(PINNED_CACHE.allocate)
            except Exception as exc:  # an nvCOMP without these hooks: its own allocators stay
                logger.warning("nvdcp: could not install the caching allocators into nvCOMP (%s); "
                               "nvCOMP keeps cudaMalloc/cudaFree", exc)
                mode = "nvcomp"
        _installed = mode
        logger.debug("nvCOMP allocators: %s (device %s)", mode, device)
        return mode


# -- nvCOMP's stream argument ------------------------------------------------------------------
#: cudaStream_t values of the special streams (legacy default, legacy, per-thread default).
_SPECIAL_HANDLES = (0, 1, 2)
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def stream_handle(stream: Any) -> int | None:
    """The ``cudaStream_t`` (an integer) of nvCOMP's ``CudaStream`` argument, or None.

    nvCOMP 6's ``CudaStream`` exposes it as ``ptr`` (cupy's convention); older and other
    spellings are tried too, and a plain integer is taken as the handle.
    """
    if stream is None:
        return None
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    for name in ("ptr", "cuda_stream", "handle", "stream"):
        try:
            value = getattr(stream, name)
        except Exception:
            continue
        if callable(value):
            try:
                value = value()
            except Exception:
                continue
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    try:
        return int(stream)
    except Exception:
        return None


def stream_device(stream: Any) -> int:
    """The device index of nvCOMP's ``CudaStream`` argument (the current device when it does not say)."""
    try:
        value = getattr(stream, "device", None)
        if callable(value):
            value = value()
        if isinstance(value, torch.device):
            value = value.index
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    except Exception:
        pass
    return torch.cuda.current_device()


def _torch_stream(handle: int, device: int) -> torch.cuda.Stream:
    """A torch view of stream ``handle`` of ``device`` (to record events on)."""
    if handle == 0:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(handle, device=torch.device("cuda", device))


# -- device memory -----------------------------------------------------------------------------
class _DeviceBlock:
    """Device memory from torch's caching allocator; back to it (stream-ordered) when deleted."""

    __slots__ = ("device", "ptr", "synchronize")

    def __init__(self, nbytes: int, device: int, handle: int | None) -> None:
        self.ptr = 0
        self.device = device
        # Without the stream, reuse is only safe after all work on the device (as with cudaFree).
        self.synchronize = handle is None
        self.ptr = int(torch.cuda.caching_allocator_alloc(max(nbytes, 1), device, handle))

    def __del__(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if not ptr:
            return
        try:
            if self.synchronize:
                torch.cuda.synchronize(self.device)
            torch.cuda.caching_allocator_delete(ptr)
        except Exception:  # interpreter shutdown: the process is going away anyway
            pass


def _allocate_device(nbytes: int, stream: Any = None) -> Any:
    """nvCOMP's device allocator: torch's caching allocator on nvCOMP's stream."""
    handle = stream_handle(stream)
    if handle is None:
        _warn_once("device-stream", "nvdcp: nvCOMP gave no usable stream for a device allocation; "
                                    "its frees synchronize the device")
    with _STATS_LOCK:
        STATS["device_allocs"] += 1
        STATS["device_bytes"] += nbytes
    block = _DeviceBlock(nbytes, stream_device(stream), handle)
    return _wrap(block, stream)


def _wrap(block: Any, stream: Any) -> Any:
    """``block`` wrapped with nvCOMP's stream, which then outlives the block (nvCOMP's rule for
    stream-ordered deallocation)."""
    if stream is None:
        return block
    try:
        from nvidia.nvcomp.external_memory import ExternalMemory
    except ImportError:
        return block
    return ExternalMemory(block, stream)


# -- pinned host memory ------------------------------------------------------------------------
class _PinnedBlock:
    """A page-locked buffer lent to nvCOMP; returned to its cache when nvCOMP deletes it."""

    __slots__ = ("cache", "device", "entry", "handle", "ptr")

    def __init__(self, cache: PinnedBlockCache, entry: _CachedPinned, handle: int | None, device: int) -> None:
        self.cache = cache
        self.entry: _CachedPinned | None = entry
        self.ptr = entry.ptr
        self.handle = handle
        self.device = device

    def __del__(self) -> None:
        entry, self.entry = self.entry, None
        if entry is not None:
            try:
                self.cache.give_back(entry, self.handle, self.device)
            except Exception:  # interpreter shutdown
                pass


class _CachedPinned:
    """One cached pinned block and the event that says when its last user's work is done."""

    __slots__ = ("event", "event_device", "nbytes", "ptr", "tensor")

    def __init__(self, nbytes: int) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.ptr = self.tensor.data_ptr()
        self.nbytes = nbytes
        self.event: torch.cuda.Event | None = None
        self.event_device = -1

    def ready(self) -> bool:
        return self.event is None or self.event.query()


#: Smallest pinned size class (bytes); classes are powers of two above it.
MIN_PINNED_CLASS = 4096


class PinnedBlockCache:
    """Page-locked blocks for nvCOMP, reused in size classes, never freed during a save.

    ``allocate(n, stream)`` returns a block of the smallest power-of-two class holding ``n``
    bytes whose last user's work (an event recorded on the freeing stream) has completed, or a
    new one. Blocks come from torch's pinned allocator (``pin_memory=True``), which caches them
    itself when dropped, so no call here reaches ``cudaFreeHost``. ``max_idle_bytes`` bounds the
    idle blocks kept; :meth:`trim` drops the idle ones whose work is done.
    """

    def __init__(self, max_idle_bytes: int = 256 << 20) -> None:
        # Re-entrant: a garbage collection inside allocate() may give a block back on this thread.
        self._lock = threading.RLock()
        self._free: dict[int, deque[_CachedPinned]] = {}
        self.max_idle_bytes = max_idle_bytes
        self.idle_bytes = 0
        self.allocated_bytes = 0

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(MIN_PINNED_CLASS, 1 << max(0, int(nbytes) - 1).bit_length())

    def allocate(self, nbytes: int, stream: Any = None) -> Any:
        size = self.size_class(nbytes)
        handle = stream_handle(stream)
        device = stream_device(stream) if handle is not None else -1
        entry = self._take(size)
        if entry is None:
            entry = _CachedPinned(size)
            with self._lock:
                self.allocated_bytes += size
        with _STATS_LOCK:
            STATS["pinned_allocs"] += 1
            STATS["pinned_bytes"] += nbytes
        return _wrap(_PinnedBlock(self, entry, handle, device), stream)

    def _take(self, size: int) -> _CachedPinned | None:
        with self._lock:
            free = self._free.get(size)
            if not free:
                return None
            # Oldest first: the one most likely done. A block still in use by queued work stays.
            for _ in range(min(len(free), 4)):
                entry = free.popleft()
                if entry.ready():
                    self.idle_bytes -= entry.nbytes
                    return entry
                free.append(entry)
            return None

    def give_back(self, entry: _CachedPinned, handle: int | None, device: int) -> None:
        """nvCOMP freed ``entry``: reusable once the work queued on its stream so far is done."""
        if handle is None:
            # Unknown stream: as cudaFreeHost, wait for the whole device before reuse.
            _warn_once("pinned-stream", "nvdcp: nvCOMP gave no usable stream for a pinned allocation; "
                                        "its frees synchronize the device")
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            entry.event = None
        else:
            if entry.event is None or entry.event_device != device:
                entry.event = torch.cuda.Event()
                entry.event_device = device
            entry.event.record(_torch_stream(handle, device))
        with self._lock:
            self._free.setdefault(entry.nbytes, deque()).append(entry)
            self.idle_bytes += entry.nbytes
            if self.idle_bytes > self.max_idle_bytes:
                self._drop_ready(self.idle_bytes - self.max_idle_bytes)

    def _drop_ready(self, excess: int) -> None:
        """Drop idle blocks whose work is done, largest classes first, until ``excess`` bytes went
        (to torch's pinned cache: reused by torch, never freed with cudaFreeHost there)."""
        for size in sorted(self._free, reverse=True):
            free = self._free[size]
            keep: deque[_CachedPinned] = deque()
            while free and excess > 0:
                entry = free.popleft()
                if entry.ready():
                    excess -= entry.nbytes
                    self.idle_bytes -= entry.nbytes
                    self.allocated_bytes -= entry.nbytes
                else:
                    keep.append(entry)
            free.extendleft(reversed(keep))
            if excess <= 0:
                return

    def trim(self) -> None:
        """Drop every idle block whose work is done."""
        with self._lock:
            self._drop_ready(self.idle_bytes)


#: The process-wide pinned cache nvCOMP allocates from under the ``torch`` mode.
PINNED_CACHE = PinnedBlockCache()

#: Allocations served by nvdcp's allocators (tests and benchmarks read it).
STATS = {"device_allocs": 0, "device_bytes": 0, "pinned_allocs": 0, "pinned_bytes": 0}
_STATS_LOCK = threading.Lock()


def allocator_stats() -> dict[str, Any]:
    """The mode in effect and how many allocations nvdcp's allocators served so far."""
    with _STATS_LOCK:
        stats: dict[str, Any] = dict(STATS)
    stats["mode"] = _installed
    stats["pinned_cached_bytes"] = PINNED_CACHE.allocated_bytes
    return stats


__all__ = [
    "ENV_VAR", "PINNED_CACHE", "PinnedBlockCache", "allocator_stats", "install_allocator",
    "installed_mode", "requested_mode", "stream_handle",
]

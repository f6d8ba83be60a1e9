"""Pinned host buffers, reused across saves and loads by the object that owns the pool.

Pinning is slow (page locking), so pools outlive single saves: an :class:`~nvdcp.pipeline.encoder.ItemEncoder`
owns one, and readers share :func:`shared_pool` per limit. :func:`nvdcp.release_resources` frees them.
"""

from __future__ import annotations

import threading

import torch


def return_cached_pinned_memory() -> None:
    """Hand torch's cached, unused pinned blocks back to the system. torch's pinned allocator
    keeps a freed tensor's block (rounded up to a power of two) for the next request of its size
    class, so dropping pinned tensors alone does not lower the process's pinned footprint."""
    empty_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_cache is not None:
        empty_cache()


class PinnedPool:
    """A bounded pool of page-locked byte buffers.

    ``acquire(n)`` returns a pinned uint8 tensor of at least ``n`` bytes, reusing a free one when
    it is large enough. Before allocating past ``limit`` it frees idle buffers, so the pinned
    footprint stays near the largest working set rather than growing with every differently
    sized save. ``peak`` records the most pinned memory allocated at once. :meth:`trim` gives
    the idle buffers' memory back to the system. ``pin``: False gives pageable buffers under the
    same accounting (tests, machines without CUDA).

    Buffers freed to stay under ``limit`` go back to torch's pinned cache, not to the system:
    the next buffer of their size class reuses them without pinning again, which keeps a working
    set that outgrows ``limit`` from paying for page locking on every bucket.
    """

    def __init__(self, limit: int = 512 << 20, pin: bool = True) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.limit = limit
        self.pin = pin
        self.allocated = 0
        self.in_use = 0
        self.peak = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                # by position, not list.remove(): tensors compare elementwise
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            else:
                while self._free and self.allocated + nbytes > self.limit:
                    self.allocated -= self._free.pop().numel()
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
                self.allocated += nbytes
            self.in_use += buf.numel()
            self.peak = max(self.peak, self.allocated)
            return buf

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self.in_use -= buf.numel()
            self._free.append(buf)

    def trim(self) -> None:
        """Drop every free buffer and return its pinned memory to the system."""
        with self._lock:
            # no name may still hold a buffer when the cache is emptied (a loop variable did)
            self.allocated -= sum(b.numel() for b in self._free)
            self._free.clear()
        if self.pin:
            return_cached_pinned_memory()

    def close(self) -> None:
        """Drop every free buffer; buffers still in use are freed when their holder lets go."""
        self.trim()


_SHARED: dict[int, PinnedPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(limit: int) -> PinnedPool:
    """The process-wide pool of readers whose ``pinned_memory_bytes`` is ``limit`` (one per
    limit: a reader never changes another's bound). Freed by :func:`nvdcp.release_resources`."""
    with _SHARED_LOCK:
        if limit not in _SHARED:
            _SHARED[limit] = PinnedPool(limit)
        return _SHARED[limit]


def close_shared_pools() -> None:
    """Trim and forget every shared pool."""
    with _SHARED_LOCK:
        pools = list(_SHARED.values())
        _SHARED.clear()
    for pool in pools:
        pool.close()

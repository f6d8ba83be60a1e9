"""Host buffers for a large item's byte planes, reused across saves (the CPU path).

A save splits each large item into a plane buffer of the item's size, whose raw planes are
written straight from it. A fresh buffer per item is faulted in and zeroed by the kernel on its
first touch: on the CPU machine the split ran at 4.7-5.1 GB/s into a fresh 64 MiB buffer and at
9.5-10.5 GB/s into one written before (session 32, docs/BENCHMARKS.md). Here the memory of a
buffer goes back to a pool once the array and every view of it are gone (the item's chunks view
it until its file thread wrote them), and the next item of a fitting size reuses it, already
faulted in.
"""

from __future__ import annotations

import collections
import mmap
import threading
import weakref

import numpy as np

MiB = 1 << 20
#: Items smaller than this take a plain allocation (small ones come from the allocator's own pools).
POOLED_MIN_BYTES = 4 * MiB
#: Memory kept for reuse between saves, at most (a larger item takes a plain allocation).
POOL_BUDGET_BYTES = 512 * MiB
_HUGE_PAGE = 2 * MiB


class HostBufferPool:
    """Reused anonymous mappings handed out as uint8 arrays (:meth:`take`)."""

    def __init__(self, budget_bytes: int = POOL_BUDGET_BYTES, min_bytes: int = POOLED_MIN_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.min_bytes = min_bytes
        self._free: list[mmap.mmap] = []  # mappings no array views, ready for reuse
        # Mappings given back by finalizers, moved to ``_free`` under the lock. A finalizer may run
        # inside a garbage collection triggered while this thread holds the lock, so it takes none
        # (deque appends are atomic).
        self._returned: collections.deque[mmap.mmap] = collections.deque()
        self._held = 0  # bytes of all mappings the pool made and has not closed
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes`` (contents undefined). Its memory comes back to
        the pool when the array and every view of it are gone."""
        if nbytes < self.min_bytes or nbytes > self.budget_bytes:
            return np.empty(nbytes, dtype=np.uint8)
        block = self._reuse(nbytes) or self._new(nbytes)
        if block is None:
            return np.empty(nbytes, dtype=np.uint8)
        arr = np.frombuffer(block, dtype=np.uint8, count=nbytes)
        # numpy views of ``arr`` keep ``arr`` as their base: this runs once the last one is gone
        weakref.finalize(arr, self._give_back, block)
        return arr

    def _reuse(self, nbytes: int) -> mmap.mmap | None:
        """The smallest free mapping that holds ``nbytes`` without wasting more than as much again."""
        with self._lock:
            self._collect_returned()
            fits = [b for b in self._free if nbytes <= len(b) <= 2 * nbytes]
            if not fits:
                return None
            block = min(fits, key=len)
            self._free.remove(block)
            return block

    def _new(self, nbytes: int) -> mmap.mmap | None:
        size = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
        with self._lock:
            self._collect_returned()
            while self._free and self._held + size > self.budget_bytes:  # make room: drop idle ones
                self._close(self._free.pop(0))
            if self._held + size > self.budget_bytes:
                return None  # the budget is in use by live buffers
            self._held += size
        block = mmap.mmap(-1, size)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                block.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # a kernel without transparent huge pages: base pages, still reused
        return block

    def _give_back(self, block: mmap.mmap) -> None:
        self._returned.append(block)

    def _collect_returned(self) -> None:
        """Move given-back mappings to the free list (the caller holds the lock)."""
        while self._returned:
            self._free.append(self._returned.popleft())

    def _close(self, block: mmap.mmap) -> None:
        self._held -= len(block)
        block.close()

    def clear(self) -> None:
        """Unmap every idle buffer (ones still viewed come back, and are kept, when released)."""
        with self._lock:
            self._collect_returned()
            while self._free:
                self._close(self._free.pop())

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            self._collect_returned()
            return sum(len(b) for b in self._free)

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held


#: The process's pool for plane buffers (freed by :func:`nvdcp.release_resources`).
PLANE_BUFFERS = HostBufferPool()

"""Readahead for object stores: small range reads served from aligned blocks fetched once.

The DCP reader asks for one item at a time, in file order, from several threads. On an object
store every read is a request with tens of milliseconds of latency, so a load of a few hundred
items would cost a few hundred GETs. :class:`BlockCache` fetches the aligned block around a small
read once (threads needing a block that is being fetched wait for that fetch) and serves the
neighbouring reads from it. Memory is bounded: a block is dropped as soon as as many bytes were
read from it as it holds (a sequential load leaves nothing behind), and at most ``capacity``
blocks are kept (least recently used go first).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import threading
from collections.abc import Callable

from nvdcp.errors import TruncatedCheckpointError
from nvdcp.storage.base import read_buffer

Slot = tuple[str, int]  # (object key, block index)


class BlockCache:
    """Blocks of objects shared by the threads reading one storage: a bounded LRU.

    A failed fetch is not cached; its error reaches every thread that waited for it.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"BlockCache capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._entries: collections.OrderedDict[Slot, cf.Future[bytes]] = collections.OrderedDict()
        self._consumed: dict[Slot, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def read(
        self, key: str, offset: int, length: int, block: int, fetch: Callable[[int], bytes], where: str
    ) -> bytearray | memoryview:
        """``length`` bytes at ``offset`` of object ``key``, from blocks of ``block`` bytes.

        ``fetch(index)`` returns block ``index`` (shorter at the end of the object, empty past it).

        Raises:
            TruncatedCheckpointError: the object ends before ``offset + length``.
        """
        out = read_buffer(length)
        got = 0
        for index in range(offset // block, (offset + length - 1) // block + 1):
            data = self.get((key, index), lambda i=index: fetch(i))  # type: ignore[misc]
            start = offset + got - index * block
            piece = memoryview(data)[start : start + length - got]
            out[got : got + len(piece)] = piece
            got += len(piece)
            self.used((key, index), len(piece), len(data))
            if len(data) < block:  # the object ends in this block
                break
        if got < length:
            raise TruncatedCheckpointError(
                f"{where}: wanted {length} bytes at offset {offset}, object ends after {offset + got}"
            )
        return out

    def get(self, slot: Slot, fetch: Callable[[], bytes]) -> bytes:
        """Block ``slot``, fetched by this thread unless another one already is."""
        with self._lock:
            fut = self._entries.get(slot)
            owner = fut is None
            if fut is None:
                fut = self._entries[slot] = cf.Future()
                self._evict()
            else:
                self._entries.move_to_end(slot)
        if owner:
            try:
                fut.set_result(fetch())
            except BaseException as exc:  # noqa: BLE001 - handed to every waiting thread
                fut.set_exception(exc)
                with self._lock:
                    if self._entries.get(slot) is fut:
                        del self._entries[slot]
        return fut.result()

    def used(self, slot: Slot, nbytes: int, size: int) -> None:
        """Record ``nbytes`` read from block ``slot`` of ``size`` bytes; drop it once all were read."""
        with self._lock:
            if slot not in self._entries:
                return
            total = self._consumed.get(slot, 0) + nbytes
            if total >= size:
                del self._entries[slot]
                self._consumed.pop(slot, None)
            else:
                self._consumed[slot] = total

    def forget(self, key: str) -> None:
        """Drop every block of ``key`` (the object is being replaced or deleted)."""
        with self._lock:
            for slot in [s for s in self._entries if s[0] == key]:
                del self._entries[slot]
                self._consumed.pop(slot, None)

    def _evict(self) -> None:
        # Only finished blocks go; blocks still being fetched have waiters.
        for slot in list(self._entries):
            if len(self._entries) <= self._capacity:
                return
            if self._entries[slot].done():
                del self._entries[slot]
                self._consumed.pop(slot, None)


__all__ = ["BlockCache"]

"""Save and load summaries: bytes in and out, ratio, time per phase."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter, eq, getitem, mul, not_, or_
from typing import Any

import torch


@dataclass
class Report:
    """What one save or load moved and how long each phase took (seconds summed over threads).

    ``raw_bytes`` are the tensors' uncompressed bytes, ``stored_bytes`` what storage holds.
    Available as ``writer.last_report`` / ``reader.last_report`` and logged once at INFO.
    """

    op: str
    url: str
    raw_bytes: int = 0
    stored_bytes: int = 0
    items: int = 0
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        # The lock cannot be pickled; a writer or reader holding a report must still pickle
        # (async_save PROCESS mode, DataLoader-style workers).
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the time the ``with`` block takes to ``phase`` (e.g. ``"commit_s"``)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(0, 0, **{phase: time.perf_counter() - t0})

    @property
    def gb_per_s(self) -> float | None:
        """Uncompressed bytes per second of wall time (``None`` before ``seconds`` is set)."""
        return self.raw_bytes / self.seconds / 1e9 if self.seconds else None

    @property
    def stored_gb_per_s(self) -> float | None:
        """Stored (compressed) bytes per second of wall time: what storage saw."""
        return self.stored_bytes / self.seconds / 1e9 if self.seconds else None

    def add(self, raw: int, stored: int, **phase_seconds: float) -> None:
        with self._lock:
            self.raw_bytes += raw
            self.stored_bytes += stored
            self.items += 1 if raw or stored else 0
            for phase, s in phase_seconds.items():
                self.phases[phase] = self.phases.get(phase, 0.0) + s

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "op": self.op, "url": self.url, "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes, "ratio": round(self.ratio, 4), "items": self.items,
            "seconds": round(self.seconds, 4),
            "phases": {k: round(v, 4) for k, v in sorted(self.phases.items())},
            "gb_per_s": round(self.raw_bytes / self.seconds / 1e9, 3) if self.seconds else None,
            "stored_gb_per_s": round(self.stored_bytes / self.seconds / 1e9, 3) if self.seconds else None,
        }

    def summary(self) -> str:
        phases = " ".join(f"{k}={v:.3f}s" for k, v in sorted(self.phases.items()))
        rate = f" {self.raw_bytes / self.seconds / 1e9:.2f} GB/s" if self.seconds else ""
        return (
            f"{self.url}: {self.items} items, {self.raw_bytes} -> {self.stored_bytes} bytes "
            f"(ratio {self.ratio:.3f}) in {self.seconds:.3f}s{rate} [{phases}]"
        )

    @classmethod
    def from_metadata(cls, op: str, url: str, metadata: Any, raw_bytes: int | None = None) -> Report:
        """Whole-checkpoint totals from a ``Metadata`` whose ``storage_data`` is filled in.

        An item's raw bytes are those of the first chunk of its tensor at its offsets, or its
        stored length when there is none (bytes items). One lookup table for all chunks, and
        the records walked by ``map`` (no Python loop per item): the coordinator runs this over
        every item of the checkpoint, 14 million at 16,384 ranks (docs/SCALE.md).
        ``raw_bytes``: the raw total when the caller knows it (a save by one rank counted its
        own), so only the stored bytes and items are counted here (the raw total took 20 of
        the 27 ms per 20,000 items on the CPU machine).
        """
        from nvdcp.dcp.collector import gc_paused

        with gc_paused():  # millions of temporary tuples: no collector passes over the heap
            return cls._totals(cls(op, url), metadata, raw_bytes)

    @staticmethod
    def _totals(report: Report, metadata: Any, raw_bytes: int | None = None) -> Report:
        records = metadata.storage_data or {}
        lengths = list(map(attrgetter("length"), records.values()))
        if raw_bytes is not None and (not lengths or min(lengths) > 0):  # every record an item
            report.raw_bytes, report.items, report.stored_bytes = raw_bytes, len(lengths), sum(lengths)
            return report
        keys = list(records)
        totals = _totals_by_hint(metadata.state_dict_metadata, keys, lengths)
        if totals is None:
            totals = _totals_by_table(metadata.state_dict_metadata, keys, lengths)
        report.raw_bytes, report.items = totals
        if raw_bytes is not None:
            report.raw_bytes = raw_bytes
        report.stored_bytes = sum(lengths)
        return report


def _element_sizes(sdm: dict[str, Any]) -> dict[str, int]:
    """Element size of every tensor in ``state_dict_metadata``, by fqn (bytes items left out)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    by_dtype: dict[Any, int] = {}
    sizes = {}
    for fqn, md in sdm.items():
        if not isinstance(md, BytesStorageMetadata):
            dtype = md.properties.dtype
            if dtype not in by_dtype:
                by_dtype[dtype] = torch.empty((), dtype=dtype).element_size()
            sizes[fqn] = by_dtype[dtype]
    return sizes


def _totals_by_hint(sdm: dict[str, Any], keys: list[Any], lengths: list[int]) -> tuple[int, int] | None:
    """Raw bytes and item count through DCP's index hints (``MetadataIndex.index``: the chunk's
    place in its tensor's list), in record order, which on the coordinator is the order the
    objects sit in memory. None unless it is exact: every tensor record's hinted chunk has its
    offsets, and there are as many tensor records as chunks. Records are distinct (fqn, offsets),
    so each then has a chunk of its own and every chunk is some record's: the only chunk at
    those offsets, the one :func:`_totals_by_table` finds."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    element_size = _element_sizes(sdm)
    chunk_lists = {fqn: sdm[fqn].chunks for fqn in element_size}
    try:
        if keys and set(map(type, keys)) != {MetadataIndex}:
            return None
        fqns = list(map(attrgetter("fqn"), keys))
        is_tensor = list(map(chunk_lists.__contains__, fqns))
        tensor_keys, tensor_fqns = list(compress(keys, is_tensor)), list(compress(fqns, is_tensor))
        if len(tensor_keys) != sum(map(len, chunk_lists.values())):
            return None
        chunks = list(map(getitem, map(chunk_lists.__getitem__, tensor_fqns), map(attrgetter("index"), tensor_keys)))
        if not all(map(eq, map(attrgetter("offsets"), chunks), map(attrgetter("offset"), tensor_keys))):
            return None
        volumes = list(map(math.prod, map(attrgetter("sizes"), chunks)))
    except (TypeError, IndexError, AttributeError, KeyError):  # no hints, or not as DCP builds them
        return None
    widths = set(element_size.values())
    if len(widths) == 1:  # one element size (the usual case): one multiplication, not one per item
        raws: list[int] = volumes
        raw = sum(volumes) * widths.pop()
    else:
        raws = list(map(mul, volumes, map(element_size.__getitem__, tensor_fqns)))
        raw = sum(raws)
    others = list(compress(lengths, map(not_, is_tensor)))  # bytes items, unknown fqns: their length
    if not lengths or min(lengths) > 0:  # every record stores bytes (an nvdcp item has a header): all count
        items = len(lengths)
    else:
        items = sum(map(bool, map(or_, raws, compress(lengths, is_tensor)))) + sum(map(bool, others))
    return raw + sum(others), items


def _totals_by_table(sdm: dict[str, Any], keys: list[Any], lengths: list[int]) -> tuple[int, int]:
    """Raw bytes and item count through a table of every chunk by (fqn, offsets)."""
    raw_of: dict[tuple[Any, Any], int] = {}  # (fqn, offsets) -> raw bytes of that chunk
    for fqn, element_size in _element_sizes(sdm).items():
        chunks = sdm[fqn].chunks
        offsets = list(map(attrgetter("offsets"), chunks))  # torch.Size: hashes as a tuple
        raws = list(map(mul, map(math.prod, map(attrgetter("sizes"), chunks)), repeat(element_size)))
        try:
            table = dict(zip(zip(repeat(fqn), offsets), raws))
        except TypeError:  # offsets as lists (not as DCP builds them)
            offsets = list(map(tuple, offsets))
            table = dict(zip(zip(repeat(fqn), offsets), raws))
        if len(table) < len(offsets):  # chunks sharing offsets: the first one counts
            table = dict(zip(zip(repeat(fqn), reversed(offsets)), reversed(raws)))
        raw_of.update(table)
        if () in offsets:  # a record without offsets (None) matches a chunk at () as well
            raw_of[(fqn, None)] = raws[offsets.index(())]
    raws = list(map(raw_of.get, zip(map(attrgetter("fqn"), keys), map(attrgetter("offset"), keys)), lengths))
    return sum(raws), sum(map(bool, map(or_, raws, lengths)))

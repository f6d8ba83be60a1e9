"""Save and load summaries: bytes in and out, ratio, time per phase."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
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
    def from_metadata(cls, op: str, url: str, metadata: Any) -> Report:
        """Whole-checkpoint totals from a ``Metadata`` whose ``storage_data`` is filled in.

        An item's raw bytes come from its chunk in ``state_dict_metadata`` (found by offsets,
        one dict per tensor: linear in items, where a scan of the chunks per item was quadratic
        in ranks), or are its stored length when it has none (bytes items).
        """
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        report = cls(op, url)
        sdm = metadata.state_dict_metadata
        # Per tensor: its chunks by offsets and its element size; None for bytes and unknown items.
        tensors: dict[str, tuple[dict[tuple[int, ...], Any], int] | None] = {}
        element_sizes: dict[torch.dtype, int] = {}
        raw_total = stored_total = items = 0
        for index, info in (metadata.storage_data or {}).items():
            raw = stored = info.length
            fqn = index.fqn
            if fqn not in tensors:
                md = sdm.get(fqn)
                tensors[fqn] = None
                if md is not None and not isinstance(md, BytesStorageMetadata):
                    dtype = md.properties.dtype
                    if dtype not in element_sizes:
                        element_sizes[dtype] = torch.empty((), dtype=dtype).element_size()
                    by_offsets: dict[tuple[int, ...], Any] = {}
                    for c in md.chunks:
                        by_offsets.setdefault(tuple(c.offsets), c)  # the first chunk at those offsets
                    tensors[fqn] = (by_offsets, element_sizes[dtype])
            tensor = tensors[fqn]
            if tensor is not None:
                chunk = tensor[0].get(tuple(index.offset or ()))
                if chunk is not None:
                    numel = 1
                    for s in chunk.sizes:
                        numel *= s
                    raw = numel * tensor[1]
            raw_total += raw
            stored_total += stored
            items += 1 if raw or stored else 0
        report.raw_bytes, report.stored_bytes, report.items = raw_total, stored_total, items
        return report

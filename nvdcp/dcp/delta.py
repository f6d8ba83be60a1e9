"""Delta checkpoints, the save side: the policy, the base kept in host memory, the base per item.

A delta save stores each item whose base (the same ``MetadataIndex``, dtype and shape in the base
checkpoint) is at hand as its difference from the base item's bytes (XOR, or the zigzag integer
difference for floats: :mod:`nvdcp.transform.delta`), when that pays, and every other item whole
(docs/FORMAT.md, "Delta checkpoints"). Three pieces:

- :class:`DeltaPolicy`, the one place users set it up: a full checkpoint every ``full_every``
  saves, a bound on chain length, and the memory budgets of the base kept between saves. It
  remembers the last save it committed, so each save deltas against the previous one.
- :class:`BaseCache`: the raw bytes of the last save's items, in host memory (pinned when CUDA
  is there) within the budget, and, opted in (``gpu_cache_bytes``), those of GPU-encoded items
  in GPU memory within a per-GPU budget. A save reads each item's base from it and writes the item's new
  bytes over it in the same pass, so it holds one save, never two.
- :class:`DeltaSave`: one save's view: for each item, its base bytes (from the cache, or read back
  from the base checkpoint on storage, a chain resolved: a job resumed from a checkpoint deltas
  against it), the base item's digest, and where to keep the item's new bytes.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from nvdcp.dcp.metadata_io import METADATA_NAME, load_metadata, parse_metadata, read_metadata_bytes
from nvdcp.dcp.stock_items import is_nvdcp_record
from nvdcp.errors import IncompleteCheckpointError, MissingBaseError, NvdcpError
from nvdcp.format.delta import BaseRef, base_candidates, read_delta, relative_location, same_location
from nvdcp.format.digest import DIGEST_ATTR, digest_of_header
from nvdcp.format.header import ItemHeader
from nvdcp.pipeline.delta import (
    DEFAULT_MIN_GAIN,
    DEFAULT_MIN_ITEM_BYTES,
    DeltaInput,
    DeltaTensor,
    default_min_item_bytes,
)
from nvdcp.pipeline.policy import next_delta_plane_codecs
from nvdcp.storage import open_storage

logger = logging.getLogger(__name__)

#: Default ``full_every``: one full checkpoint, then this many minus one deltas. On the H200
#: reference GPT runs (benchmarks/delta_bench.py, docs/BENCHMARKS.md "Delta checkpoints") 8 kept the chain's
#: ratio within 1% of 16 on fp32 AdamW state (4% on bf16 weights) while a load reads at most 8
#: checkpoints instead of 16 (a depth-7 load measured 5-8x a full one).
DEFAULT_FULL_EVERY = 8
#: Default chain bound for a writer given ``base=`` without a policy.
DEFAULT_MAX_CHAIN = 16
#: Default ``chunk_bytes`` of a writer that saves deltas (``delta=`` or ``base=``): half the full
#: checkpoints' 64 KiB. A GPU delta compresses every plane of the difference, its sparse top planes
#: with nvCOMP's Zstd, whose call takes about as long as one chunk takes on its own: 4.4-4.9 ms at
#: 64 KiB, 2.7-2.8 ms at 32 KiB, whether it carries 256 or 1,024 chunks; a delta bucket within the
#: scratch budget carries a few hundred (H100,
#: benchmarks/results/nvcomp_call_probe_2026-12-06_h100_session28_chunk_sizes.json). Reference GPT
#: on /dev/shm, H100, 64 -> 32 KiB: the GPU memory a delta save adds at peak 2,657-2,748 ->
#: 1,450-2,083 MiB, bf16 delta saves 1.10-1.62x -> 0.99-1.32x a full save (fp32 moved within the
#: runs' spread), bytes +0.15% (fp32 AdamW) to +0.6% (bf16); on the CPU machine neither time nor
#: ratio moved beyond the spread
#: (benchmarks/results/delta_bench_2026-12-06_{h100,cpu}_session28_chunk{64,32}_r{1,2}.json,
#: ..._h100_session28_{decay,peak}{,_chunk32}.json).
DELTA_CHUNK_BYTES = 32 << 10
#: An item whose delta did not pay is stored whole, without trying, for this many saves, doubled
#: after each further try that did not pay (at most ``RETRY_AFTER_MAX``): AdamW's exp_avg never
#: pays (1.17x either way), and a try costs its item a second encode, on the GPU a second pass
#: after the first (the H200 reference GPT's fp32 state: a save with the try took about twice
#: as long as one without, benchmarks/results/delta_bench_2026-12-01_h200_*_profile.json).
RETRY_AFTER = 3
RETRY_AFTER_MAX = 48
#: Base items read back from storage at once (:meth:`DeltaSave.prefetch`).
PREFETCH_THREADS = 8
#: Host memory a prefetch of bases kept in GPU memory stages through at once.
PREFETCH_STAGING_BYTES = 256 << 20
#: Pinned arenas of the cache are carved from blocks of at least this size.
ARENA_BYTES = 256 << 20


def default_cache_bytes() -> int:
    """A quarter of the machine's memory, at most 64 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        total = 16 << 30
    return min(total // 4, 64 << 30)


@dataclass(frozen=True)
class SaveRef:
    """A committed save a policy remembers: where, which, and how deep in its chain (0: whole)."""

    location: str
    save_id: str
    depth: int
    digests_crc: int | None


class DeltaPolicy:
    """When to save a delta and against what; create one per training job and pass it to every
    :class:`~nvdcp.NvcompWriter` (``delta=``) of the job.

    Args:
        full_every: a full checkpoint every this many saves (1: never a delta). The saves in
            between are deltas, each against the previous one.
        max_chain: the longest chain a load may have to read (deltas back to a full save);
            default ``full_every - 1``. A save that would exceed it is saved whole.
        cache_bytes: host memory kept between saves for the last save's raw bytes (pinned when
            CUDA is there); default a quarter of the machine's memory, at most 64 GiB. Items that
            do not fit are read back from the base checkpoint on storage when the next save needs
            them (slower, never wrong). 0 keeps nothing.
        gpu_cache_bytes: GPU memory, per GPU, kept between saves for the last save's raw bytes
            of items the GPU encodes (tensors on that GPU); default 0 (the GPU's memory belongs
            to training). Items kept there need no copy across PCIe: a delta save reads its
            base there and keeps the new bytes with a device copy. Items beyond it go to the
            host part (``cache_bytes``).
        min_gain: keep a delta only when it is at least this fraction smaller than the item
            stored whole (as the writer last measured that item); otherwise store it whole.
        min_item_bytes: items smaller than this (raw bytes) are always stored whole, and their
            bytes are not kept: a delta's fixed host cost per item on each save and load
            outweighs the few bytes it saves on norms and biases (default 64 KiB, or
            ``$NVDCP_DELTA_MIN_ITEM_BYTES``; 0: any size).
        against: ``"previous"`` (default): each delta is against the save before it, a chain of
            up to ``full_every - 1`` deltas (smallest deltas; a load reads the chain back to the
            full save). ``"full"``: each delta is against the last full save (a load reads two
            checkpoints at most; the deltas grow as the state drifts from that save). The cache
            then holds the full save's bytes, written once per full save.

    The policy remembers the last save it committed; :meth:`resume_from` sets it to a checkpoint
    on storage (a resumed job's next save deltas against the checkpoint it resumed from). It
    keeps that save's ``.metadata`` bytes too (about 190 bytes per item), so the next save checks
    that its base is still there, unchanged, by reading and comparing them, not unpickling them.
    Thread-safe; not shared across processes: each rank holds its own, and the coordinator's
    decides for every rank.
    """

    def __init__(self, full_every: int = DEFAULT_FULL_EVERY, max_chain: int | None = None,
                 cache_bytes: int | None = None, min_gain: float = DEFAULT_MIN_GAIN, against: str = "previous",
                 min_item_bytes: int | None = None, gpu_cache_bytes: int = 0) -> None:
        if against not in AGAINST:
            raise ValueError(f"against must be one of {AGAINST}, got {against!r}")
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        if max_chain is not None and max_chain < 0:
            raise ValueError(f"max_chain must be >= 0, got {max_chain}")
        if cache_bytes is not None and cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
        if gpu_cache_bytes < 0:
            raise ValueError(f"gpu_cache_bytes must be >= 0, got {gpu_cache_bytes}")
        if not 0 <= min_gain < 1:
            raise ValueError(f"min_gain must be within [0, 1), got {min_gain}")
        if min_item_bytes is not None and min_item_bytes < 0:
            raise ValueError(f"min_item_bytes must be >= 0, got {min_item_bytes}")
        self.min_item_bytes = default_min_item_bytes() if min_item_bytes is None else min_item_bytes
        self.full_every = full_every
        self.max_chain = full_every - 1 if max_chain is None else max_chain
        self.min_gain = min_gain
        self.cache = BaseCache(default_cache_bytes() if cache_bytes is None else cache_bytes, gpu_cache_bytes)
        self.against = against
        self._last: SaveRef | None = None
        self._full: SaveRef | None = None  # the last save stored whole (the base when against="full")
        self._since_full = 0  # saves committed since it
        # The .metadata bytes of _last and _full, by location, as committed (or read at resume):
        # the next save's base check compares bytes instead of unpickling (resolve_base).
        self._committed_bytes: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @property
    def last(self) -> SaveRef | None:
        """The last save committed through this policy (or set by :meth:`resume_from`)."""
        return self._last

    def __getstate__(self) -> Any:
        # A copy in another process would neither see this process's saves nor share its cache
        # (and pickling the cache would copy the whole state): refuse rather than drift apart.
        raise TypeError(
            "nvdcp.DeltaPolicy does not cross processes (its cache is this process's memory): use "
            "dcp.async_save in THREAD mode (the default), not PROCESS mode, with a delta writer"
        )

    def next_base(self) -> str | None:
        """Where the next save's base is, or None when it is to be saved whole."""
        last = self._last
        if last is None or self._since_full + 1 >= self.full_every:
            return None
        if self.against == "full":
            return self._full.location if self._full is not None and self.max_chain >= 1 else None
        if last.depth + 1 > self.max_chain:
            return None
        return last.location

    @property
    def keeps_every_save(self) -> bool:
        """Whether each save's bytes replace the cache's (else only whole saves' do)."""
        return self.against == "previous"

    def committed(self, save: SaveRef, metadata_bytes: bytes | None = None) -> None:
        """Remember ``save``, just committed (``metadata_bytes``: its ``.metadata`` as written)."""
        with self._lock:
            self._last = save
            if save.depth == 0:
                self._full, self._since_full = save, 0
            else:
                self._since_full += 1
            self._remember_bytes(save, metadata_bytes)

    def _remember_bytes(self, save: SaveRef, metadata_bytes: bytes | None) -> None:
        kept = {ref.location for ref in (self._last, self._full) if ref is not None}
        self._committed_bytes = {loc: b for loc, b in self._committed_bytes.items() if loc in kept}
        if metadata_bytes is not None:
            self._committed_bytes[save.location] = metadata_bytes
        else:
            self._committed_bytes.pop(save.location, None)

    def known_base(self, location: str) -> tuple[SaveRef, bytes] | None:
        """The save this policy remembers at ``location`` (its last, or its last whole one) and
        that save's ``.metadata`` bytes, when it has both."""
        with self._lock:
            blob = self._committed_bytes.get(location)
            ref = next((r for r in (self._last, self._full) if r is not None and r.location == location), None)
        return (ref, blob) if ref is not None and blob is not None else None

    def resume_from(self, location: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> None:
        """Make the checkpoint at ``location`` the base of the next save (after a restart).

        Raises:
            IncompleteCheckpointError: no committed checkpoint there.
        """
        location = os.fspath(location)
        storage = open_storage(location, **(storage_options or {}))
        blob = read_metadata_bytes(storage)
        metadata = parse_metadata(blob, storage.describe(METADATA_NAME))
        ref = read_delta(metadata, location)
        save = SaveRef(location, _save_id(metadata), ref.depth if ref else 0, _digests_crc(metadata))
        with self._lock:
            self._last = save
            self._since_full = save.depth  # as far as the chain tells (exact for against="previous")
            self._full = save if ref is None else None
            if ref is not None and self.against == "full":
                self._full = _find_full(location, ref, storage_options or {})
            self._remember_bytes(save, blob)

    def forget(self) -> None:
        """Forget the last save and free the cache: the next save is saved whole."""
        with self._lock:
            self._last = self._full = None
            self._since_full = 0
            self._committed_bytes = {}
        self.cache.clear()


#: ``DeltaPolicy(against=...)``: what each delta is saved against.
AGAINST = ("previous", "full")


def _find_full(location: str, ref: BaseRef, storage_options: dict[str, Any]) -> SaveRef | None:
    """The checkpoint saved whole at the bottom of ``location``'s chain (None: not found)."""
    for _ in range(ref.depth):
        for candidate in base_candidates(location, ref):
            try:
                metadata = load_metadata(open_storage(candidate, **storage_options))
            except IncompleteCheckpointError:
                continue
            if _save_id(metadata) != ref.save_id:
                continue
            below = read_delta(metadata, candidate)
            if below is None:
                return SaveRef(candidate, ref.save_id, 0, _digests_crc(metadata))
            location, ref = candidate, below
            break
        else:
            return None
    return None


def _save_id(metadata: Metadata) -> str:
    return str(getattr(getattr(metadata, "storage_meta", None), "save_id", "") or "")


def _digests_crc(metadata: Metadata) -> int | None:
    record = getattr(metadata, "__dict__", {}).get(DIGEST_ATTR)
    crc = record.get("crc") if isinstance(record, dict) else None
    return crc if type(crc) is int else None


def resolve_base(target: str, candidate: str, storage_options: dict[str, Any], max_chain: int,
                 explicit: bool, known: tuple[SaveRef, bytes] | None = None) -> BaseRef | None:
    """The :class:`BaseRef` a save to ``target`` records for the base ``candidate``, or None when
    it must be saved whole (the chain would exceed ``max_chain``; with a policy's candidate, also
    when the base is gone or is ``target`` itself).

    ``known``: the save a policy committed at ``candidate`` and its ``.metadata`` bytes
    (:meth:`DeltaPolicy.known_base`). When the ``.metadata`` there still holds those bytes, its
    save id, depth and digest record are taken from ``known`` without unpickling it: that took
    0.18 s at 20,000 items and 0.93 s at 100,000 (CPU machine), on the coordinator, before any
    rank writes. Any other bytes there are read as usual.

    Raises (only when ``explicit``: the user named the base):
        ValueError: the base is the checkpoint being saved (its files are replaced by the save).
        MissingBaseError: no committed checkpoint at ``candidate``.
    """
    if same_location(target, candidate):
        if explicit:
            raise ValueError(f"base={candidate!r} is the checkpoint being saved: a delta needs its base kept elsewhere")
        return None
    storage = open_storage(candidate, **storage_options)
    try:
        blob = read_metadata_bytes(storage)
    except IncompleteCheckpointError:
        if explicit:
            raise MissingBaseError(f"base {candidate}: no committed checkpoint there") from None
        logger.warning("nvdcp: the previous checkpoint %s is gone; saving %s whole", candidate, target)
        return None
    if known is not None and known[1] == blob:
        save = known[0]
    else:
        metadata = parse_metadata(blob, storage.describe(METADATA_NAME))
        prior = read_delta(metadata, candidate)
        save = SaveRef(candidate, _save_id(metadata), prior.depth if prior else 0, _digests_crc(metadata))
    depth = save.depth + 1
    if depth > max_chain:
        logger.info("nvdcp: a delta against %s would make a chain of %d (max %d): saving whole", candidate, depth, max_chain)
        return None
    return BaseRef(candidate, save.save_id, depth, relative_location(target, candidate), save.digests_crc)


# -- the base in host memory ---------------------------------------------------------------------
@dataclass
class CacheEntry:
    """One item's raw bytes from a save, and what the next save needs to know about them."""

    data: torch.Tensor  # flat uint8, host
    dtype: torch.dtype
    shape: tuple[int, ...]
    save_id: str | None = None  # the save these bytes are from (None: being rewritten, or failed)
    digest: int = 0  # that save's record digest of the item
    whole_nbytes: int | None = None  # the item's record size when last stored whole
    skip: int = 0  # saves left that store the item whole without trying a delta (it did not pay)
    failed_tries: int = 0  # tries in a row whose delta did not pay (the next skip doubles)
    delta_codecs: tuple[str, ...] | None = None  # plane codecs of its next GPU delta (how the last one did)


class _Arenas:
    """Slots carved from arenas of one device's memory (pinned host memory when ``pin``); the
    caller says how many more arena bytes it may allocate (``room``)."""

    def __init__(self, device: torch.device, pin: bool = False) -> None:
        self.device, self.pin = device, pin
        self._arenas: list[torch.Tensor] = []
        self._free_at = 0  # bytes used of the last arena
        self.used = 0  # bytes of the slots handed out
        self.allocated = 0  # bytes of the arenas
        self.exhausted = False  # an allocation failed (GPU memory taken by training): no more tries

    def carve(self, nbytes: int, room: int) -> torch.Tensor | None:
        if not self._arenas or self._free_at + nbytes > self._arenas[-1].numel():
            if nbytes > room or self.exhausted:
                return None
            size = min(max(ARENA_BYTES, nbytes), room)
            pin = self.pin and self.device.type == "cpu"
            try:
                arena = torch.empty(size, dtype=torch.uint8, device=self.device, pin_memory=pin)
            except torch.OutOfMemoryError:
                self.exhausted = True  # the GPU's memory belongs to training: spill to the host part
                return None
            self._arenas.append(arena)
            self.allocated += size
            self._free_at = 0
        arena = self._arenas[-1]
        out = arena[self._free_at : self._free_at + nbytes]
        self._free_at += -(-nbytes // 64) * 64  # 64-byte aligned slots
        self.used += nbytes
        return out


class BaseCache:
    """The raw bytes of the last save's items, within ``budget`` bytes of host memory and, for
    items the GPU encodes, ``gpu_budget`` bytes of each GPU's memory (used first for them: the
    next save's delta then reads its base, and this save keeps its bytes, without crossing PCIe).

    Memory is carved from arenas and kept for the job's life: an item's slot is reused while its
    size stays the same, wherever it is (an item kept on a GPU and saved once from a host copy,
    as ``dcp.async_save`` stages it, keeps its GPU slot; the CPU encoder copies across); a GPU
    arena that cannot be allocated sends the items to the host part. :meth:`clear` frees it all.
    """

    def __init__(self, budget: int, gpu_budget: int = 0) -> None:
        self.budget = budget
        self.gpu_budget = gpu_budget
        self.entries: dict[MetadataIndex, CacheEntry] = {}
        self._host: dict[bool, _Arenas] = {}  # by pinned or not (one kind per process in practice)
        self._gpu: dict[torch.device, _Arenas] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether the cache may keep anything."""
        return self.budget > 0 or self.gpu_budget > 0

    @property
    def used(self) -> int:
        """Bytes of the slots handed out (host and GPU)."""
        return sum(a.used for a in self._all())

    @property
    def allocated(self) -> int:
        """Bytes of host memory allocated (never more than ``budget``)."""
        return sum(a.allocated for a in self._host.values())

    @property
    def gpu_allocated(self) -> int:
        """Bytes of GPU memory allocated, all devices (each within ``gpu_budget``)."""
        return sum(a.allocated for a in self._gpu.values())

    def _all(self) -> list[_Arenas]:
        return [*self._host.values(), *self._gpu.values()]

    def lookup(self, index: MetadataIndex, save_id: str, dtype: torch.dtype, shape: tuple[int, ...]) -> CacheEntry | None:
        """The entry of ``index`` when it holds that item of save ``save_id``."""
        entry = self.entries.get(index)
        if entry is None or entry.save_id != save_id or entry.dtype != dtype or entry.shape != shape:
            return None
        return entry

    def slot(self, index: MetadataIndex, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...], pin: bool,
             device: torch.device | None = None) -> CacheEntry | None:
        """The entry that receives ``index``'s bytes of the save being written: its own slot when
        the size is unchanged (host or GPU memory), a new one within the budgets, else None (the
        item is not kept). ``device``: the GPU that encodes the item (a new slot is in that GPU's
        memory while ``gpu_budget`` allows), None: host memory."""
        with self._lock:
            entry = self.entries.get(index)
            if entry is not None and entry.data.numel() == nbytes:
                entry.dtype, entry.shape = dtype, shape
                return entry
            if entry is not None:
                del self.entries[index]  # resharded: its old slot is lost until clear()
            data = self._carve(nbytes, pin, device if device is not None and device.type == "cuda" else None)
            if data is None:
                return None
            entry = CacheEntry(data, dtype, shape)
            self.entries[index] = entry
            return entry

    def _carve(self, nbytes: int, pin: bool, device: torch.device | None) -> torch.Tensor | None:
        if device is not None and self.gpu_budget > 0:
            gpu = self._gpu.get(device)
            if gpu is None:
                gpu = self._gpu[device] = _Arenas(device)
            data = gpu.carve(nbytes, self.gpu_budget - gpu.allocated)
            if data is not None:
                return data
        host = self._host.get(pin)
        if host is None:
            host = self._host[pin] = _Arenas(torch.device("cpu"), pin)
        return host.carve(nbytes, self.budget - self.allocated)  # one budget for every host arena

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self._host.clear()
            self._gpu.clear()


# -- one save --------------------------------------------------------------------------------
@dataclass
class DeltaSave:
    """One rank's delta bookkeeping for one save (against ``ref``, or whole when ``ref`` is None
    but the policy keeps this save's bytes for the next one)."""

    ref: BaseRef | None
    save_id: str
    cache: BaseCache | None
    storage_options: dict[str, Any]
    min_gain: float = DEFAULT_MIN_GAIN
    pin: bool = False
    #: smaller items are stored whole and not kept (``DeltaPolicy.min_item_bytes``)
    min_item_bytes: int = DEFAULT_MIN_ITEM_BYTES
    #: this save's bytes go into the cache (False: a delta against the full save, whose bytes stay)
    keep_bytes: bool = True
    #: whether the writer encodes a tensor on its GPU (then its kept bytes go to that GPU's
    #: part of the cache while it has room); None: every item is kept in host memory
    gpu_encodes: Callable[[torch.Tensor], bool] | None = None
    _base_reader: Any = None
    _touched: list[CacheEntry] = field(default_factory=list)
    _attempted: set[MetadataIndex] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def prefetch(self, items: list[tuple[MetadataIndex, torch.Tensor]], threads: int = PREFETCH_THREADS) -> None:
        """Read back from storage the bases of ``items`` the cache does not hold (a resumed job's
        first save, a rank whose cache holds another save), straight into their cache slots,
        which then serve :meth:`prepare` as hits: in groups of nearby records, ``threads`` at a
        time, each level of a group read, checked and decoded in arrays
        (:meth:`~nvdcp.dcp.reader.NvcompReader.items_raw_into`). Without it each base is read
        serially as its item is prepared (100,000 items: 100,000 reads in a row). Items beyond
        the cache budget are left to :meth:`prepare`."""
        if self.ref is None or self.cache is None or not self.cache.enabled:
            return
        ref, cache = self.ref, self.cache
        todo = [(ix, t) for ix, t in items if t.numel() * t.element_size() >= max(1, self.min_item_bytes)
                and cache.lookup(ix, ref.save_id, t.dtype, tuple(t.shape)) is None]
        if not todo:
            return
        reader = self._reader()
        slots: dict[MetadataIndex, CacheEntry] = {}
        for index, tensor in todo:
            dtype, shape = tensor.dtype, tuple(tensor.shape)
            if self._base_record(index, dtype, shape) is None:
                continue  # no such item in the base: stored whole
            entry = cache.slot(index, tensor.numel() * tensor.element_size(), dtype, shape, self.pin,
                               self._slot_device(tensor))
            if entry is None:
                continue  # beyond the budget: read by prepare()
            entry.save_id = None
            slots[index] = entry
        if not slots:
            return
        headers = self._read_into(reader, slots, threads)
        assert reader.metadata is not None
        for index, entry in slots.items():
            header = headers[index]
            whole = None if header.is_delta else reader.metadata.storage_data[index].length
            entry.digest, entry.skip, entry.whole_nbytes = digest_of_header(header), 0, whole
            entry.save_id = ref.save_id  # now a hit for prepare()

    @staticmethod
    def _read_into(reader: Any, slots: dict[MetadataIndex, CacheEntry], threads: int) -> dict[MetadataIndex, Any]:
        """Read the bases of ``slots`` into their memory; those in GPU memory through host
        buffers of at most ``PREFETCH_STAGING_BYTES`` at a time (the reader decodes into host memory)."""
        headers = reader.items_raw_into({ix: e.data for ix, e in slots.items() if not e.data.is_cuda}, threads)
        batch: list[tuple[MetadataIndex, CacheEntry]] = []
        staged = 0
        on_gpu = [(ix, e) for ix, e in slots.items() if e.data.is_cuda]
        for i, (index, entry) in enumerate(on_gpu):
            batch.append((index, entry))
            staged += entry.data.numel()
            if i + 1 < len(on_gpu) and staged < PREFETCH_STAGING_BYTES:
                continue
            staging = {ix: torch.empty(e.data.numel(), dtype=torch.uint8) for ix, e in batch}
            headers.update(reader.items_raw_into(staging, threads))
            for ix, e in batch:
                e.data.copy_(staging[ix])
            batch, staged = [], 0
        return headers

    def _slot_device(self, tensor: torch.Tensor) -> torch.device | None:
        """The GPU whose part of the cache keeps ``tensor``'s bytes (None: host memory)."""
        if tensor.is_cuda and self.gpu_encodes is not None and self.gpu_encodes(tensor):
            return tensor.device
        return None

    def prepare(self, index: MetadataIndex, tensor: torch.Tensor) -> DeltaTensor | torch.Tensor:
        """``tensor`` wrapped with its base and keep slot, or as it is (nothing to do)."""
        dtype, shape = tensor.dtype, tuple(tensor.shape)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or nbytes < self.min_item_bytes:
            return tensor
        hit = self.cache.lookup(index, self.ref.save_id, dtype, shape) if self.cache and self.ref else None
        slot = self.cache is not None and self.keep_bytes
        device = self._slot_device(tensor)
        if hit is not None and hit.skip > 0:
            hit.skip -= 1  # its delta did not pay lately: stored whole, its bytes still kept
            keep = self.cache.slot(index, nbytes, dtype, shape, self.pin, device) if slot and self.cache else None
            return self._keep_only(tensor, keep)
        base = hit.data if hit is not None else None  # GPU memory for a host tensor: the CPU encoder copies
        digest = hit.digest if hit is not None else None
        whole = hit.whole_nbytes if hit is not None else None
        keep = self.cache.slot(index, nbytes, dtype, shape, self.pin, device) if slot and self.cache else None
        if keep is not None:
            keep.save_id = None  # being rewritten by this save
            with self._lock:
                self._touched.append(keep)
        if base is None and self.ref is not None:
            base, digest, whole = self._read_base(index, dtype, shape)
            if base is not None and keep is not None:
                keep.data.copy_(base)  # the encoder reads the base from the slot, then overwrites it
                base = keep.data
        if base is None and keep is None:
            return tensor
        if base is not None:
            with self._lock:
                self._attempted.add(index)
        if keep is not None and hit is None:
            keep.whole_nbytes = whole
        on_whole = None if keep is None else functools.partial(setattr, keep, "whole_nbytes")
        codecs = hit.delta_codecs if hit is not None else None
        return DeltaTensor(tensor, DeltaInput(base, digest, keep.data if keep else None, whole, self.min_gain, on_whole,
                                              codecs))

    def _keep_only(self, tensor: torch.Tensor, keep: CacheEntry | None) -> DeltaTensor | torch.Tensor:
        if keep is None:
            return tensor
        keep.save_id = None
        with self._lock:
            self._touched.append(keep)
        return DeltaTensor(tensor, DeltaInput(None, None, keep.data, keep.whole_nbytes, self.min_gain))

    def _read_base(self, index: MetadataIndex, dtype: torch.dtype, shape: tuple[int, ...],
                   out: np.ndarray | None = None) -> tuple[torch.Tensor | None, int | None, int | None]:
        """The base item read back from storage (its chain resolved; into ``out`` when given):
        bytes, digest, whole size; ``(None, None, None)`` when the base has no such item."""
        info = self._base_record(index, dtype, shape)
        if info is None:
            return None, None, None  # no such item there: stored whole
        header, raw = self._reader().item_raw(index, out=out)
        whole = None if header.is_delta else info.length
        return torch.from_numpy(raw), digest_of_header(header), whole

    def _base_record(self, index: MetadataIndex, dtype: torch.dtype, shape: tuple[int, ...]) -> Any:
        """The base's nvdcp record of ``index`` when it has that dtype and shape, else None."""
        reader = self._reader()
        assert reader.metadata is not None
        info = reader.metadata.storage_data.get(index)
        if info is None or not is_nvdcp_record(info) or reader.expected(index) != (dtype, shape):
            return None
        return info

    def _reader(self) -> Any:
        with self._lock:
            if self._base_reader is None:
                from nvdcp.dcp.reader import NvcompReader

                assert self.ref is not None
                reader = NvcompReader(self.ref.location, storage_options=self.storage_options)
                metadata = reader.read_metadata()
                if _save_id(metadata) != self.ref.save_id:
                    raise NvdcpError(f"base {self.ref.location} was replaced during the save (save {_save_id(metadata)})")
                reader.set_up_storage_reader(metadata, False)
                self._base_reader = reader
            return self._base_reader

    def written(self, index: MetadataIndex, digest: int, whole_nbytes: int | None,
                header: ItemHeader | None = None) -> None:
        """The item's record is written: remember its digest (and whole size) for the next save,
        and, for a delta (``header``), which codec each plane of the next one gets."""
        if self.cache is None:
            return
        entry = self.cache.entries.get(index)
        if entry is None:
            return
        if header is not None and header.is_delta:
            entry.delta_codecs = next_delta_plane_codecs(header.raw_nbytes, len(header.plane_codecs),
                                                         header.chunks.sizes) or None
        if index in self._attempted:
            if whole_nbytes is not None:  # the delta was tried and did not pay
                entry.skip = min(RETRY_AFTER << entry.failed_tries, RETRY_AFTER_MAX)
                entry.failed_tries += 1
            else:
                entry.failed_tries = 0
        if entry.save_id is None:  # its bytes are this save's
            entry.digest = digest
            if whole_nbytes is not None:
                entry.whole_nbytes = whole_nbytes

    def finish(self, ok: bool) -> None:
        """The rank's items are all written (``ok``) or the save failed: stamp or drop the kept bytes."""
        with self._lock:
            touched, self._touched = self._touched, []
        for entry in touched:
            entry.save_id = self.save_id if ok else None


__all__ = [
    "BaseCache", "DEFAULT_FULL_EVERY", "DeltaPolicy", "DeltaSave", "SaveRef",
    "default_cache_bytes", "resolve_base",
]

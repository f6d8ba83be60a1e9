"""``NvcompReader``: a DCP StorageReader for checkpoints written by :class:`NvcompWriter`, by
torch's ``FileSystemWriter`` / ``FsspecWriter`` (stock DCP), or a mix of both.

For each stored item the load plan needs, it fetches exactly that item's byte range, checks the
header and every chunk's CRC32C, decodes, narrows the stored chunk to the requested region
(resharded loads) and commits it through the planner. Items are fetched and decoded on a thread
pool with a bounded window, so memory stays near ``window x largest item``.

Items are routed by their ``.metadata`` record: one with an ``nvdcp.<codec>/<v>`` descriptor takes
the path above; one without is a stock item (``torch.save`` blob, possibly through torch's stream
transforms), loaded on the CPU by :class:`~nvdcp.dcp.stock_items.StockItemReader` and checked
against ``.metadata`` (dtype, shape, range inside its file), then committed the same way.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import io
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future as PyFuture
from concurrent.futures import ThreadPoolExecutor
from operator import attrgetter, itemgetter
from typing import Any, Literal, Protocol, TypeVar, cast

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from nvdcp.cores import usable_cores
from nvdcp.dcp import descriptor
from nvdcp.dcp.any_metadata import load_any_metadata
from nvdcp.dcp.collector import collector_paused
from nvdcp.dcp.read_table import ReadTable, group_requests, index_key
from nvdcp.dcp.record_columns import ColumnBatch, records_as_expected
from nvdcp.dcp.stock_items import (
    DIRECT_MIN_BYTES,
    OpenFiles,
    StockItemReader,
    is_nvdcp_record,
    merge_fsspec_kwargs,
)
from nvdcp.errors import (
    BaseMismatchError,
    CodecUnavailableError,
    CorruptCheckpointError,
    FormatVersionError,
    IncompleteCheckpointError,
    MissingBaseError,
    MissingDataFileError,
    NvdcpError,
    TruncatedCheckpointError,
)
from nvdcp.format.crc import checksum_ranges
from nvdcp.format.delta import BaseRef, base_candidates, read_delta
from nvdcp.format.digest import DIGEST_ATTR, digest_of_header
from nvdcp.format.dtypes import code_dtype
from nvdcp.format.header import (
    KIND_BYTES,
    KIND_TENSOR,
    ItemHeader,
    item_header_size,
    parse_item_header,
    parse_item_header_only,
)
from nvdcp.gpu import gpu_available
from nvdcp.gpu.config import GpuConfig
from nvdcp.gpu.fold import ChainFolder, fold_available
from nvdcp.pipeline.cpu import (
    check_crcs,
    check_decodable,
    chunk_starts,
    chunk_table,
    codec_problem,
    decode_blocks,
    decode_item,
    describe_chunk,
    verify_chunks,
)
from nvdcp.pipeline.cpu_batch import ParsedRecords, decode_records, parse_records
from nvdcp.pipeline.tensors import tensor_nbytes
from nvdcp.report import Report
from nvdcp.storage import Storage, open_storage
from nvdcp.storage.base import Buffer
from nvdcp.storage.local import LocalStorage
from nvdcp.transform import delta as delta_transform

logger = logging.getLogger(__name__)

#: Default ``thread_count``: items fetched and decoded at once, at most this many (and the cores).
DEFAULT_MAX_THREADS = 8
#: GPU decode batches in flight at once, at most. More threads only contend for the GIL between
#: nvCOMP calls and get smaller shares of the scratch: on the H200, 4 GB in 64 MiB tensors from
#: /dev/shm loaded in 0.64-0.94 s with 4 reader threads, 1.07 s with 8, 1.69-1.73 s with 16
#: (benchmarks/results/gpu_pipeline_bench_2026-12-01_h200_knobs_large.json).
MAX_GPU_THREADS = 4
#: The GPU path first reads this much of a record, which holds the header of any item up to
#: ~500 MiB at 64 KiB chunks; a larger header costs one more read.
HEADER_PREFIX_BYTES = 1 << 16
#: Items decoded in one GPU batch, at most (a batch is also bounded by half a thread's scratch).
MAX_GPU_BATCH_ITEMS = 4096
#: Reads in flight per I/O thread: enough to overlap fetching with decoding, bounded memory.
READ_WINDOW_PER_THREAD = 2
#: Consecutive stock items loaded by one I/O task, at most this many stored bytes or items.
STOCK_BATCH_BYTES = 4 << 20
STOCK_BATCH_ITEMS = 64
#: Runs of local stock items smaller than this on average load on the calling thread.
STOCK_INLINE_MEAN_BYTES = 256 << 10


def narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The region ``offsets``/``lengths`` of ``tensor`` (a view)."""
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, start, length)
    return tensor


_Load = TypeVar("_Load", bound=Callable[..., Any])
_T = TypeVar("_T")
_K = TypeVar("_K")
_rereading = threading.local()


def _rereads(load: _Load) -> _Load:
    """Make an item (or GPU batch) load read its bytes again when they fail a check.

    A byte damaged on its way from storage (network, proxy) fails a chunk or header CRC32C once and
    reads right the next time: the load runs again, up to ``reader.reread_attempts`` times, after
    dropping the storage's cached blocks (``forget_cached``). Damage that stays raises the last
    error, which names file, item and chunk.
    """

    @functools.wraps(load)
    def run(self: NvcompReader, *args: Any, **kwargs: Any) -> Any:
        from nvdcp.errors import FormatVersionError, MissingDataFileError

        if getattr(_rereading, "active", False):  # load_item on a GPU runs _load_gpu_batch
            return load(self, *args, **kwargs)
        _rereading.active = True
        try:
            attempts = self.reread_attempts
            for attempt in range(attempts + 1):
                try:
                    return load(self, *args, **kwargs)
                except (CorruptCheckpointError, FormatVersionError) as exc:  # header fields damaged too
                    if isinstance(exc, MissingDataFileError) or attempt == attempts:
                        if attempt and exc.args and isinstance(exc.args[0], str):
                            exc.args = (f"{exc.args[0]} (the same after {attempt} re-reads)", *exc.args[1:])
                        raise
                    logger.warning("%s; reading its bytes again (re-read %d of %d)", exc, attempt + 1, attempts)
                    forget = getattr(self.storage, "forget_cached", None)
                    if forget is not None:
                        forget()
            raise AssertionError("unreachable")
        finally:
            _rereading.active = False

    return cast(_Load, run)


class NvcompReader(StorageReader):
    """Reads a checkpoint for ``dcp.load``: nvdcp, stock DCP (torch's ``FileSystemWriter`` /
    ``FsspecWriter``) or mixed; resharded loads work as with stock DCP.

    A drop-in for torch's ``FileSystemReader(path, _extension_registry)`` and
    ``FsspecReader(path, **kwargs)``: the same arguments in the same positions, then nvdcp's own,
    keyword-only.

    Args:
        path: checkpoint directory or URL.
        _extension_registry: torch's ``ExtensionRegistry`` for the stream transforms of stock
            items (as ``FileSystemReader``'s); default: torch's own (``ZStandard``).
        thread_count: items fetched and decoded at once (default: min(8, cores)).
        codec_threads: CPU threads for decompression (default: all cores).
        storage_options: backend options for URLs (see :func:`nvdcp.storage.open_storage`).
        gpu: GPU path settings (:class:`~nvdcp.gpu.config.GpuConfig`): items whose destination is
            on a CUDA device are decompressed there with nvCOMP; ``decode_device`` picks where
            host destinations are decoded on a GPU machine. Stock items load on the CPU.
        **fsspec_options: ``FsspecReader``'s ``**kwargs``: fsspec options for a URL (merged into
            ``storage_options``; an ``s3://`` URL then goes through s3fs unless ``backend`` is
            given); ignored, with a warning, for a local path.

    Raises (during ``dcp.load``, wrapped by DCP in ``CheckpointException``):
        IncompleteCheckpointError: no ``.metadata`` at ``path``.
        CorruptCheckpointError: a checksum, header or size mismatch, naming file, item and chunk;
            for a stock item, a blob that is not a ``torch.save``'d tensor of the dtype and shape
            ``.metadata`` records, naming file, offset and item.
        CodecUnavailableError: an item needs a codec this machine cannot decode.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        _extension_registry: Any = None,
        *,
        thread_count: int | None = None,
        codec_threads: int | None = None,
        storage_options: dict[str, Any] | None = None,
        gpu: GpuConfig | None = None,
        **fsspec_options: Any,
    ) -> None:
        super().__init__()
        cores = usable_cores()
        self.thread_count = thread_count or min(DEFAULT_MAX_THREADS, cores)
        if self.thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self.codec_threads = codec_threads or cores
        self.path = os.fspath(path)
        self.storage_options = merge_fsspec_kwargs("NvcompReader", self.path, storage_options, fsspec_options)
        self.storage: Storage = open_storage(self.path, **self.storage_options)
        #: Loads stock items (records without an nvdcp descriptor).
        self.stock = StockItemReader(_extension_registry)
        self.metadata: Metadata | None = None
        self.gpu = gpu or GpuConfig()
        self.last_report: Report | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._decoders = threading.local()
        #: (fqn, chunk offsets) -> (dtype, chunk shape), built from .metadata on first use
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]] | None = None
        #: .metadata's storage records by (fqn, offset), built on first use (see _records_by_key)
        self._record_keys: dict[tuple[object, object], Any] | None = None
        #: descriptor tuples already checked (see _check_descriptor)
        self._good_descriptors: set[Any] = set()
        #: descriptor tuple -> (an nvdcp record, a delta record) (see _descriptor_kind)
        self._kinds: dict[Any, tuple[bool, bool]] = {}
        #: the reader of this checkpoint's base when it is a delta (opened by set_up_storage_reader)
        self.base: NvcompReader | None = None
        #: data file sizes asked of storage (see _file_size)
        self._file_sizes: dict[str, int] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None
        state["_decoders"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._decoders = threading.local()
        self.__dict__.setdefault("_good_descriptors", set())
        self.__dict__.setdefault("_kinds", {})
        self.__dict__.setdefault("_record_keys", None)
        self.__dict__.setdefault("base", None)
        self.__dict__.setdefault("_file_sizes", {})

    def _codec_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.codec_threads, thread_name_prefix="nvdcp-codec")
        return self._pool

    # -- StorageReader -------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
            self.storage = open_storage(self.path, **self.storage_options)
        self.metadata = None
        self._file_sizes = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # Stock .metadata pickles pathlib paths (storage_meta.checkpoint_id): admitted, inert.
        metadata = load_any_metadata(self.storage)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise CorruptCheckpointError(f"{self.storage.url}: .metadata has no storage records")
        self.metadata = metadata
        self._chunks = self._record_keys = None
        self.base = self._open_base(metadata)

    # -- delta checkpoints: the chain of bases, checked before any tensor is written ----------
    def _open_base(self, metadata: Metadata) -> NvcompReader | None:
        """The reader of the base this checkpoint was saved against (None: saved whole), found
        and checked (recursively, down the chain) before any item is read.

        Raises:
            MissingBaseError: no checkpoint where the base should be.
            BaseMismatchError: a checkpoint is there, but not the save the delta was written
                against (another save id, or other item digests).
        """
        ref = read_delta(metadata, self.storage.url)
        if ref is None:
            return None
        found: list[str] = []
        for location in base_candidates(self.path, ref):
            base = NvcompReader(
                location, thread_count=self.thread_count, codec_threads=self.codec_threads,
                storage_options=self.storage_options, gpu=self.gpu,
            )
            try:
                base_md = base.read_metadata()
            except IncompleteCheckpointError:
                continue
            problem = base_problem(base_md, ref)
            if problem is not None:
                found.append(f"{location} ({problem})")
                continue
            base.set_up_storage_reader(base_md, False)  # its own base, checked in turn
            return base
        tried = ", ".join(base_candidates(self.path, ref))
        if found:
            raise BaseMismatchError(
                f"{self.storage.url}: is a delta against save {ref.save_id} of {ref.location}, but "
                f"{'; '.join(found)}: that base was overwritten; the delta cannot be loaded"
            )
        raise MissingBaseError(
            f"{self.storage.url}: is a delta against {ref.location} (save {ref.save_id}), and no checkpoint "
            f"is there (looked at {tried}); restore that checkpoint to load this one"
        )

    def items_raw_into(self, targets: dict[MetadataIndex, torch.Tensor], threads: int) -> dict[MetadataIndex, ItemHeader]:
        """Fetch, verify and decode many nvdcp items, each into its host tensor (flat, contiguous
        uint8 of the item's size), deltas resolved against their base chains: as
        :meth:`item_raw` does one item, here in groups of nearby records on ``threads`` threads,
        each level of a group read, checked and decoded in arrays. Returns each item's header
        (of its record in this checkpoint).

        Raises:
            BaseMismatchError: a base holds no such item, or another one than its delta's.
            CorruptCheckpointError: a damaged record (file, item and chunk named).
        """
        flat = {index: (tensor, tensor.numpy()) for index, tensor in targets.items()}
        self._chain_depths(list(targets))  # a base missing an item raises before any read
        report = Report("load", self.storage.url)
        headers: dict[MetadataIndex, ItemHeader] = {}
        groups = self._delta_groups(list(targets))
        with ThreadPoolExecutor(max(1, min(threads, len(groups))), thread_name_prefix="nvdcp-base") as pool:
            for done in [pool.submit(self._load_delta_group_cpu, group, report, flat) for group in groups]:
                headers.update((index, header) for index, header, _ in done.result())
        return headers

    def item_raw(self, index: MetadataIndex, report: Report | None = None, out: np.ndarray | None = None,
                 ) -> tuple[ItemHeader, np.ndarray]:
        """Fetch, verify and decode one nvdcp item into its raw bytes (host memory: ``out`` when
        given, a flat uint8 array of the item's size, e.g. its destination tensor's memory), a
        delta resolved against its base chain.

        Every record of the chain is fetched and checked first (header, every chunk's CRC32C,
        each base item's digest against the one its delta records, dtype and shape against
        ``.metadata``); only then is the chain's full record decoded into ``out`` and each delta
        XORed in, nearest base first. A bad chain raises with ``out`` untouched.

        Raises:
            BaseMismatchError: a base holds no such item, or another one than its delta's.
            CorruptCheckpointError: a damaged record (file, item and chunk named).
        """
        t0 = time.perf_counter()
        chain = self._chain_records(index)
        t1 = time.perf_counter()
        header, out = self._decode_chain(index, chain, out)
        if report is not None:
            stored = sum(len(record) for _, record, _, _ in chain)
            report.add(header.raw_nbytes, stored, read_s=t1 - t0, decode_s=time.perf_counter() - t1)
        return header, out

    def _decode_chain(self, index: MetadataIndex, chain: list[_Level], out: np.ndarray | None,
                      ) -> tuple[ItemHeader, np.ndarray]:
        """Decode a checked chain (:meth:`_chain_records`): the full record into ``out``, then each
        delta applied, nearest base first. Returns the top record's header and the bytes."""
        header = chain[0][2]
        if out is not None and out.size != header.raw_nbytes:
            raise CorruptCheckpointError(f"{chain[0][3]}: {header.raw_nbytes} stored bytes for a {out.size}-byte destination")
        pool = self._codec_pool()
        _, record, root, where = chain[-1]
        _, out = decode_item(record, where, pool, out=out, checked=root)
        element_size = _element_size(self.expected(index)[0])
        for _, record, level, where in reversed(chain[:-1]):
            _, delta = decode_item(record, where, pool, checked=level)
            delta_transform.apply_np(out, delta, level.delta_kind, element_size)
        return header, out

    def decode_record(self, index: MetadataIndex, report: Report | None = None) -> ItemHeader:
        """Check and decode one item's record as stored (a delta's XOR bytes, not combined with
        its base): header, every chunk's CRC32C, dtype and shape against ``.metadata``; what
        ``nvdcp verify`` does per item. Returns the header."""
        name, offset, length = self.record_of(index)
        where = self.where(index)
        t0 = time.perf_counter()
        with _naming_item(where):
            record = memoryview(self.storage.read_range(name, offset, length))
        t1 = time.perf_counter()
        dtype, shape = self.expected(index)
        element_size = _element_size(dtype)
        header, _ = decode_item(record, where, self._codec_pool(), element_size)
        self._check_against_metadata(header, dtype, shape, element_size, where, descriptor.is_delta(self._record(index)))
        if report is not None:
            report.add(header.raw_nbytes, length, read_s=t1 - t0, decode_s=time.perf_counter() - t1)
        return header

    def _chain_records(self, index: MetadataIndex) -> list[_Level]:
        """``index``'s record in this checkpoint and in each base it needs, nearest first, all
        checked (see :meth:`item_raw`): ``(reader, record, header, where)`` per level."""
        levels: list[_Level] = []
        reader = self
        while True:
            name, offset, length = reader.record_of(index)
            where = reader.where(index)
            with _naming_item(where):
                record = memoryview(reader.storage.read_range(name, offset, length))
            reader._check_level(index, record, where, levels)
            if not levels[-1][2].is_delta:
                return levels
            reader = reader._checked_base(index, where)

    def _check_level(self, index: MetadataIndex, record: memoryview, where: str, levels: list[_Level]) -> None:
        """Check one record of an item's chain (header, every chunk CRC32C, decodability, dtype,
        shape and delta flag against ``.metadata``, its digest against the level above) and
        append it to ``levels``."""
        header = verify_chunks(record, where)
        dtype, shape = self.expected(index)
        element_size = _element_size(dtype)
        check_decodable(header, element_size, where)
        self._check_against_metadata(header, dtype, shape, element_size, where, descriptor.is_delta(self._record(index)))
        if levels:
            above, _, above_header, above_where = levels[-1]
            above._check_base_digest(self, index, above_header, header, above_where)
        levels.append((self, record, header, where))

    def _load_delta_group_cpu(self, indexes: list[MetadataIndex], report: Report,
                              targets: dict[MetadataIndex, tuple[torch.Tensor, np.ndarray]],
                              ) -> list[tuple[MetadataIndex, ItemHeader, Any]]:
        """Rebuild a group of delta items on the host: each level of their chains read in runs of
        nearby records (one read per run, not per item and level), every record checked, then
        each item decoded (into its destination when ``targets`` has one) and its deltas applied.

        Each level's records are parsed, CRC-checked and decoded together, in arrays
        (:func:`~nvdcp.pipeline.cpu_batch.parse_records`, :func:`~nvdcp.pipeline.cpu_batch.decode_records`);
        a level that does not parse that way (damage) is checked record by record, which names
        the problem, and the group is then decoded item by item."""
        t0 = time.perf_counter()
        chains: dict[MetadataIndex, list[_Level]] = {ix: [] for ix in indexes}
        batches: list[_LevelBatch] | None = []
        reader, pending = self, list(indexes)
        while pending:
            places = [reader._place(ix) for ix in pending]
            buf, starts = reader._read_level(pending, places)
            lengths = np.fromiter((p[2] for p in places), dtype=np.int64, count=len(places))
            batch = reader._check_level_batch(pending, buf, starts, lengths, chains)
            if batch is None:
                batches = None
                for index, at, n in zip(pending, starts.tolist(), lengths.tolist()):
                    where = cast(str, _LazyWhere(reader, index))  # formatted only into an error message
                    reader._check_level(index, buf[at : at + n].data, where, chains[index])
            elif batches is not None:
                batches.append(batch)
            pending = [ix for ix in pending if chains[ix][-1][2].is_delta]
            if pending:
                base = reader._checked_base(pending[0], chains[pending[0]][-1][3])
                for index in pending[1:]:
                    base._require_item(index, chains[index][-1][3])
                reader = base
        t1 = time.perf_counter()
        out: list[tuple[MetadataIndex, ItemHeader, Any]] = []
        raws = self._decode_level_batches(batches, targets) if batches is not None else None
        for index in indexes:
            found = targets.get(index)
            if raws is not None:
                header, raw = chains[index][0][2], raws[index]
            else:
                header, raw = self._decode_chain(index, chains[index], found[1] if found else None)
            out.append((index, header, _InPlace(found[0]) if found else raw))
        stored = sum(len(record) for chain in chains.values() for _, record, _, _ in chain)
        report.add(sum(h.raw_nbytes for _, h, _ in out), stored, read_s=t1 - t0, decode_s=time.perf_counter() - t1)
        return out

    def _read_level(self, indexes: list[MetadataIndex], places: list[tuple[str, int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """The records at ``places`` (file, offset, length) read into one buffer, one read per
        run of records of a file within ``RUN_GAP_BYTES`` of each other (up to ``RUN_BYTES``,
        gaps included): the buffer and each record's offset in it. A run whose read fails is
        read again record by record, so that the error names the item."""
        order = sorted(range(len(places)), key=lambda i: places[i][:2])
        runs: list[tuple[str, int, int, list[int]]] = []  # file, start, end, members
        for i in order:
            name, offset, length = places[i]
            if runs and runs[-1][0] == name and offset - runs[-1][2] <= RUN_GAP_BYTES \
                    and offset + length - runs[-1][1] <= RUN_BYTES:
                run = runs[-1]
                runs[-1] = (name, run[1], max(run[2], offset + length), run[3] + [i])
            else:
                runs.append((name, offset, offset + length, [i]))
        for name, _, end, members in runs:  # .metadata may be hostile: no allocation past a file's end
            if end > self._file_size(name):
                self._read_one_by_one(indexes, places, members)
                raise TruncatedCheckpointError(f"{self.storage.describe(name)}: records end past the file's end")
        buf = self._level_buffer(sum(end - start for _, start, end, _ in runs))
        starts = np.empty(len(places), dtype=np.int64)
        at = 0
        for name, start, end, members in runs:
            try:
                self.storage.read_into(name, start, [buf[at : at + end - start].data])
            except (OSError, NvdcpError):
                self._read_one_by_one(indexes, places, members)
                raise
            for i in members:
                starts[i] = at + places[i][1] - start
            at += end - start
        return buf, starts

    def _level_buffer(self, size: int) -> np.ndarray:
        """``size`` bytes for one level of a delta group: this thread's reused buffer for this
        checkpoint when the level fits ``LEVEL_BUFFER_BYTES`` (each checkpoint of a chain is one
        level of a group, so a group's levels never share one), else fresh memory. Fresh pages
        for every level made a depth-1 load's reads 3-4x slower per byte than a full load's
        (CPU machine, 2026-12-06). Valid until this thread reads this checkpoint's next level."""
        if size > LEVEL_BUFFER_BYTES:
            return np.empty(size, dtype=np.uint8)
        scratch: np.ndarray | None = getattr(self._decoders, "level_buffer", None)
        if scratch is None or scratch.size < size:
            scratch = self._decoders.level_buffer = np.empty(size, dtype=np.uint8)
        return scratch[:size]

    def _read_one_by_one(self, indexes: list[MetadataIndex], places: list[tuple[str, int, int]], members: list[int]) -> None:
        """Read the records ``members`` of a run alone: the first that cannot be read raises an
        error naming its item."""
        for i in members:
            with _naming_item(_LazyWhere(self, indexes[i])):
                self.storage.read_range(*places[i])

    def _file_size(self, name: str) -> int:
        """A data file's size, asked of storage once per reader (a committed checkpoint's data
        files do not change)."""
        size = self._file_sizes.get(name)
        if size is None:
            size = self._file_sizes[name] = self.storage.size(name)
        return size

    def _check_level_batch(self, indexes: list[MetadataIndex], buf: np.ndarray, starts: np.ndarray,
                           lengths: np.ndarray, chains: dict[MetadataIndex, list[_Level]]) -> _LevelBatch | None:
        """One level of a group's chains (record ``i`` at ``buf[starts[i]:][:lengths[i]]``)
        parsed and checked together, in arrays: every check :meth:`_check_level` makes (header,
        every chunk's CRC32C, decodability, ``.metadata``, the digest the level above records).
        Appends each record's level to ``chains`` and returns the parsed level; None (``chains``
        untouched) when a record does not parse or check that way: :meth:`_check_level` then
        names it. A base item of another digest raises here, as there."""
        parsed = parse_records(buf, starts, lengths)
        if parsed is None:
            return None
        if len(parsed.sizes) and (checksum_ranges(buf, parsed.starts, parsed.sizes, threads=1) != parsed.crcs).any():
            return None
        element_sizes = []
        try:
            for index, header in zip(indexes, parsed.headers):
                dtype, shape = self.expected(index)
                element_sizes.append(_element_size(dtype))
                check_decodable(header, element_sizes[-1], "")
                self._check_against_metadata(header, dtype, shape, element_sizes[-1], "",
                                             descriptor.is_delta(self._record(index)))
        except (CorruptCheckpointError, CodecUnavailableError):
            return None
        for index, header in zip(indexes, parsed.headers):
            levels = chains[index]
            if levels:
                above, _, above_header, above_where = levels[-1]
                above._check_base_digest(self, index, above_header, header, above_where)
        for index, header, at, n in zip(indexes, parsed.headers, starts.tolist(), lengths.tolist()):
            chains[index].append((self, buf[at : at + n].data, header, cast(str, _LazyWhere(self, index))))
        return _LevelBatch(self, indexes, buf, starts, lengths, parsed, element_sizes)

    @staticmethod
    def _decode_level_batches(batches: list[_LevelBatch], targets: dict[MetadataIndex, tuple[torch.Tensor, np.ndarray]],
                              ) -> dict[MetadataIndex, np.ndarray]:
        """Decode checked levels (:meth:`_check_level_batch`), deepest first, each in one
        :func:`~nvdcp.pipeline.cpu_batch.decode_records` call: the records stored whole into
        their items' destinations (``targets``, else fresh arrays), the deltas applied to their
        items' bytes as their planes are interleaved (no scratch copy of them): those bytes are
        stored whole deeper and decoded by then (XOR and modular addition commute: the levels'
        order does not matter beyond that). Returns each item's raw bytes."""
        raws: dict[MetadataIndex, np.ndarray] = {}
        for batch in reversed(batches):
            outs: list[np.ndarray] = []
            apply: list[tuple[int, int] | None] = []
            for index, header, size in zip(batch.indexes, batch.parsed.headers, batch.element_sizes):
                if not header.is_delta:
                    found = targets.get(index)
                    raws[index] = found[1] if found else np.empty(header.raw_nbytes, dtype=np.uint8)
                outs.append(raws[index])
                apply.append((header.delta_kind, size) if header.is_delta else None)
            try:
                decode_records(batch.buf, batch.parsed, outs, apply=apply)
            except ValueError:
                # names the record that does not decode (into scratch: no item's bytes change)
                batch.decode_one_by_one([np.empty_like(out) for out in outs])
                raise
        return raws

    def _require_item(self, index: MetadataIndex, where: str) -> None:
        """A base must hold the item its delta was saved against."""
        assert self.metadata is not None
        if index not in self.metadata.storage_data:
            raise BaseMismatchError(f"{where}: its base {self.storage.url} holds no item {describe_index(index)}")

    def _checked_base(self, index: MetadataIndex, where: str) -> NvcompReader:
        base = self.base
        if base is None:
            raise CorruptCheckpointError(f"{where}: a delta item, but .metadata names no base checkpoint")
        base._require_item(index, where)
        return base

    @staticmethod
    def _check_base_digest(base: NvcompReader, index: MetadataIndex, header: ItemHeader, base_header: ItemHeader,
                           where: str) -> None:
        if digest_of_header(base_header) != header.base_digest or base_header.raw_nbytes != header.raw_nbytes:
            raise BaseMismatchError(
                f"{where}: saved against a base item of digest {header.base_digest:#010x}, but "
                f"{base.where(index)} has digest {digest_of_header(base_header):#010x}: not the base of this delta"
            )

    def _delta_loads(self, indexes: list[MetadataIndex], devices: dict[MetadataIndex, torch.device | None],
                     report: Report, by_item: dict[MetadataIndex, list[ReadItem]], planner: LoadPlanner,
                     pool: ThreadPoolExecutor, gpu_slots: threading.BoundedSemaphore) -> _Window:
        """Delta items, each rebuilt from its chain on ``pool`` while the other items load: on its
        decode device's GPU in batches when it has one (every level of a batch's chains decoded
        at once, :meth:`_start_delta_batch_gpu`), else in groups on the host
        (:meth:`_load_delta_group_cpu`, straight into the destination when one request wants the
        whole item in a dense CPU tensor). Every item's chain is planned from the ``.metadata``
        of each level first: a base missing an item raises before any record is read."""
        # destinations resolved here, on the calling thread (see _fetch_and_decode)
        targets: dict[MetadataIndex, tuple[torch.Tensor, np.ndarray]] = {}
        for index in indexes:
            reqs = by_item[index]
            if devices.get(index) is not None or len(reqs) != 1 or reqs[0].type != LoadItemType.TENSOR:
                continue
            dtype, shape = self.expected(index)
            if shape is None or any(reqs[0].storage_offsets) or tuple(reqs[0].lengths) != shape:
                continue
            target = planner.resolve_tensor(reqs[0]).detach()
            flat = _flat_destination(target, dtype, shape)
            if flat is not None:
                targets[index] = (target, flat)

        depths = self._chain_depths(indexes)  # raises here, before any read, for a base missing an item
        units: list[Callable[[], _Pending]] = [
            functools.partial(pool.submit, self._load_delta_group_cpu, group, report, targets)
            for group in self._delta_groups([ix for ix in indexes if devices.get(ix) is None])
        ]
        gpu_batches = self._delta_batches([ix for ix in indexes if devices.get(ix) is not None], devices, depths)
        for device, levels in gpu_batches:
            units.append(functools.partial(self._start_delta_batch_gpu, levels, device, report, pool, gpu_slots))
        # Rebuilt GPU items wait in fresh device memory until committed: gpu_threads batches of
        # at most a quarter of a thread's budget each (their levels included) bound it to a
        # quarter of the load's GPU budget. Host groups are 16 MiB: one per I/O thread and more.
        window = self.gpu_threads if gpu_batches else READ_WINDOW_PER_THREAD * self.thread_count
        return _Window(units, window)

    def _delta_groups(self, indexes: list[MetadataIndex]) -> list[list[MetadataIndex]]:
        """Host-decoded delta items in groups of stored records, in file order: the units of
        :meth:`_load_delta_group_cpu`. A group holds about ``DELTA_GROUP_BYTES`` (at most
        ``DELTA_GROUP_ITEMS``), less (down to ``DELTA_GROUP_MIN_BYTES``) when that leaves
        fewer than two groups per thread: a group is decoded by one thread, and a load whose
        deltas fit one or two groups kept the other cores idle (CPU machine, two cores, depth-1
        loads of 40 bf16 tensors of 1 MiB: 63 ms in one 16 MiB group, 39 ms in four; a full
        load 16-19 ms). Smaller groups than the minimum cost more in each group's reads and
        checks, and in handing the GIL between them, than they gain."""
        lengths = [self._record(index).length for index in indexes]
        per_group = min(DELTA_GROUP_BYTES, max(DELTA_GROUP_MIN_BYTES, -(-sum(lengths) // (2 * self.thread_count))))
        groups: list[list[MetadataIndex]] = [[]]
        size = 0
        for index, length in zip(indexes, lengths):
            if groups[-1] and (size + length > per_group or len(groups[-1]) >= DELTA_GROUP_ITEMS):
                groups.append([])
                size = 0
            groups[-1].append(index)
            size += length
        return [g for g in groups if g]

    def _chain_depths(self, indexes: list[MetadataIndex]) -> dict[MetadataIndex, int]:
        """How many bases each item's chain reads (0: stored whole here), from the ``.metadata``
        of each level; each base is checked to hold the items it must.

        Raises:
            BaseMismatchError: a base holds no such item.
        """
        depths = dict.fromkeys(indexes, 0)
        reader, pending = self, list(indexes)
        while pending:
            pending = [ix for ix in pending if descriptor.is_delta(reader._record(ix))]
            if not pending:
                break
            base = reader._checked_base(pending[0], reader.where(pending[0]))
            for index in pending:
                base._require_item(index, cast(str, _LazyWhere(reader, index)))  # formatted only into an error
                depths[index] += 1
            reader = base
        return depths

    def _delta_batches(self, indexes: list[MetadataIndex], devices: dict[MetadataIndex, torch.device | None],
                       depths: dict[MetadataIndex, int],
                       ) -> list[tuple[torch.device, list[tuple[NvcompReader, list[MetadataIndex]]]]]:
        """GPU-decoded delta items in batches, each as its chain levels: ``(reader, items whose
        record that level holds)``, this checkpoint first. A batch holds every level of its items
        on the device at once until they are combined, so its raw bytes times its levels stay
        within a quarter of a thread's GPU budget (cut as :func:`_batched` says). ``depths``:
        :meth:`_chain_depths`."""
        budget = self._per_device(devices, indexes, lambda device: self._gpu_scratch(device) // (4 * self.gpu_threads))
        sized = [(ix, devices[ix], self._expected_nbytes(ix) * (depths[ix] + 1)) for ix in indexes]
        batches = _batched(sized, budget, self.gpu_threads)
        return [(device, self._levels(items, depths)) for device, items in batches]

    def _levels(self, items: list[MetadataIndex], depths: dict[MetadataIndex, int],
                ) -> list[tuple[NvcompReader, list[MetadataIndex]]]:
        levels: list[tuple[NvcompReader, list[MetadataIndex]]] = []
        reader: NvcompReader | None = self
        level = 0
        while items:
            assert reader is not None  # _chain_depths found a base for every level it counted
            levels.append((reader, items))
            level += 1
            items = [ix for ix in items if depths[ix] >= level]
            reader = reader.base
        return levels

    def _expected_nbytes(self, index: MetadataIndex) -> int:
        dtype, shape = self.expected(index)
        return tensor_nbytes(shape, dtype) if dtype is not None and shape is not None else self._record(index).length

    def _start_delta_batch_gpu(self, levels: list[tuple[NvcompReader, list[MetadataIndex]]], device: torch.device,
                               report: Report, pool: ThreadPoolExecutor, gpu_slots: threading.BoundedSemaphore,
                               ) -> _Combined:
        """Queue every level of a batch's chains for decoding on ``device`` (each level one GPU
        batch of its reader, decoded into fresh device memory, never the destinations); the
        levels are combined by :meth:`_combine_levels` once all are decoded."""
        futures = [pool.submit(_holding, gpu_slots, reader._load_gpu_batch, items, device, report)
                   for reader, items in levels]
        return _Combined(futures, functools.partial(self._combine_levels, levels))

    def _combine_levels(self, levels: list[tuple[NvcompReader, list[MetadataIndex]]],
                        decoded: list[list[tuple[MetadataIndex, ItemHeader, Any]]],
                        ) -> list[tuple[MetadataIndex, ItemHeader, Any]]:
        """Rebuild a batch's items from their decoded levels: each base item's digest checked
        against what the level above records, then its bytes folded into the top level's
        (differences add up, XORs XOR up: the order does not matter). Runs on the calling thread:
        a few kernel launches per level (:class:`~nvdcp.gpu.fold.ChainFolder`; a few elementwise
        kernels per item and level without Triton)."""
        rebuilt: dict[MetadataIndex, tuple[ItemHeader, torch.Tensor, ItemHeader]] = {}  # top, bytes, last level
        folder = ChainFolder(kernel=fold_available())
        above_reader = self
        for depth, ((reader, _), results) in enumerate(zip(levels, decoded)):
            for index, header, raw in results:
                element_size = _element_size(self.expected(index)[0])
                if depth == 0:
                    folder.top(raw, header.is_delta, header.delta_kind, element_size)
                    rebuilt[index] = (header, raw, header)
                    continue
                top, acc, above = rebuilt[index]
                self._check_base_digest(reader, index, above, header, above_reader.where(index))
                if header.is_delta and header.delta_kind != top.delta_kind:
                    raise CorruptCheckpointError(
                        f"{reader.where(index)}: delta kind {header.delta_kind} under a delta of kind "
                        f"{top.delta_kind} (nvdcp never mixes them in one item's chain)"
                    )
                folder.fold(acc, raw, top.delta_kind, element_size, header.is_delta)
                rebuilt[index] = (top, acc, header)
            folder.end_level()
            above_reader = reader
        folder.finish()
        return [(index, top, acc) for index, (top, acc, _) in rebuilt.items()]

    def _commit_loaded(self, reqs: list[ReadItem], header: ItemHeader | None, data: Any, planner: LoadPlanner) -> None:
        for req in reqs:
            if isinstance(data, _InPlace):  # decoded straight into the planner's tensor (header: may be None)
                planner.commit_tensor(req, data.target)
            elif header is None:
                self._commit_stock(req, data, planner)
            else:
                self._commit(req, header, data, planner)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @collector_paused
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.metadata is not None, "set_up_storage_reader was not called"
        started = time.perf_counter()
        report = Report("load", self.storage.url)
        table = self._read_table(*group_requests(plan.items))
        devices, gpu_targets = self._decode_devices(table, planner)
        deltas = table.in_file_order(table.positions(delta=True))
        # Read in file order so a local disk sees sequential-ish access.
        order = table.in_file_order(table.positions(delta=False))

        def destination(index: MetadataIndex) -> torch.Tensor | None:
            """Where a whole large stock item goes, resolved just before its read is queued,
            so its bytes are read straight into it (see StockItemReader.read)."""
            reqs = table.requests_of(index)
            if len(reqs) != 1 or reqs[0].type != LoadItemType.TENSOR:
                return None
            dtype, shape = self.expected(index)
            if dtype is None or shape is None or tensor_nbytes(shape, dtype) < DIRECT_MIN_BYTES:
                return None
            if any(reqs[0].storage_offsets) or tuple(reqs[0].lengths) != shape:
                return None
            return planner.resolve_tensor(reqs[0]).detach()

        # One budget of GPU decode batches in flight for the delta items and the others, which
        # load at the same time (a delta checkpoint often stores some items whole).
        gpu_slots = threading.BoundedSemaphore(self.gpu_threads)
        with ThreadPoolExecutor(self.thread_count, thread_name_prefix="nvdcp-delta") as delta_pool:
            rebuilt = self._delta_loads(
                [table.keys[p] for p in deltas], {table.keys[p]: devices[p] for p in deltas}, report,
                {table.keys[p]: table.reqs[p] for p in deltas}, planner, delta_pool, gpu_slots,
            )
            loads = self._fetch_and_decode(
                table, order, devices, report, destination, cpu=_CpuPlan(planner),
                gpu_slots=gpu_slots, gpu_targets=gpu_targets,
            )
            try:
                for index, header, data in itertools.chain(rebuilt.interleave(loads), rebuilt.rest()):
                    self._commit_loaded(table.requests_of(index), header, data, planner)
            finally:
                # A delta item or a commit that failed leaves ``loads`` suspended with its read
                # pool: shut it down here. Left to the garbage collector, the shutdown (a join)
                # ran in whichever thread collected, once inside a new thread's start while it
                # held threading's shutdown lock, which the join takes: the process hung.
                loads.close()
                rebuilt.cancel()
        report.seconds = time.perf_counter() - started
        self.last_report = report
        logger.info("nvdcp load %s", report.summary())
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        from nvdcp.storage import supports_url

        return supports_url(os.fspath(checkpoint_id))

    # -- internals -----------------------------------------------------------------------------
    def _record(self, index: MetadataIndex) -> _StorageInfo:
        """The item's storage record, nvdcp or stock."""
        assert self.metadata is not None
        info = self.metadata.storage_data.get(index)
        if not isinstance(info, _StorageInfo):
            where = f"{self.storage.url} item {describe_index(index)}"
            if info is None:
                raise CorruptCheckpointError(f"{where}: no storage record in .metadata")
            raise CorruptCheckpointError(f"{where}: storage record is {type(info).__name__}, not _StorageInfo")
        return info

    def record_of(self, index: MetadataIndex) -> tuple[str, int, int]:
        """An nvdcp item's file, offset and length (its descriptor checked)."""
        info = self._record(index)
        descriptor.parse(info, f"{self.storage.url} item {describe_index(index)}")
        return info.relative_path, info.offset, info.length

    def where(self, index: MetadataIndex) -> str:
        info = self._record(index)
        return f"{self.storage.describe(info.relative_path)} @ {info.offset} item {describe_index(index)}"

    def load_stock_item(
        self, index: MetadataIndex, report: Report | None = None, into: torch.Tensor | None = None,
        files: OpenFiles | None = None,
    ) -> torch.Tensor | Buffer:
        """Fetch and check one stock item: a CPU tensor of the chunk's dtype and shape, or a byte
        item's bytes (what ``dcp.save``'s planner stored: stock stores byte items raw). With
        ``into`` (the whole item's destination), the bytes may go straight there: then ``into``
        itself is returned. ``files`` keeps local data files open across calls."""
        info = self._record(index)
        dtype, shape = self.expected(index)
        t0 = time.perf_counter()
        item = self.stock.read(
            self.storage, info.relative_path, info.offset, info.length, info.transform_descriptors,
            dtype, shape, self.where(index), into, files,
        )
        if report is not None:
            raw = item.nbytes if isinstance(item, torch.Tensor) else memoryview(item).nbytes
            report.add(raw, info.length, read_s=time.perf_counter() - t0)
        return item

    def expected(self, index: MetadataIndex) -> tuple[torch.dtype | None, tuple[int, ...] | None]:
        """The stored item's dtype and chunk shape by ``.metadata`` (None, None: a bytes item)."""
        assert self.metadata is not None
        if self._chunks is None:
            self._chunks = {
                (fqn, tuple(chunk.offsets)): (md.properties.dtype, tuple(chunk.sizes))
                for fqn, md in self.metadata.state_dict_metadata.items()
                if isinstance(md, TensorStorageMetadata)
                for chunk in md.chunks
            }
        offset = index.offset  # a torch.Size: hashes and compares as the tuple keys do
        found = self._chunks.get((index.fqn, offset if offset is not None else ()))
        if found is not None:
            return found
        md = self.metadata.state_dict_metadata.get(index.fqn)
        if isinstance(md, TensorStorageMetadata):
            return md.properties.dtype, None
        if isinstance(md, BytesStorageMetadata):
            return None, None
        return None, None

    def _read_table(self, keys: list[MetadataIndex], reqs: list[list[ReadItem]]) -> ReadTable:
        """The plan's items ``keys`` (with their requests ``reqs``) by position
        (:mod:`nvdcp.dcp.read_table`), each storage record looked up once and checked: whether
        stock DCP stored it, whether it is a delta (rebuilt from its base chain by
        :meth:`_delta_loads` while the others load). Each distinct descriptor tuple is judged and
        parsed once (a save's items share one or two); offsets and lengths are checked in one
        pass, record by record (naming the first bad one) only when that fails."""
        found = self._lookup_records(keys)
        if set(map(type, found)) - {_StorageInfo}:
            found = [self._record(index) for index in keys]  # raises for a missing or foreign record
        infos = cast(list[_StorageInfo], found)
        descs = list(map(attrgetter("transform_descriptors"), infos))
        try:  # the first item of each distinct descriptor tuple (it names a descriptor's error)
            first = dict(zip(reversed(descs), range(len(keys) - 1, -1, -1)))
        except TypeError:  # an unhashable descriptor list: each record judged alone
            kinds = [self._descriptor_kind(info) for info in infos]
            for index, info, kind in zip(keys, infos, kinds):
                if kind[0]:
                    self._check_descriptor(info, index)
        else:
            kind_of = {desc: self._descriptor_kind(infos[p]) for desc, p in first.items()}
            for desc, p in sorted(first.items(), key=itemgetter(1)):
                if kind_of[desc][0]:
                    self._check_descriptor(infos[p], keys[p])
            kinds = list(map(kind_of.__getitem__, descs))
        table = ReadTable(keys, reqs, infos, [not k[0] for k in kinds], [k[1] for k in kinds])
        if not table.lengths_are_sane():
            for index, info, stock in zip(keys, infos, table.stock):
                if not stock:
                    self._check_descriptor(info, index)
        return table

    def _lookup_records(self, keys: list[MetadataIndex]) -> list[Any]:
        """The ``.metadata`` record of each of ``keys`` (None where there is none), through
        :meth:`_records_by_key` when the plan reads most of the checkpoint; a rank that reads a
        small share of a large one (a resharded load at many ranks) looks its few up directly
        rather than keying every record (0.32-0.36 s per million records on the CPU machine)."""
        assert self.metadata is not None
        records = self.metadata.storage_data
        if 4 * len(keys) < len(records) and self._record_keys is None:
            return list(map(records.get, keys))
        try:
            return list(map(self._records_by_key().get, map(index_key, keys)))
        except (AttributeError, TypeError):  # a plan index that is no MetadataIndex: as it is
            return list(map(records.get, keys))

    def _records_by_key(self) -> dict[tuple[object, object], Any]:
        """``.metadata``'s storage records keyed by plain ``(fqn, offset)`` tuples, what a
        ``MetadataIndex`` compares by (a lookup with one hashes and compares in Python: 0.7 us
        a lookup on the CPU machine), built on first use in C passes."""
        assert self.metadata is not None
        if self._record_keys is None:
            records = self.metadata.storage_data
            try:
                self._record_keys = dict(zip(map(index_key, records), records.values()))
            except (AttributeError, TypeError):  # a key that is no MetadataIndex, an unhashable offset:
                self._record_keys = {}  # records are then looked up one by one (_record names the bad one)
        return self._record_keys

    def _decode_devices(
        self, table: ReadTable, planner: LoadPlanner
    ) -> tuple[list[torch.device | None], list[tuple[torch.Tensor, int] | None]]:
        """Where each item of ``table`` decodes (a CUDA device, or None: the CPU path), and the
        GPU tensors that items are decoded straight into, with their sizes (see
        :meth:`_whole_on_gpu`), by position.

        Destinations are resolved here, on the calling thread before any I/O thread runs: torch
        calls on the I/O threads wait on the GIL behind the others (measured on the H200: a third
        of a small-tensor load in one reshape/view per item)."""
        devices: list[torch.device | None] = [None] * len(table)
        found: list[tuple[torch.Tensor, int] | None] = [None] * len(table)
        if not gpu_available():
            return devices, found
        mode = self.gpu.decode_device
        host_bound_device: torch.device | None = None  # where items bound for host memory decode
        resolve, byte_io = planner.resolve_tensor, LoadItemType.BYTE_IO
        for p, (reqs, stock) in enumerate(zip(table.reqs, table.stock)):
            req = reqs[0]
            if stock or req.type == byte_io:
                continue
            target = resolve(req)
            if target.is_cuda:
                devices[p] = target.device
                found[p] = self._whole_on_gpu(reqs, target)
            elif mode == "cpu" or (mode == "auto" and _host_decodes_faster(table.infos[p])):
                continue
            else:
                if host_bound_device is None:
                    host_bound_device = torch.device("cuda", torch.cuda.current_device())
                devices[p] = host_bound_device
        return devices, found

    def _whole_on_gpu(self, reqs: list[ReadItem], target: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """``(tensor, nbytes)`` when one request wants the whole stored tensor and the planner's
        CUDA ``target`` can take the decoded bytes as they are (:func:`_decodes_into`)."""
        if len(reqs) != 1:
            return None
        req = reqs[0]
        dtype, shape = self.expected(req.storage_index)
        lengths = req.lengths if type(req.lengths) is torch.Size else tuple(req.lengths)  # (DCP's: a Size)
        if shape is None or any(req.storage_offsets) or lengths != shape:
            return None
        whole = target.detach() if target.requires_grad else target
        if not _decodes_into(whole, dtype, shape):
            return None
        return whole, whole.nbytes

    @property
    def gpu_threads(self) -> int:
        """GPU decode batches in flight at once: ``thread_count``, at most :data:`MAX_GPU_THREADS`."""
        return min(self.thread_count, MAX_GPU_THREADS)

    def _gpu_scratch(self, device: torch.device) -> int:
        """The load's GPU scratch on ``device``: its bound less nvCOMP's workspace share
        (:func:`nvdcp.gpu.bound.load_bound`)."""
        from nvdcp.gpu.bound import load_bound

        return load_bound(self.gpu, device)[0]

    def _gpu_decoder(self, device: torch.device) -> Any:
        from nvdcp.gpu.bound import load_bound
        from nvdcp.gpu.decoder import GpuDecoder
        from nvdcp.gpu.pinned import shared_pool

        cache = self._decoders.__dict__.setdefault("by_device", {})
        if device not in cache:
            scratch, workspace = load_bound(self.gpu, device)
            cache[device] = GpuDecoder(
                device, budget_bytes=scratch // self.gpu_threads, gdeflate_type=self.gpu.gdeflate_algorithm_type,
                pinned_bytes=self.gpu.pinned_bytes(load=True) // self.gpu_threads,
                pinned=shared_pool(self.gpu.pinned_bytes(load=True)), workspace_bytes=workspace,
            )
        return cache[device]

    #: Re-reads of an item's bytes that failed a check (CRC32C, header) before the checkpoint is
    #: declared corrupt (see :func:`_rereads`); set it on the reader (0: none).
    reread_attempts = 2

    @_rereads
    def load_item(
        self, index: MetadataIndex, report: Report, device: torch.device | None = None
    ) -> tuple[ItemHeader, np.ndarray | torch.Tensor]:
        """Fetch, verify and decode one stored item; returns its header and raw bytes
        (a numpy array, or a CUDA uint8 tensor when ``device`` is given)."""
        if device is not None:
            ((_, header, raw),) = self._load_gpu_batch([index], device, report)
            assert header is not None  # no destination was given: the bytes come with their header
            return header, raw
        name, offset, length = self.record_of(index)
        where = self.where(index)
        t0 = time.perf_counter()
        with _naming_item(where):
            record = self.storage.read_range(name, offset, length)
        t1 = time.perf_counter()
        dtype, shape = self.expected(index)
        element_size = _element_size(dtype)
        header, host_raw = decode_item(memoryview(record), where, self._codec_pool(), element_size)
        self._check_against_metadata(header, dtype, shape, element_size, where)
        report.add(header.raw_nbytes, length, read_s=t1 - t0, decode_s=time.perf_counter() - t1)
        return header, host_raw

    @_rereads
    def _load_gpu_batch(
        self, indexes: list[MetadataIndex], device: torch.device, report: Report,
        targets: Sequence[tuple[torch.Tensor, int] | None] | None = None,
    ) -> list[tuple[MetadataIndex, ItemHeader | None, Any]]:
        """Fetch and check several items' headers on the host, then read their chunks into pinned
        staging and copy, check (CRC32C) and decode them together on ``device``, in overlapped passes.

        ``targets[i]`` (optional): ``(tensor, nbytes)`` for item ``i`` when one request wants the
        whole stored tensor and the planner's tensor is a dense tensor of the stored dtype and
        shape (see :func:`_decodes_into`), resolved by the caller.
        When it is on ``device`` and its size matches the header, the item is decoded straight
        into it and comes back as ``_InPlace(tensor)`` with no header (only the commit is left);
        otherwise with its header, as a flat uint8 CUDA tensor.

        Small records come in one read per run of nearby records; a run whose headers all pass
        their checks goes to the decoder as columns (no object per item,
        :mod:`nvdcp.dcp.record_columns`), the other records one request each.
        """
        t0 = time.perf_counter()
        if isinstance(indexes, _GpuBatch):
            targets = indexes.targets if targets is None else targets
            places, deltas = indexes.places, indexes.deltas
        else:
            places, deltas = self._places(indexes)
        decoder = self._gpu_decoder(device)
        columns = ColumnBatch()
        # Small records come in one read per run of nearby records (two opens and reads per item
        # cost more than decoding it); large ones read their header, then their chunks straight
        # into pinned staging.
        in_memory = self._records_in_memory(indexes, places, deltas, targets, device, decoder, columns)
        requests, placed, request_items = self._decode_requests(indexes, places, deltas, targets, device, in_memory)
        t1 = time.perf_counter()
        # reads, host-to-device copies, checks and decodes of the batch's passes overlap (GpuDecoder)
        results: list[tuple[MetadataIndex, ItemHeader | None, Any]] = []
        raw = 0
        if len(columns):
            columns_members = columns.members()
            cols = columns.columns(lambda row: _LazyWhere(self, indexes[columns_members[row]]))
            outs = decoder.decode_columns(cols)
            raw += int(cols.raw.sum())
            for row, (i, target, out) in enumerate(zip(columns_members, columns.destinations(), outs)):
                if target is not None:
                    results.append((indexes[i], None, _InPlace(target)))
                else:
                    results.append((indexes[i], columns.header(row), out))
        if requests:
            outs = decoder.decode_many(requests)
            raw += sum(r.header.raw_nbytes for r in requests)
            results += [
                (indexes[i], r.header, _InPlace(target) if target is not None else out)
                for i, r, out, target in zip(request_items, requests, outs, placed)
            ]
        report.add(raw, sum(length for _, _, length in places), read_s=t1 - t0, decode_s=time.perf_counter() - t1)
        return results

    def _decode_requests(
        self, indexes: list[MetadataIndex], places: list[tuple[str, int, int]], deltas: list[bool],
        targets: Sequence[tuple[torch.Tensor, int] | None] | None, device: torch.device,
        in_memory: list[tuple[ItemHeader, tuple[np.ndarray, np.ndarray], np.ndarray] | None | Literal[True]],
    ) -> tuple[list[Any], list[torch.Tensor | None], list[int]]:
        """A decode request for each item not taken as columns (``in_memory[i]`` True), its
        header checked against ``.metadata``, nothing else (no torch calls: destinations were
        resolved on the calling thread; error text is built only when an error is raised)."""
        from nvdcp.gpu.decoder import DecodeRequest

        requests = []
        placed: list[torch.Tensor | None] = []
        items: list[int] = []
        for i, index in enumerate(indexes):
            parsed = in_memory[i]
            if parsed is True:
                continue
            name, offset, length = places[i]
            where = _LazyWhere(self, index)
            payload = None
            if parsed is not None:
                header, table, payload = parsed
            else:
                header = self.read_header(name, offset, length, where)  # type: ignore[arg-type]
                table = None  # built by the decoder from the header
            dtype, shape = self.expected(index)
            element_size = _element_size(dtype)
            if header.transform and header.n_planes != element_size:
                raise CorruptCheckpointError(f"{where}: {header.n_planes} byte planes for {element_size}-byte elements")
            # a v2 record exactly where .metadata says delta (_combine_levels folds it with its bases)
            self._check_against_metadata(header, dtype, shape, element_size, where, deltas[i])  # type: ignore[arg-type]
            found = targets[i] if targets is not None else None
            out = None
            whole = None
            if found is not None and found[1] == header.raw_nbytes and found[0].device == device:
                whole = out = found[0]
            placed.append(whole)
            items.append(i)
            fill = None if payload is not None else self._chunk_filler(name, offset, header)
            requests.append(DecodeRequest(header, dtype, where, payload=payload, fill=fill, out=out, table=table))
        return requests, placed, items

    def _place(self, index: MetadataIndex) -> tuple[str, int, int]:
        """:meth:`record_of` with the descriptor check done once per distinct descriptor."""
        info = self._record(index)
        self._check_descriptor(info, index)
        return info.relative_path, info.offset, info.length

    def _places(self, indexes: list[MetadataIndex]) -> tuple[list[tuple[str, int, int]], list[bool]]:
        """:meth:`_place` of each item, and whether ``.metadata`` says it is a delta record."""
        places: list[tuple[str, int, int]] = []
        deltas: list[bool] = []
        for index in indexes:
            info = self._record(index)
            self._check_descriptor(info, index)
            places.append((info.relative_path, info.offset, info.length))
            deltas.append(self._descriptor_kind(info)[1])
        return places, deltas

    def _descriptor_kind(self, info: _StorageInfo) -> tuple[bool, bool]:
        """Whether a record is nvdcp's, and a delta, judged once per distinct descriptor tuple."""
        try:
            return self._kinds[info.transform_descriptors]
        except KeyError:
            kind = self._kinds[info.transform_descriptors] = (is_nvdcp_record(info), descriptor.is_delta(info))
            return kind
        except TypeError:  # unhashable: judged alone
            return is_nvdcp_record(info), descriptor.is_delta(info)

    def _record_runs(self, places: list[tuple[str, int, int]]) -> list[_RecordRun]:
        """Records of at most ``RUN_RECORD_BYTES`` read in runs: one read per stretch of a file
        where they lie within ``RUN_GAP_BYTES`` of each other (up to ``RUN_BYTES``). Records not
        in a run (larger ones, lone ones, those of a run whose read failed: read alone, their
        errors name them) are in none."""
        runs: list[_RecordRun] = []
        small = sorted((p[0], p[1], i) for i, p in enumerate(places) if p[2] <= RUN_RECORD_BYTES)
        k = 0
        while k < len(small):
            name, start, _ = small[k]
            end = start + places[small[k][2]][2]
            j = k + 1
            while j < len(small) and small[j][0] == name and small[j][1] - end <= RUN_GAP_BYTES \
                    and small[j][1] + places[small[j][2]][2] - start <= RUN_BYTES:
                end = max(end, small[j][1] + places[small[j][2]][2])
                j += 1
            if j - k > 1:
                try:
                    buf = memoryview(self.storage.read_range(name, start, end - start)).cast("B")
                except (OSError, NvdcpError):
                    buf = None
                if buf is not None:
                    members = [i for _, _, i in small[k:j]]
                    runs.append(_RecordRun(
                        np.frombuffer(buf, dtype=np.uint8), members,
                        np.fromiter((off - start for _, off, _ in small[k:j]), dtype=np.int64, count=j - k),
                        np.fromiter((places[i][2] for i in members), dtype=np.int64, count=j - k),
                    ))
            k = j
        return runs

    def _records_in_memory(
        self, indexes: list[MetadataIndex], places: list[tuple[str, int, int]], deltas: list[bool] | None = None,
        targets: Sequence[tuple[torch.Tensor, int] | None] | None = None, device: torch.device | None = None,
        decoder: Any = None, columns: ColumnBatch | None = None,
    ) -> list[tuple[ItemHeader, tuple[np.ndarray, np.ndarray], np.ndarray] | None | Literal[True]]:
        """For each record read in a run (:meth:`_record_runs`): its header, chunk table
        (stored sizes int64, CRC32Cs uint32) and chunk bytes, every record of a run parsed and
        checked together (:func:`~nvdcp.pipeline.cpu_batch.parse_records`; one by one, naming
        the damage, where one fails). None for records not read in a run. With ``columns``:
        True for the records ``columns`` took (:meth:`ColumnBatch.add_run`, which needs
        ``deltas``, ``targets``, ``device`` and the ``decoder``)."""
        out: list[tuple[ItemHeader, tuple[np.ndarray, np.ndarray], np.ndarray] | None | Literal[True]] = [None] * len(places)
        for run in self._record_runs(places):
            parsed = parse_records(run.buffer, run.starts, run.lengths)
            ends = (run.starts + run.lengths).tolist()
            if parsed is None:
                view = run.buffer.data
                for i, at, end in zip(run.members, run.starts.tolist(), ends):
                    header, table = _header_and_table(view[at:end], _LazyWhere(self, indexes[i]))  # type: ignore[arg-type]
                    out[i] = (header, table, run.buffer[at + header.header_bytes : end])
                continue
            taken = np.zeros(len(run.members), dtype=bool)
            if columns is not None and decoder is not None and decoder.fused:
                assert deltas is not None and device is not None
                taken = columns.add_run(
                    run.buffer, parsed, run.members, [self.expected(indexes[i]) for i in run.members],
                    [deltas[i] for i in run.members],
                    [targets[i] for i in run.members] if targets is not None else [None] * len(run.members),
                    device, decoder.takes_whole,
                )
            if taken.all():
                for i in run.members:
                    out[i] = True
                continue
            first = parsed.first_chunk.tolist()
            headers = parsed.headers
            for j, (i, at, end) in enumerate(zip(run.members, run.starts.tolist(), ends)):
                if taken[j]:
                    out[i] = True
                    continue
                header = headers[j]
                c0, c1 = first[j], first[j + 1]
                out[i] = (header, (parsed.sizes[c0:c1], parsed.crcs[c0:c1]), run.buffer[at + header.header_bytes : end])
        return out

    def read_header(self, name: str, offset: int, length: int, where: str) -> ItemHeader:
        """Fetch and validate just an item's header (the GPU path reads chunks straight into staging)."""
        with _naming_item(where):
            prefix = memoryview(self.storage.read_range(name, offset, min(length, HEADER_PREFIX_BYTES)))
        size = item_header_size(prefix, where)
        if size > length:
            raise CorruptCheckpointError(f"{where}: header of {size} bytes in a record of {length}")
        if size > len(prefix):
            with _naming_item(where):
                prefix = memoryview(self.storage.read_range(name, offset, size))
        header = parse_item_header_only(prefix, where)
        if header.header_bytes + header.stored_nbytes != length:
            raise CorruptCheckpointError(
                f"{where}: chunks hold {header.stored_nbytes} bytes, record has {length - header.header_bytes}"
            )
        return header

    def _chunk_filler(self, name: str, offset: int, header: ItemHeader) -> Callable[[int, Sequence[memoryview]], None]:
        sizes = np.asarray(header.chunks, dtype=np.int64).reshape(-1, 2)[:, 0]
        starts = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=starts[1:])
        payload_at = offset + header.header_bytes

        def fill(first_chunk: int, buffers: Sequence[memoryview]) -> None:
            self.storage.read_into(name, payload_at + int(starts[first_chunk]), buffers)

        return fill

    def _gpu_batches(
        self, table: ReadTable, order: list[int], devices: list[torch.device | None],
        found: list[tuple[torch.Tensor, int] | None],
    ) -> list[tuple[torch.device, _GpuBatch]]:
        """Group the GPU-decoded items at ``order`` in ``table`` into batches whose stored size
        fits half a thread's budget, at least one per GPU thread when the load is big enough
        (:func:`_batched`). Destinations :meth:`_decode_devices` ``found`` for whole tensors
        ride with their batch (``devices`` and ``found`` by position)."""
        order_devices = [devices[p] for p in order]
        budget = {device: self._gpu_scratch(device) // (2 * self.gpu_threads)
                  for device in set(order_devices) if device is not None}
        places = table.places(order)
        batches = _batched(list(zip(order, order_devices, map(itemgetter(2), places))), budget, self.gpu_threads)
        at = {p: k for k, p in enumerate(order)}  # batch members are positions in the table
        out: list[tuple[torch.device, _GpuBatch]] = []
        for device, members in batches:
            out.append((device, _GpuBatch(
                [table.keys[p] for p in members], [found[p] for p in members],
                [places[at[p]] for p in members], [table.delta[p] for p in members],
            )))
        return out

    @staticmethod
    def _per_device(devices: dict[MetadataIndex, torch.device | None], indexes: list[MetadataIndex],
                    value: Callable[[torch.device], int]) -> dict[torch.device, int]:
        """``value(device)`` for each device of ``indexes``: asked once per device, not per item
        (gpu_budget asks the driver)."""
        out: dict[torch.device, int] = {}
        for index in indexes:
            device = devices[index]
            assert device is not None
            if device not in out:
                out[device] = value(device)
        return out

    @staticmethod
    def _check_against_metadata(
        header: ItemHeader, dtype: torch.dtype | None, shape: tuple[int, ...] | None,
        element_size: int, where: str, delta: bool = False,
    ) -> None:
        if header.is_delta != delta:  # XOR bytes must never be taken for the tensor's own
            raise CorruptCheckpointError(
                f"{where}: the record is {'a delta' if header.is_delta else 'stored whole'}, its .metadata "
                f"descriptor says {'delta' if delta else 'whole'}"
            )
        if dtype is None:
            if header.kind != KIND_BYTES:
                raise CorruptCheckpointError(f"{where}: .metadata says bytes, file holds a tensor")
            return
        if header.kind != KIND_TENSOR or code_dtype(header.dtype_code, where) != dtype:
            raise CorruptCheckpointError(f"{where}: stored dtype does not match .metadata ({dtype})")
        if shape is not None and tuple(header.shape) != shape:
            raise CorruptCheckpointError(
                f"{where}: stored shape {tuple(header.shape)} does not match .metadata {shape}"
            )
        numel = 1
        for s in header.shape:
            numel *= s
        if numel * element_size != header.raw_nbytes:
            raise CorruptCheckpointError(f"{where}: {header.raw_nbytes} bytes for shape {header.shape}")

    def _fetch_and_decode(
        self, table: ReadTable, order: list[int], devices: list[torch.device | None], report: Report,
        destination: Callable[[MetadataIndex], torch.Tensor | None] = lambda index: None,
        cpu: _CpuPlan | None = None, gpu_slots: threading.BoundedSemaphore | None = None,
        gpu_targets: list[tuple[torch.Tensor, int] | None] | None = None,
    ) -> Generator[tuple[MetadataIndex, ItemHeader | None, Any], None, None]:
        """Run batch loads of the items at ``order`` in ``table`` (CPU nvdcp items, stock items,
        GPU batches; ``devices`` and ``gpu_targets`` by position, :meth:`_decode_devices`) on the
        I/O pool, a bounded window ahead. A stock item comes with header None and a
        :class:`_StockLoaded`; its ``destination`` is resolved (on this thread) when its read is
        queued; so are the destinations of CPU items (``cpu``), whose results are
        :class:`_InPlace` when they were decoded straight into them."""
        cpu = cpu or _CpuPlan(None)
        tasks: list[Callable[[], Sequence[tuple[MetadataIndex, ItemHeader | None, Any]]] | _StockRun | _CpuBatch] = []
        # Consecutive stock items go as one task, up to a few MiB: small items are often many.
        run: list[MetadataIndex] = []
        run_bytes = 0
        batcher = _CpuBatcher(tasks)
        on_gpu: list[int] = []
        keys, infos, stock = table.keys, table.infos, table.stock
        for p in order:
            device = devices[p]
            if device is not None:
                on_gpu.append(p)
                if run:  # a stock run ends at a GPU item, as it does at a CPU one
                    tasks.append(_StockRun(run, self._inline(run, run_bytes)))
                    run, run_bytes = [], 0
                continue
            if stock[p]:
                batcher.flush()
                run.append(keys[p])
                run_bytes += infos[p].length
                if run_bytes < STOCK_BATCH_BYTES and len(run) < STOCK_BATCH_ITEMS:
                    continue
            if run:
                tasks.append(_StockRun(run, self._inline(run, run_bytes)))
                run, run_bytes = [], 0
            if not stock[p]:
                batcher.add(self._cpu_item(keys[p], infos[p], table.reqs[p]))
        batcher.flush()
        if run:
            tasks.append(_StockRun(run, self._inline(run, run_bytes)))
        # Destinations of CPU items are views of the state dict: resolve them all before any
        # thread starts, since each torch call releases the GIL and, next to busy decoding
        # threads, waits to get it back (measured: 40 us a call instead of 1).
        for task in tasks:
            if isinstance(task, _CpuBatch):
                for item in task.items:
                    cpu.resolve(item)
        gpu_slots = gpu_slots or threading.BoundedSemaphore(self.gpu_threads)
        for device, batch in self._gpu_batches(table, on_gpu, devices, gpu_targets or [None] * len(table)):
            tasks.append(functools.partial(_holding, gpu_slots, self._load_gpu_batch, batch, device, report))
        window = READ_WINDOW_PER_THREAD * self.thread_count
        with ThreadPoolExecutor(self.thread_count, thread_name_prefix="nvdcp-read") as io_pool:
            pending: list[PyFuture[Sequence[tuple[MetadataIndex, ItemHeader | None, Any]]] | _Deferred] = []
            try:
                for task in tasks:
                    if isinstance(task, _StockRun):
                        targets = [destination(index) for index in task.indexes]
                        fn = functools.partial(self._load_stock_run, task.indexes, targets, report)
                        pending.append(_Deferred(fn) if task.inline else io_pool.submit(fn))
                    elif isinstance(task, _CpuBatch):
                        pending.append(io_pool.submit(self._load_cpu_batch, task, report))
                    else:
                        pending.append(io_pool.submit(task))
                    if len(pending) >= window:
                        yield from pending.pop(0).result()
                while pending:
                    yield from pending.pop(0).result()
            finally:
                for fut in pending:
                    fut.cancel()

    # -- the CPU path: batches of records, checked and decoded into their destinations --------
    def _cpu_item(self, index: MetadataIndex, info: _StorageInfo, reqs: list[ReadItem]) -> _CpuItem:
        """What the CPU path needs of one nvdcp item (its ``.metadata`` record ``info``, checked
        by the caller, and the plan's requests of it)."""
        dtype, shape = self.expected(index)
        whole = (
            len(reqs) == 1 and reqs[0].type == LoadItemType.TENSOR and dtype is not None and shape is not None
            and not any(reqs[0].storage_offsets) and tuple(reqs[0].lengths) == shape
        )
        return _CpuItem(index, info.relative_path, info.offset, info.length, dtype, shape,
                        _element_size(dtype), reqs[0] if whole else None)

    def _check_descriptor(self, info: _StorageInfo, index: MetadataIndex) -> None:
        """:func:`descriptor.parse`'s checks, parsing each distinct descriptor tuple once (every
        item of a save shares one)."""
        offset, length, descs = info.offset, info.length, info.transform_descriptors
        try:
            known = descs in self._good_descriptors
        except TypeError:  # unhashable junk: let parse name it
            known = False
        if known and type(offset) is int and type(length) is int and offset >= 0 and length >= 0:
            return
        descriptor.parse(info, f"{self.storage.url} item {describe_index(index)}")
        if known is False and isinstance(descs, tuple):  # (a list parses too, but does not hash)
            self._good_descriptors.add(descs)

    @_rereads
    def _load_cpu_batch(
        self, batch: _CpuBatch, report: Report
    ) -> list[tuple[MetadataIndex, ItemHeader | None, Any]]:
        """Read consecutive records with one call, check their headers, then every chunk's CRC32C
        in one batched call, then decode each into its destination (or a fresh buffer)."""
        if batch.segment is not None:
            return self._load_cpu_segment(batch.items[0], *batch.segment, report)
        items = batch.items
        start = items[0].offset
        t0 = time.perf_counter()
        with _naming_item(_LazyWhere(self, items[0].index)):
            buf = self._read_bytes(items[0].name, start, batch.end - start)
        t1 = time.perf_counter()
        together = self._decode_together(items, buf, start)
        if together is not None:
            batch_results, raw_total = together
            report.add(raw_total, int(buf.size), read_s=t1 - t0, decode_s=time.perf_counter() - t1)
            return batch_results
        parsed = [self._parse_in_batch(item, buf, item.offset - start) for item in items]
        counts = [len(p[1]) for p in parsed]
        if sum(counts):
            sizes = np.concatenate([p[1] for p in parsed])
            check_crcs(buf, np.concatenate([p[2] for p in parsed]), sizes, np.concatenate([p[3] for p in parsed]),
                       functools.partial(self._name_chunk, items, parsed, np.cumsum(counts)), threads=1)
        results: list[tuple[MetadataIndex, ItemHeader | None, Any]] = []
        raw = 0
        for item, (header, sizes_i, starts_i, _) in zip(items, parsed):
            dest = item.out_view()
            out = dest if dest is not None else np.empty(header.raw_nbytes, dtype=np.uint8)
            try:
                decode_blocks(header, buf, starts_i.tolist(), sizes_i.tolist(), out, range(header.n_blocks), "")
            except (CorruptCheckpointError, CodecUnavailableError) as exc:
                raise _named(exc, self.where(item.index)) from exc.__cause__
            raw += header.raw_nbytes
            results.append((item.index, header,
                            _InPlace(item.target) if item.target is not None and dest is not None else out))
        report.add(raw, int(buf.size), read_s=t1 - t0, decode_s=time.perf_counter() - t1)
        return results

    def _decode_together(
        self, items: list[_CpuItem], buf: np.ndarray, start: int,
    ) -> tuple[list[tuple[MetadataIndex, ItemHeader | None, Any]], int] | None:
        """The batch's records parsed, checked and decoded in arrays
        (:func:`~nvdcp.pipeline.cpu_batch.parse_records`,
        :func:`~nvdcp.dcp.record_columns.records_as_expected`,
        :func:`~nvdcp.pipeline.cpu_batch.decode_records`), and their raw bytes; None when a
        record needs the one-by-one path (a delta record, or damage: that path names it). Every
        check of the one-by-one path is made; a header is built only for an item not decoded
        straight into its destination."""
        starts = np.fromiter((item.offset - start for item in items), dtype=np.int64, count=len(items))
        lengths = np.fromiter((item.length for item in items), dtype=np.int64, count=len(items))
        parsed = parse_records(buf, starts, lengths)
        if parsed is None or not records_as_expected(parsed, [(item.dtype, item.shape) for item in items],
                                                     [False] * len(items)):
            return None
        fields = parsed.fields
        if any(codec_problem((cid,)) is not None for cid in np.unique(fields.codecs).tolist()):
            return None  # a codec not decodable here: the one-by-one path says which
        outs: list[np.ndarray | int] = []
        for item, raw in zip(items, fields.raw.tolist()):
            if item.target_at:  # in place, by address
                if item.target is None or item.target.nbytes != raw:
                    return None
                outs.append(item.target_at)
                continue
            out = item.out
            if out is None:
                out = np.empty(raw, dtype=np.uint8)
            elif out.size != raw:
                return None
            outs.append(out)
        if len(parsed.sizes):
            if (checksum_ranges(buf, parsed.starts, parsed.sizes, threads=1) != parsed.crcs).any():
                return None
            try:
                decode_records(buf, parsed, outs)
            except ValueError:
                return None
        # an item decoded into its destination needs no header (see _commit_loaded)
        return [
            (item.index, None, _InPlace(item.target)) if item.target is not None
            else (item.index, parsed.headers[j], out)
            for j, (item, out) in enumerate(zip(items, outs))
        ], int(fields.raw.sum())

    def _parse_in_batch(
        self, item: _CpuItem, buf: np.ndarray, at: int
    ) -> tuple[ItemHeader, np.ndarray, np.ndarray, np.ndarray]:
        """One record of a batch: its header parsed and checked (against its bytes, ``.metadata``
        and what this machine decodes), its chunk sizes, offsets in ``buf`` and CRC32Cs."""
        record = buf[at : at + item.length].data
        try:
            header = parse_item_header(record, "")
            check_decodable(header, item.element_size, "")
            self._check_against_metadata(header, item.dtype, item.shape, item.element_size, "")
            dest = item.out_view()
            if dest is not None and dest.size != header.raw_nbytes:
                raise CorruptCheckpointError(f": {header.raw_nbytes} stored bytes for a {dest.size}-byte destination")
        except (CorruptCheckpointError, CodecUnavailableError, FormatVersionError) as exc:
            raise _named(exc, self.where(item.index)) from exc.__cause__
        sizes, crcs = chunk_table(header)
        return header, sizes, chunk_starts(sizes, at + header.header_bytes), crcs

    def _read_bytes(self, name: str, offset: int, length: int) -> np.ndarray:
        """``length`` bytes at ``offset``; from a local file into this thread's reused buffer (no
        fresh pages to fault in per read) when they fit one part, else as the storage returns them.
        The result is only valid until this thread's next read."""
        if length > READ_BUFFER_BYTES or not isinstance(self.storage, LocalStorage):
            return np.frombuffer(self.storage.read_range(name, offset, length), dtype=np.uint8)
        scratch: np.ndarray | None = getattr(self._decoders, "read_buffer", None)
        if scratch is None or scratch.size < length:
            # one size for every thread's buffer: about the largest part (bounded memory)
            scratch = self._decoders.read_buffer = np.empty(READ_BUFFER_BYTES, dtype=np.uint8)
        buf = scratch[:length]
        self.storage.read_into(name, offset, [buf.data])
        return buf

    def _name_chunk(
        self, items: list[_CpuItem], parsed: list[tuple[ItemHeader, Any, Any, Any]], ends: np.ndarray, i: int
    ) -> str:
        k = int(np.searchsorted(ends, i, side="right"))
        first = int(ends[k - 1]) if k else 0
        return describe_chunk(self.where(items[k].index), i - first, parsed[k][0].n_planes)

    def _load_cpu_segment(
        self, item: _CpuItem, k: int, parts: int, report: Report
    ) -> list[tuple[MetadataIndex, ItemHeader | None, Any]]:
        """Part ``k`` of ``parts`` of a large record: its header (read again by every part, a
        few KiB), then only this part's blocks, read, checked and decoded into the item's
        destination, so a large item never needs a second full-size buffer."""
        where = self.where(item.index)
        t0 = time.perf_counter()
        header = self.read_header(item.name, item.offset, item.length, where)
        check_decodable(header, item.element_size, where)
        self._check_against_metadata(header, item.dtype, item.shape, item.element_size, where)
        assert item.out is not None  # the segmented items' destinations are resolved at submission
        if item.out.size != header.raw_nbytes:
            raise CorruptCheckpointError(f"{where}: {header.raw_nbytes} stored bytes for a {item.out.size}-byte destination")
        n, nb = header.n_planes, header.n_blocks
        blocks = range(k * nb // parts, (k + 1) * nb // parts)
        stored = 0
        if blocks:
            table = np.asarray(header.chunks, dtype=np.int64).reshape(-1, 2)
            sizes, crcs = table[:, 0], table[:, 1].astype(np.uint32)
            starts = chunk_starts(sizes)
            c0, c1 = blocks.start * n, blocks.stop * n
            lo, hi = int(starts[c0]), int(starts[c1 - 1] + sizes[c1 - 1])
            with _naming_item(where):
                buf = self._read_bytes(item.name, item.offset + header.header_bytes + lo, hi - lo)
            t1 = time.perf_counter()
            starts -= lo
            check_crcs(buf, starts[c0:c1], sizes[c0:c1], crcs[c0:c1], lambda i: describe_chunk(where, c0 + i, n), threads=1)
            decode_blocks(header, buf, starts.tolist(), sizes.tolist(), item.out, blocks, where)
            stored = hi - lo
            report.add(sum(header.block_elements(b) for b in blocks) * n, stored,
                       read_s=t1 - t0, decode_s=time.perf_counter() - t1)
        if k < parts - 1:
            return []
        return [(item.index, header, _InPlace(item.target) if item.target is not None else item.out)]

    def _load_cpu_task(self, index: MetadataIndex, report: Report) -> list[tuple[MetadataIndex, ItemHeader | None, Any]]:
        header, raw = self.load_item(index, report)
        return [(index, header, raw)]

    def _inline(self, run: list[MetadataIndex], run_bytes: int) -> bool:
        """Whether to load a run of stock items on the calling thread: small items of a local
        file cost mostly Python (torch.load's unpickling), which threads only contend for."""
        return isinstance(self.storage, LocalStorage) and run_bytes < len(run) * STOCK_INLINE_MEAN_BYTES

    def _load_stock_run(
        self, indexes: list[MetadataIndex], targets: list[torch.Tensor | None], report: Report
    ) -> list[tuple[MetadataIndex, ItemHeader | None, Any]]:
        with contextlib.ExitStack() as stack:
            files = stack.enter_context(OpenFiles(self.storage)) if isinstance(self.storage, LocalStorage) else None
            return [
                (index, None, _StockLoaded(self.load_stock_item(index, report, target, files), target))
                for index, target in zip(indexes, targets)
            ]

    @staticmethod
    def _commit(req: ReadItem, header: ItemHeader, raw: np.ndarray | torch.Tensor, planner: LoadPlanner) -> None:
        if req.type == LoadItemType.BYTE_IO:
            assert isinstance(raw, np.ndarray)
            planner.load_bytes(req, io.BytesIO(raw.tobytes()))
            return
        dtype = code_dtype(header.dtype_code, "")
        flat = raw if isinstance(raw, torch.Tensor) else torch.from_numpy(raw)
        NvcompReader._commit_tensor(req, flat.view(dtype).reshape(header.shape), planner)

    @staticmethod
    def _commit_stock(req: ReadItem, loaded: _StockLoaded, planner: LoadPlanner) -> None:
        item, target = loaded.item, loaded.target
        if target is not None and item is target:  # its bytes were read straight into place
            planner.commit_tensor(req, target)
            return
        if req.type == LoadItemType.BYTE_IO:
            if isinstance(item, torch.Tensor):
                raise CorruptCheckpointError(f"item {describe_index(req.storage_index)}: stored a tensor, planner wants bytes")
            planner.load_bytes(req, io.BytesIO(item))
            return
        if not isinstance(item, torch.Tensor):
            raise CorruptCheckpointError(f"item {describe_index(req.storage_index)}: stored bytes, planner wants a tensor")
        NvcompReader._commit_tensor(req, item, planner, target)

    @staticmethod
    def _commit_tensor(
        req: ReadItem, stored: torch.Tensor, planner: LoadPlanner, target: torch.Tensor | None = None
    ) -> None:
        src = narrow(stored, req.storage_offsets, req.lengths)
        if target is None:
            target = planner.resolve_tensor(req).detach()
        if target.shape != src.shape:
            raise CorruptCheckpointError(
                f"item {describe_index(req.storage_index)}: planner wants {tuple(target.shape)}, "
                f"stored region is {tuple(src.shape)}"
            )
        target.copy_(src)
        planner.commit_tensor(req, target)


#: One level of an item's chain: the reader of that checkpoint, the record, its header, its name.
_Level = tuple["NvcompReader", memoryview, ItemHeader, str]


@dataclasses.dataclass
class _LevelBatch:
    """One level of a group of delta chains (:meth:`NvcompReader._check_level_batch`): the
    records of ``indexes`` in ``reader``'s checkpoint, read into ``buf`` (record ``i`` at
    ``starts[i]``, ``lengths[i]`` bytes), parsed and checked."""

    reader: NvcompReader
    indexes: list[MetadataIndex]
    buf: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    parsed: ParsedRecords
    element_sizes: list[int]

    def decode_one_by_one(self, outs: list[np.ndarray]) -> None:
        """Decode each record on its own (:func:`~nvdcp.pipeline.cpu.decode_item`), which raises
        naming the first one that does not decode."""
        for index, header, out, at, n in zip(self.indexes, self.parsed.headers, outs, self.starts.tolist(),
                                             self.lengths.tolist()):
            decode_item(self.buf[at : at + n].data, self.reader.where(index), None, out=out, checked=header)
#: Host-decoded delta items are rebuilt in groups of about this many stored bytes (or items); a
#: small load's groups are smaller (two per thread) but not below ``DELTA_GROUP_MIN_BYTES``.
DELTA_GROUP_BYTES = 16 << 20
DELTA_GROUP_ITEMS = 1024
DELTA_GROUP_MIN_BYTES = 4 << 20
#: GPU batches read records up to this size in runs (see NvcompReader._read_record_runs).
RUN_RECORD_BYTES = 1 << 20
RUN_GAP_BYTES = 64 << 10
RUN_BYTES = 64 << 20


def _header_and_table(rec: memoryview, where: str) -> tuple[ItemHeader, tuple[np.ndarray, np.ndarray]]:
    """An in-memory record's header, checked as ``NvcompReader.read_header`` checks it, and its
    chunk table as arrays read in place (stored sizes int64, CRC32Cs uint32): how a GPU batch
    parses a record of a run that could not be parsed with the others (it names the damage)."""
    size = item_header_size(rec, where)
    if size > len(rec):
        raise CorruptCheckpointError(f"{where}: header of {size} bytes in a record of {len(rec)}")
    header = parse_item_header_only(rec, where)
    table = chunk_table(header)
    stored = int(table[0].sum())
    if header.header_bytes + stored != len(rec):
        raise CorruptCheckpointError(f"{where}: chunks hold {stored} bytes, record has {len(rec) - header.header_bytes}")
    return header, table


@dataclasses.dataclass
class _RecordRun:
    """Records read with one call: ``buffer[starts[j] : starts[j] + lengths[j]]`` is the record
    of ``places[members[j]]``."""

    buffer: np.ndarray  # uint8
    members: list[int]
    starts: np.ndarray  # int64
    lengths: np.ndarray  # int64


class _GpuBatch(list):  # type: ignore[type-arg]
    """A GPU batch's indexes, with each item's destination (tensor, its size in bytes) when
    decoded straight into it (None: decoded to a new tensor), and each item's record and whether
    it is a delta, as ``ReadTable.places`` (or :meth:`NvcompReader._places`) gives them, found when the batches were cut."""

    def __init__(self, indexes: list[MetadataIndex], targets: list[tuple[torch.Tensor, int] | None],
                 places: list[tuple[str, int, int]], deltas: list[bool]) -> None:
        super().__init__(indexes)
        self.targets = targets
        self.places = places
        self.deltas = deltas


#: ``decode_device="auto"``: records bound for host memory up to this size, stored with a CPU
#: codec (zstd, none), decode on the CPU, where a batch of them is decoded in arrays
#: (nvdcp/pipeline/cpu_batch.py). H200 host, 20,000 CPU tensors of 4 KiB-1 MiB, load on /dev/shm:
#: 3.22 s (0.41x stock) decoded on the CPU against 5.41 s (0.59x) on the GPU, nvdcp's own cost
#: 97 against 203 us per item (benchmarks/results/cpu_pipeline_bench_2026-12-01_h200host_session7_decode_{cpu,auto}.json).
HOST_DECODE_RECORD_BYTES = 4 << 20
_HOST_DECODED = (descriptor.descriptors("zstd"), descriptor.descriptors("none"))


def _host_decodes_faster(info: _StorageInfo) -> bool:
    """Whether an item bound for host memory decodes faster on the CPU than through the GPU."""
    return info.length <= HOST_DECODE_RECORD_BYTES and info.transform_descriptors in _HOST_DECODED


def _decodes_into(target: torch.Tensor, dtype: torch.dtype | None, shape: tuple[int, ...] | None) -> bool:
    """Whether the stored tensor can be decoded straight into ``target``: a dense CUDA tensor of
    the stored dtype and shape (no lazy conjugation or negation). No view is made: the decoder
    writes by address (on the H200 a flat uint8 view cost several microseconds per item)."""
    if type(target) is not torch.Tensor or target.dtype != dtype or shape is None or not target.is_cuda:
        return False
    if target.shape != shape or not target.is_contiguous():
        return False
    return not (target.is_conj() or target.is_neg())  # a lazy view: its memory is not its values


@dataclasses.dataclass
class _StockRun:
    """Consecutive stock items, loaded by one I/O task (``inline``: on the calling thread)."""

    indexes: list[MetadataIndex]
    inline: bool = False


class _Deferred:
    """A task run on the calling thread when its result is asked for (in queue order)."""

    def __init__(self, fn: Callable[[], Sequence[tuple[MetadataIndex, ItemHeader | None, Any]]]) -> None:
        self._fn = fn

    def result(self) -> Sequence[tuple[MetadataIndex, ItemHeader | None, Any]]:
        return self._fn()

    def cancel(self) -> bool:
        return True


class _Pending(Protocol):
    """A queued load: a future, or the levels of a delta batch (:class:`_Combined`)."""

    def done(self) -> bool: ...
    def result(self) -> Sequence[tuple[MetadataIndex, ItemHeader | None, Any]]: ...
    def cancel(self) -> bool: ...


class _Combined:
    """Futures whose results ``combine`` turns into one result, on the thread that asks for it."""

    def __init__(self, futures: list[PyFuture[Any]], combine: Callable[[list[Any]], Any]) -> None:
        self._futures = futures
        self._combine = combine

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self) -> Any:
        return self._combine([f.result() for f in self._futures])

    def cancel(self) -> bool:
        return all([f.cancel() for f in self._futures])


class _Window:
    """Loads started a bounded number at a time (``units``: each starts one and returns it),
    whose results are handed out in order: the ones already finished between the items of
    another stream of results (:meth:`interleave`), then the rest (:meth:`rest`). The window
    bounds the decoded bytes waiting to be committed."""

    def __init__(self, units: list[Callable[[], _Pending]], window: int) -> None:
        self._units = collections.deque(units)
        self._pending: collections.deque[_Pending] = collections.deque()
        self._window = max(1, window)
        self._fill()

    def _fill(self) -> None:
        while self._units and len(self._pending) < self._window:
            self._pending.append(self._units.popleft()())

    def _next(self) -> Sequence[tuple[MetadataIndex, ItemHeader | None, Any]]:
        """The first load's results (waiting for them), the next load started before they are
        handed out."""
        results = self._pending.popleft().result()
        self._fill()
        return results

    def _ready(self) -> Iterator[tuple[MetadataIndex, ItemHeader | None, Any]]:
        while self._pending and self._pending[0].done():
            yield from self._next()

    def interleave(self, other: Iterator[_T]) -> Iterator[_T | tuple[MetadataIndex, ItemHeader | None, Any]]:
        for item in other:
            yield item
            yield from self._ready()

    def rest(self) -> Iterator[tuple[MetadataIndex, ItemHeader | None, Any]]:
        while self._pending:
            yield from self._next()

    def cancel(self) -> None:
        """Start nothing more and cancel what has not begun (a load that failed)."""
        self._units.clear()
        while self._pending:
            self._pending.popleft().cancel()


@dataclasses.dataclass
class _StockLoaded:
    """A loaded stock item (tensor or bytes) and the destination resolved for it, if any; when
    ``item is target`` its bytes are already in place."""

    item: torch.Tensor | Buffer
    target: torch.Tensor | None


#: A CPU task reads consecutive records of one file up to this many bytes with one call, and
#: checks all their chunks' CRC32Cs with one batched call: per-item cost stays a few microseconds.
CPU_BATCH_BYTES = 4 << 20
CPU_BATCH_ITEMS = 1024
#: Records larger than this are loaded in parts of about this many stored bytes, each part its
#: own task: parts decode in parallel and memory stays ``window x part``, whatever the item size.
CPU_SEGMENT_BYTES = 8 << 20
#: Each I/O thread reads local batches and parts into one reused buffer of this size (a part
#: may run a block past CPU_SEGMENT_BYTES).
READ_BUFFER_BYTES = CPU_SEGMENT_BYTES + (1 << 20)
#: A host delta group's level is read into a reused per-thread buffer up to this size (larger
#: levels, as a bf16 group's full base level can be, into fresh memory): at most one such
#: buffer per thread and checkpoint of the chain.
LEVEL_BUFFER_BYTES = 64 << 20
#: Bytes between two records of a batch (items this load does not need) read through rather
#: than starting another read.
CPU_MAX_GAP = 64 << 10


@dataclasses.dataclass(eq=False)
class _CpuItem:
    """One nvdcp item the CPU path decodes: where it is, what ``.metadata`` says it holds, and
    (``req``) its one request when that wants the whole stored tensor, so it may be decoded
    straight into the planner's tensor (``target``; ``out`` its bytes)."""

    index: MetadataIndex
    name: str
    offset: int
    length: int
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    element_size: int
    req: ReadItem | None
    parts: int = 1
    resolved: bool = False
    target: torch.Tensor | None = None
    out: np.ndarray | None = None
    #: ``target``'s address when it is decoded into by address (``out`` then None until
    #: :meth:`out_view`): no numpy view per item on the main thread, where three torch calls
    #: and ``ndarray.ctypes`` cost about 5 µs an item
    target_at: int = 0

    def out_view(self) -> np.ndarray | None:
        """Where the one-by-one decoders write: ``out``, or a flat view of ``target`` made on
        first use (None: it does not view as bytes; the item then decodes into a buffer)."""
        if self.out is None and self.target is not None:
            self.out = _flat_view(self.target)
        return self.out


@dataclasses.dataclass
class _CpuBatch:
    """Consecutive records of one file ending at ``end``, or (``segment`` = (k, parts)) part k
    of one large record."""

    items: list[_CpuItem]
    end: int
    segment: tuple[int, int] | None = None


class _CpuBatcher:
    """Groups CPU items, in file order, into :class:`_CpuBatch` tasks appended to ``tasks``."""

    def __init__(self, tasks: list[Any]) -> None:
        self.tasks = tasks
        self.items: list[_CpuItem] = []
        self.end = 0

    def add(self, item: _CpuItem) -> None:
        if item.length > CPU_SEGMENT_BYTES and item.dtype is not None and item.shape is not None and (
            # A record far longer than its tensor could need is damage: read as one range, so the
            # storage refuses it against the file's size (no task per 8 MiB of a 2**60-byte claim).
            item.length <= 2 * tensor_nbytes(item.shape, item.dtype) + CPU_SEGMENT_BYTES
        ):
            self.flush()
            item.parts = -(-item.length // CPU_SEGMENT_BYTES)
            end = item.offset + item.length
            self.tasks.extend(_CpuBatch([item], end, (k, item.parts)) for k in range(item.parts))
            return
        if self.items and (
            item.name != self.items[0].name or item.offset < self.end or item.offset - self.end > CPU_MAX_GAP
            or item.offset + item.length - self.items[0].offset > CPU_BATCH_BYTES or len(self.items) >= CPU_BATCH_ITEMS
        ):
            self.flush()
        self.items.append(item)
        self.end = item.offset + item.length

    def flush(self) -> None:
        if self.items:
            self.tasks.append(_CpuBatch(self.items, self.end))
            self.items = []


@dataclasses.dataclass
class _CpuPlan:
    """The planner that resolves the CPU path's destinations (None: no destinations)."""

    planner: LoadPlanner | None

    def resolve(self, item: _CpuItem) -> None:
        """Resolve ``item``'s destination (on the calling thread, as its task is queued): its
        tensor's bytes when decoding can go straight there; else a buffer for a segmented item."""
        if item.resolved:
            return
        item.resolved = True
        if item.req is not None and self.planner is not None:
            target = self.planner.resolve_tensor(item.req)
            if target.requires_grad or type(target) is not torch.Tensor:  # (a Parameter: its data)
                target = target.detach()
            if _decodes_in_place(target, item.dtype, item.shape):
                if item.parts == 1:  # decoded by address (batches: all of it at once)
                    item.target, item.target_at = target, target.data_ptr()
                    return
                flat = _flat_view(target)  # the parts of a large item share one view, made here
                if flat is not None:
                    item.target, item.out = target, flat
                    return
        if item.parts > 1 and item.dtype is not None and item.shape is not None:
            item.out = np.empty(tensor_nbytes(item.shape, item.dtype), dtype=np.uint8)


def _decodes_in_place(target: torch.Tensor, dtype: torch.dtype | None, shape: tuple[int, ...] | None) -> bool:
    """Whether the stored tensor can be decoded straight into ``target``'s memory: a dense CPU
    tensor of the stored dtype and shape (no lazy conjugation or negation). Few torch calls:
    this runs once per item."""
    if type(target) is not torch.Tensor or not target.is_cpu or target.dtype != dtype or target.shape != shape:
        return False
    if not target.is_contiguous():
        return False
    return not (dtype.is_complex and (target.is_conj() or target.is_neg()))


def _flat_view(target: torch.Tensor) -> np.ndarray | None:
    """A dense CPU tensor's memory as flat uint8 (None: it does not view so)."""
    try:
        flat: np.ndarray = target.view(torch.uint8).numpy().reshape(-1)
    except (RuntimeError, TypeError, ValueError):  # 0-d tensors do not view as another element size
        try:
            flat = target.reshape(-1).view(torch.uint8).numpy()
        except (RuntimeError, TypeError, ValueError):
            return None
    return flat


def _flat_destination(target: torch.Tensor, dtype: torch.dtype | None, shape: tuple[int, ...] | None) -> np.ndarray | None:
    """``target``'s memory as flat uint8 when the stored tensor can be decoded straight into it
    (:func:`_decodes_in_place`)."""
    return _flat_view(target) if _decodes_in_place(target, dtype, shape) else None


@dataclasses.dataclass
class _InPlace:
    """An item decoded straight into the planner's tensor ``target``: only its commit is left."""

    target: torch.Tensor


class _LazyWhere:
    """An item's description, built only when an error message needs it."""

    def __init__(self, reader: NvcompReader, index: MetadataIndex) -> None:
        self._reader, self._index = reader, index

    def __str__(self) -> str:
        return self._reader.where(self._index)


def _named(exc: Exception, where: str) -> Exception:
    """``exc`` (raised with an empty location, its message starting ': ') naming ``where``."""
    message = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
    if isinstance(exc, MissingDataFileError) or not message.startswith(":"):
        return exc
    return type(exc)(f"{where}{message}")


@contextlib.contextmanager
def _naming_item(where: object) -> Iterator[None]:
    """Storage knows the file, not the item: add the item to a truncation error."""
    try:
        yield
    except TruncatedCheckpointError as exc:
        raise TruncatedCheckpointError(f"{where}: {exc}") from exc


@functools.cache
def _element_size(dtype: torch.dtype | None) -> int:
    return dtype.itemsize if dtype is not None else 1


#: A GPU batch is cut at a ``gpu_threads``-th of its device's items so that every decode thread
#: has work (a 1 GB checkpoint was one batch, read and decoded by one thread), but not below this.
MIN_GPU_BATCH_BYTES = 32 << 20


def _batched(items: list[tuple[_K, torch.device | None, int]], budget: dict[torch.device, int],
             threads: int) -> list[tuple[torch.device, list[_K]]]:
    """Cut ``(index, device, size)`` rows, in order, into batches per device of even items and
    bytes: as few as hold at most that device's ``budget`` bytes and ``MAX_GPU_BATCH_ITEMS``
    items each, but ``threads`` of them when the device's bytes allow (not below
    ``MIN_GPU_BATCH_BYTES``) so that every GPU thread gets one however small the load, and a
    multiple of ``threads`` beyond that, so no batch decodes alone at the end while the other
    threads idle (20,000 small items were 4 full batches and a tail of 3,616). An item larger
    than the budget is a batch alone. Batches come in the order they are cut, each device's last
    one at the end."""
    rows: dict[torch.device, list[int]] = {}
    if len(set(map(itemgetter(1), items))) == 1:
        rows[items[0][1]] = list(range(len(items)))  # type: ignore[index]  # one device: no loop
    else:
        for k, (_, device, _) in enumerate(items):
            rows.setdefault(device, []).append(k)  # type: ignore[arg-type]
    cut: list[tuple[int, torch.device, list[_K]]] = []  # (where the next batch starts, device, members)
    tails: list[tuple[torch.device, list[_K]]] = []
    for device, at in rows.items():
        assert device is not None
        sizes = np.fromiter((items[k][2] for k in at), dtype=np.int64, count=len(at))
        ends = _batch_ends(sizes, budget[device], threads)
        starts = [0, *ends[:-1]]
        for start, end in zip(starts, ends):
            members = [items[k][0] for k in at[start:end]]
            if end < len(at):
                cut.append((at[end], device, members))
            else:
                tails.append((device, members))
    cut.sort(key=itemgetter(0))
    return [(device, members) for _, device, members in cut] + tails


def _batch_ends(sizes: np.ndarray, budget: int, threads: int) -> list[int]:
    """Where :func:`_batched`'s batches of one device's items (of ``sizes`` bytes, in order) end.

    A batch started at ``s`` ends before the first item ``i`` that would take it past the
    budget, past ``MAX_GPU_BATCH_ITEMS``, or (while fewer than the wanted batches were cut) past
    an even share of the items, or whose middle passes the next even share of the bytes. Each
    of these is monotone in ``i``, so each end is found by ``searchsorted`` on running sums: a
    few numpy calls per batch, not Python per item (20,000 items: 10 ms in a per-item loop)."""
    n = len(sizes)
    total = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(sizes, out=total[1:])
    middles = total[:-1] + sizes / 2  # exact: float64 holds these sums and halves exactly
    wanted, byte_goal, item_cap = _batch_share(int(total[-1]), n, budget, threads)
    ends: list[int] = []
    start = cut = 0
    while start < n:
        end = min(n, start + MAX_GPU_BATCH_ITEMS,
                  int(np.searchsorted(total, total[start] + budget, side="right")) - 1)
        if cut + 1 < wanted:
            end = min(end, start + item_cap, int(np.searchsorted(middles, (cut + 1) * byte_goal, side="right")))
        end = max(end, start + 1)  # a batch holds one item at least
        ends.append(end)
        start, cut = end, cut + 1
    return ends


def _batch_share(nbytes: int, count: int, budget: int, threads: int) -> tuple[int, float, int]:
    """(how many, bytes of one, items of one) of :func:`_batched`'s even batches of a device's
    ``count`` items of ``nbytes`` bytes."""
    needed = max(-(-count // MAX_GPU_BATCH_ITEMS), -(-nbytes // max(1, budget)))
    wanted = max(needed, min(max(1, threads), -(-nbytes // MIN_GPU_BATCH_BYTES)))
    if wanted > threads > 0:
        wanted = -(-wanted // threads) * threads
    return wanted, nbytes / wanted, -(-count // wanted)


def _holding(slots: threading.BoundedSemaphore, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` while holding one of ``slots``."""
    with slots:
        return fn(*args)


def base_problem(base_md: Metadata, ref: BaseRef) -> str | None:
    """Why the checkpoint ``base_md`` is not the base ``ref`` names (None: it is)."""
    save_id = getattr(getattr(base_md, "storage_meta", None), "save_id", None)
    if save_id != ref.save_id:
        return f"save {save_id}"
    if ref.digests_crc is not None:
        record = getattr(base_md, "__dict__", {}).get(DIGEST_ATTR)
        crc = record.get("crc") if isinstance(record, dict) else None
        if crc != ref.digests_crc:
            return "its item digests differ"
    return None


def describe_index(index: MetadataIndex) -> str:
    offset = getattr(index, "offset", None)
    if not hasattr(index, "fqn"):  # a custom planner's index of another kind
        return repr(index)
    if offset is None:
        return repr(index.fqn)
    return f"{index.fqn!r} offset {tuple(offset)}"


def is_nvdcp_checkpoint(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """Whether the checkpoint at ``url`` (a path or URL) holds nvdcp items.

    True when its ``.metadata`` has at least one storage record with an nvdcp descriptor (an
    nvdcp or a mixed checkpoint); False for a stock DCP checkpoint (and for one that stores no
    items at all). :class:`NvcompReader` loads all of them; torch's ``FileSystemReader`` only
    those for which this is False.

    Raises:
        IncompleteCheckpointError: no ``.metadata`` at ``url``.
        CorruptCheckpointError: ``.metadata`` cannot be read.
    """
    storage = open_storage(os.fspath(url), **(storage_options or {}))
    metadata = load_any_metadata(storage)
    return any(is_nvdcp_record(info) for info in metadata.storage_data.values())

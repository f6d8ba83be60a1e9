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

import contextlib
import dataclasses
import functools
import io
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future as PyFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

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

from nvdcp.dcp import descriptor
from nvdcp.dcp.any_metadata import load_any_metadata
from nvdcp.dcp.stock_items import (
    DIRECT_MIN_BYTES,
    OpenFiles,
    StockItemReader,
    is_nvdcp_record,
    merge_fsspec_kwargs,
)
from nvdcp.errors import CorruptCheckpointError, TruncatedCheckpointError
from nvdcp.format.dtypes import code_dtype
from nvdcp.format.header import (
    KIND_BYTES,
    KIND_TENSOR,
    ItemHeader,
    item_header_size,
    parse_item_header_only,
)
from nvdcp.gpu import gpu_available
from nvdcp.gpu.config import GpuConfig
from nvdcp.pipeline.cpu import decode_item
from nvdcp.pipeline.tensors import tensor_nbytes
from nvdcp.report import Report
from nvdcp.storage import Storage, open_storage
from nvdcp.storage.base import Buffer
from nvdcp.storage.local import LocalStorage

logger = logging.getLogger(__name__)

#: Default ``thread_count``: items fetched and decoded at once, at most this many (and the cores).
DEFAULT_MAX_THREADS = 8
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
        cores = os.cpu_count() or 1
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

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None
        state["_decoders"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._decoders = threading.local()

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
        self._chunks = None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.metadata is not None, "set_up_storage_reader was not called"
        started = time.perf_counter()
        report = Report("load", self.storage.url)
        by_item: dict[MetadataIndex, list[ReadItem]] = {}
        for req in plan.items:
            by_item.setdefault(req.storage_index, []).append(req)
        stock = {ix for ix in by_item if not is_nvdcp_record(self._record(ix))}
        devices = {
            index: None if index in stock else self._decode_device(reqs, planner) for index, reqs in by_item.items()
        }
        # Read in file order so a local disk sees sequential-ish access.
        order = sorted(by_item, key=lambda ix: (self._record(ix).relative_path, self._record(ix).offset))

        def destination(index: MetadataIndex) -> torch.Tensor | None:
            """Where a whole large stock item goes, resolved just before its read is queued,
            so its bytes are read straight into it (see StockItemReader.read)."""
            reqs = by_item[index]
            if len(reqs) != 1 or reqs[0].type != LoadItemType.TENSOR:
                return None
            dtype, shape = self._expected(index)
            if dtype is None or shape is None or tensor_nbytes(shape, dtype) < DIRECT_MIN_BYTES:
                return None
            if any(reqs[0].storage_offsets) or tuple(reqs[0].lengths) != shape:
                return None
            return planner.resolve_tensor(reqs[0]).detach()

        for index, header, data in self._fetch_and_decode(order, devices, stock, report, destination):
            for req in by_item[index]:
                if header is None:
                    self._commit_stock(req, data, planner)
                else:
                    self._commit(req, header, data, planner)
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
        dtype, shape = self._expected(index)
        t0 = time.perf_counter()
        item = self.stock.read(
            self.storage, info.relative_path, info.offset, info.length, info.transform_descriptors,
            dtype, shape, self.where(index), into, files,
        )
        if report is not None:
            raw = item.nbytes if isinstance(item, torch.Tensor) else memoryview(item).nbytes
            report.add(raw, info.length, read_s=time.perf_counter() - t0)
        return item

    def _expected(self, index: MetadataIndex) -> tuple[torch.dtype | None, tuple[int, ...] | None]:
        assert self.metadata is not None
        if self._chunks is None:
            self._chunks = {
                (fqn, tuple(chunk.offsets)): (md.properties.dtype, tuple(chunk.sizes))
                for fqn, md in self.metadata.state_dict_metadata.items()
                if isinstance(md, TensorStorageMetadata)
                for chunk in md.chunks
            }
        found = self._chunks.get((index.fqn, tuple(index.offset or ())))
        if found is not None:
            return found
        md = self.metadata.state_dict_metadata.get(index.fqn)
        if isinstance(md, TensorStorageMetadata):
            return md.properties.dtype, None
        if isinstance(md, BytesStorageMetadata):
            return None, None
        return None, None

    def _decode_device(self, reqs: list[ReadItem], planner: LoadPlanner) -> torch.device | None:
        """Where to decode a stored item: a CUDA device, or None for the CPU path."""
        if not gpu_available() or reqs[0].type == LoadItemType.BYTE_IO:
            return None
        target = planner.resolve_tensor(reqs[0])
        if target.is_cuda:
            return target.device
        if self.gpu.decode_device == "cpu":
            return None
        return torch.device("cuda", torch.cuda.current_device())

    def _gpu_decoder(self, device: torch.device) -> Any:
        from nvdcp.gpu.decoder import GpuDecoder
        from nvdcp.gpu.pinned import shared_pool

        cache = self._decoders.__dict__.setdefault("by_device", {})
        if device not in cache:
            budget = self.gpu.gpu_budget(device) // self.thread_count
            cache[device] = GpuDecoder(
                device, budget_bytes=budget, gdeflate_type=self.gpu.gdeflate_algorithm_type,
                pinned_bytes=self.gpu.pinned_memory_bytes // self.thread_count,
                pinned=shared_pool(self.gpu.pinned_memory_bytes),
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
            return header, raw
        name, offset, length = self.record_of(index)
        where = self.where(index)
        t0 = time.perf_counter()
        with _naming_item(where):
            record = self.storage.read_range(name, offset, length)
        t1 = time.perf_counter()
        dtype, shape = self._expected(index)
        element_size = _element_size(dtype)
        header, host_raw = decode_item(memoryview(record), where, self._codec_pool(), element_size)
        self._check_against_metadata(header, dtype, shape, element_size, where)
        report.add(header.raw_nbytes, length, read_s=t1 - t0, decode_s=time.perf_counter() - t1)
        return header, host_raw

    @_rereads
    def _load_gpu_batch(
        self, indexes: list[MetadataIndex], device: torch.device, report: Report
    ) -> list[tuple[MetadataIndex, ItemHeader, torch.Tensor]]:
        """Fetch and verify several items on the host, then decode them together on ``device``."""
        from nvdcp.gpu.decoder import DecodeRequest

        requests = []
        t0 = time.perf_counter()
        stored = 0
        for index in indexes:
            name, offset, length = self.record_of(index)
            where = self.where(index)
            header = self._read_header(name, offset, length, where)
            stored += length
            dtype, shape = self._expected(index)
            element_size = _element_size(dtype)
            if header.transform and header.n_planes != element_size:
                raise CorruptCheckpointError(f"{where}: {header.n_planes} byte planes for {element_size}-byte elements")
            self._check_against_metadata(header, dtype, shape, element_size, where)
            requests.append(DecodeRequest(header, dtype, where, fill=self._chunk_filler(name, offset, header)))
        t1 = time.perf_counter()
        outs = self._gpu_decoder(device).decode_many(requests)
        raw = sum(r.header.raw_nbytes for r in requests)
        report.add(raw, stored, read_s=t1 - t0, decode_s=time.perf_counter() - t1)
        return [(ix, r.header, out) for ix, r, out in zip(indexes, requests, outs)]

    def _read_header(self, name: str, offset: int, length: int, where: str) -> ItemHeader:
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

    def _chunk_filler(self, name: str, offset: int, header: ItemHeader) -> Callable[[int, list[memoryview]], None]:
        starts = [0]
        for size, _ in header.chunks:
            starts.append(starts[-1] + size)
        payload_at = offset + header.header_bytes

        def fill(first_chunk: int, buffers: list[memoryview]) -> None:
            self.storage.read_into(name, payload_at + starts[first_chunk], buffers)

        return fill

    def _gpu_batches(
        self, order: list[MetadataIndex], devices: dict[MetadataIndex, torch.device | None]
    ) -> list[tuple[torch.device, list[MetadataIndex]]]:
        """Group GPU-decoded items into batches whose stored size fits half a thread's budget."""
        batches: list[tuple[torch.device, list[MetadataIndex]]] = []
        open_: dict[torch.device, tuple[list[MetadataIndex], int]] = {}
        for index in order:
            device = devices[index]
            assert device is not None
            limit = self.gpu.gpu_budget(device) // (2 * self.thread_count)
            size = self.record_of(index)[2]
            items, total = open_.get(device, ([], 0))
            if items and (total + size > limit or len(items) >= MAX_GPU_BATCH_ITEMS):
                batches.append((device, items))
                items, total = [], 0
            open_[device] = ([*items, index], total + size)
        batches += [(device, items) for device, (items, _) in open_.items() if items]
        return batches

    @staticmethod
    def _check_against_metadata(
        header: ItemHeader, dtype: torch.dtype | None, shape: tuple[int, ...] | None,
        element_size: int, where: str,
    ) -> None:
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
        self, order: list[MetadataIndex], devices: dict[MetadataIndex, torch.device | None],
        stock: set[MetadataIndex], report: Report,
        destination: Callable[[MetadataIndex], torch.Tensor | None] = lambda index: None,
    ) -> Iterator[tuple[MetadataIndex, ItemHeader | None, Any]]:
        """Run item loads (CPU, stock items too) and batch loads (GPU) on the I/O pool, a bounded
        window ahead. A stock item comes with header None and a :class:`_StockLoaded`; its
        ``destination`` is resolved (on this thread) when its read is queued."""
        tasks: list[Callable[[], Sequence[tuple[MetadataIndex, ItemHeader | None, Any]]] | _StockRun] = []
        # Consecutive stock items go as one task, up to a few MiB: small items are often many.
        run: list[MetadataIndex] = []
        run_bytes = 0
        for index in order:
            if index in stock:
                run.append(index)
                run_bytes += self._record(index).length
                if run_bytes < STOCK_BATCH_BYTES and len(run) < STOCK_BATCH_ITEMS:
                    continue
            if run:
                tasks.append(_StockRun(run, self._inline(run, run_bytes)))
                run, run_bytes = [], 0
            if index not in stock and devices[index] is None:
                tasks.append(functools.partial(self._load_cpu_task, index, report))
        if run:
            tasks.append(_StockRun(run, self._inline(run, run_bytes)))
        for device, batch in self._gpu_batches([ix for ix in order if devices[ix] is not None], devices):
            tasks.append(functools.partial(self._load_gpu_batch, batch, device, report))
        window = READ_WINDOW_PER_THREAD * self.thread_count
        with ThreadPoolExecutor(self.thread_count, thread_name_prefix="nvdcp-read") as io_pool:
            pending: list[PyFuture[Sequence[tuple[MetadataIndex, ItemHeader | None, Any]]] | _Deferred] = []
            try:
                for task in tasks:
                    if isinstance(task, _StockRun):
                        targets = [destination(index) for index in task.indexes]
                        fn = functools.partial(self._load_stock_run, task.indexes, targets, report)
                        pending.append(_Deferred(fn) if task.inline else io_pool.submit(fn))
                    else:
                        pending.append(io_pool.submit(task))
                    if len(pending) >= window:
                        yield from pending.pop(0).result()
                while pending:
                    yield from pending.pop(0).result()
            finally:
                for fut in pending:
                    fut.cancel()

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


@dataclasses.dataclass
class _StockLoaded:
    """A loaded stock item (tensor or bytes) and the destination resolved for it, if any; when
    ``item is target`` its bytes are already in place."""

    item: torch.Tensor | Buffer
    target: torch.Tensor | None


@contextlib.contextmanager
def _naming_item(where: str) -> Iterator[None]:
    """Storage knows the file, not the item: add the item to a truncation error."""
    try:
        yield
    except TruncatedCheckpointError as exc:
        raise TruncatedCheckpointError(f"{where}: {exc}") from exc


def _element_size(dtype: torch.dtype | None) -> int:
    return torch.empty((), dtype=dtype).element_size() if dtype is not None else 1


def describe_index(index: MetadataIndex) -> str:
    if index.offset is None:
        return repr(index.fqn)
    return f"{index.fqn!r} offset {tuple(index.offset)}"


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

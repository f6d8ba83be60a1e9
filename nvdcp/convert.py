"""Checkpoint conversion between stock DCP and nvdcp, item by item, under a memory budget.

Works at the storage and container layers rather than through ``dcp.load``/``dcp.save``: one
stored chunk of the source becomes one stored chunk of the destination (the source's sharding is
kept), ``state_dict_metadata`` and ``planner_data`` are copied, and only a bounded number of
items is in memory at once. The destination's ``.metadata`` is written last, atomically, so an
interrupted conversion leaves no checkpoint (and deletes what it wrote).

Stock output is what torch's ``FileSystemWriter`` writes (``torch.save`` per tensor, raw bytes
for byte items, ``_StorageInfo`` records without descriptors): it loads with stock
``FileSystemReader`` on a machine without nvdcp.

A delta checkpoint (:class:`nvdcp.DeltaPolicy`) is materialized: each delta item is rebuilt from
its base chain (:meth:`NvcompReader.item_raw`, everything checked) and written whole, and the
destination records no base: it loads without the chain. Its base must be there to convert it
(``MissingBaseError`` / ``BaseMismatchError`` otherwise, before anything is written).
"""

from __future__ import annotations

import copy
import io
import os
import re
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from nvdcp.codecs import GPU_ONLY
from nvdcp.dcp import descriptor
from nvdcp.dcp.any_metadata import load_any_metadata
from nvdcp.dcp.commit import CheckpointCommit, data_file_header
from nvdcp.dcp.metadata_io import METADATA_NAME
from nvdcp.dcp.reader import NvcompReader, describe_index
from nvdcp.errors import (
    CheckpointExistsError,
    CodecUnavailableError,
    CorruptCheckpointError,
)
from nvdcp.format.header import DEFAULT_CHUNK_BYTES
from nvdcp.gpu import gpu_available
from nvdcp.gpu.config import GpuConfig
from nvdcp.pipeline.config import EncodeConfig
from nvdcp.pipeline.encoder import ItemEncoder, descriptor_codec
from nvdcp.pipeline.tensors import tensor_nbytes, tensor_to_host_bytes
from nvdcp.report import Report

FORMATS = ("nvdcp", "stock")
_SOURCE_NAME = re.compile(r"^__(\d+)_(?:[0-9a-f]+_)?(\d+)\.(?:distcp|nvdcp)$")
_STOCK_DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class ConvertOptions:
    """How :func:`convert_checkpoint` writes the destination.

    Args:
        to: ``"nvdcp"`` (compressed, ``codec``) or ``"stock"`` (torch's FileSystemWriter layout).
        codec: for nvdcp output: ``"auto"`` or a codec name (``zstd``, ``gdeflate``, ``none``;
            ``ans``/``bitcomp`` need a GPU here).
        max_memory: bytes of items in flight at once (source record, decoded bytes, encoded
            output); one item larger than this is still converted, alone.
        threads: items converted concurrently.
        codec_threads: threads compressing chunks of one item (default: all cores).
        chunk_bytes: uncompressed bytes per chunk of nvdcp output.
        overwrite: replace a checkpoint already at the destination.
        gpu: GPU path settings for codecs that compress on the GPU (ANS, Bitcomp).
    """

    to: str = "nvdcp"
    codec: str = "auto"
    max_memory: int = 1 << 30
    threads: int = 2
    codec_threads: int | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    overwrite: bool = False
    gpu: GpuConfig = field(default_factory=GpuConfig)

    def __post_init__(self) -> None:
        if self.to not in FORMATS:
            raise ValueError(f"output format must be one of {FORMATS}, got {self.to!r}")
        EncodeConfig(self.codec, self.chunk_bytes, self.codec_threads)  # raises on a bad codec, chunk size, threads
        if self.to == "stock" and self.codec != "auto":
            raise ValueError("--codec applies to nvdcp output only; stock DCP output is uncompressed torch.save")
        if self.max_memory < 1 << 20:
            raise ValueError(f"max_memory must be at least 1 MiB, got {self.max_memory}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.codec in GPU_ONLY and not gpu_available():
            raise CodecUnavailableError(
                f"codec {self.codec!r} compresses only on an NVIDIA GPU with nvidia-libnvcomp-cu12 installed; "
                "none is usable here"
            )

    @property
    def encoding(self) -> EncodeConfig:
        return EncodeConfig(self.codec, self.chunk_bytes, self.codec_threads)


@dataclass
class ConvertResult:
    """What :func:`convert_checkpoint` did. ``report.raw_bytes`` are the items' uncompressed bytes,
    ``report.stored_bytes`` what the destination holds (data files, without ``.metadata``)."""

    source: str
    destination: str
    source_format: str
    source_stored_bytes: int
    to: str
    codec: str | None
    files: int
    report: Report
    #: A delta source: where its base was found, and how many items were rebuilt from the chain
    #: (the destination records no base either way).
    source_base: str | None = None
    delta_items: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source, "destination": self.destination, "source_format": self.source_format,
            "source_stored_bytes": self.source_stored_bytes, "to": self.to, "codec": self.codec,
            "files": self.files, "source_base": self.source_base, "delta_items": self.delta_items,
            **{k: v for k, v in self.report.as_dict().items() if k not in ("op", "url")},
        }


@dataclass
class _Job:
    index: MetadataIndex
    info: _StorageInfo
    #: tensor dtype and the chunk's shape from .metadata; None for byte items
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    raw_nbytes: int

    @property
    def cost(self) -> int:
        return self.info.length + 2 * self.raw_nbytes


def bounded_map(
    fn: Callable[[T], R], tasks: Iterable[T], cost: Callable[[T], int], budget: int, pool: ThreadPoolExecutor,
    window: int,
) -> Iterator[R]:
    """``fn`` over ``tasks`` on ``pool``, results in order, with at most ``budget`` of ``cost``
    (and ``window`` tasks) in flight; a task costlier than the budget runs alone."""
    pending: deque[tuple[Future[R], int]] = deque()
    inflight = 0
    try:
        for task in tasks:
            c = cost(task)
            while pending and (inflight + c > budget or len(pending) >= window):
                fut, done_cost = pending.popleft()
                inflight -= done_cost
                yield fut.result()
            pending.append((pool.submit(fn, task), c))
            inflight += c
        while pending:
            fut, done_cost = pending.popleft()
            inflight -= done_cost
            yield fut.result()
    finally:
        for fut, _ in pending:
            fut.cancel()


def _destination_names(files: list[str], to: str, token: str) -> dict[str, str]:
    """Data file names of the output: rank and index kept from the source's names when it has them."""
    parsed = [_SOURCE_NAME.match(f) for f in files]
    pairs = [(int(m.group(1)), int(m.group(2))) if m else None for m in parsed]
    if None in pairs or len(set(pairs)) != len(pairs):
        pairs = [(0, i) for i in range(len(files))]
    if to == "stock":
        return {f: f"__{r}_{i}.distcp" for f, (r, i) in zip(files, pairs)}  # type: ignore[misc]
    return {f: f"__{r}_{token}_{i}.nvdcp" for f, (r, i) in zip(files, pairs)}  # type: ignore[misc]


class Source:
    """A checkpoint read item by item: nvdcp items through :class:`NvcompReader`, stock items
    (``torch.save``, optionally through torch's stream extensions) by byte range and ``torch.load``."""

    def __init__(self, path: str, *, threads: int = 2, codec_threads: int | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.reader = NvcompReader(
            path, thread_count=threads, codec_threads=codec_threads, storage_options=storage_options,
        )
        self.storage = self.reader.storage
        self.metadata = load_any_metadata(self.storage)
        self.reader.set_up_storage_reader(self.metadata, True)
        #: Reading and decoding (NvcompReader.load_item counts its bytes here).
        self.report = Report("read", self.storage.url)

    def jobs(self) -> list[_Job]:
        """Every stored item, with what ``.metadata`` says it holds."""
        out = []
        for index, info in self.metadata.storage_data.items():
            md = self.metadata.state_dict_metadata.get(index.fqn)
            where = f"{self.storage.url} item {describe_index(index)}"
            if not isinstance(info, _StorageInfo):
                raise CorruptCheckpointError(f"{where}: storage record is {type(info).__name__}, not _StorageInfo")
            if isinstance(md, TensorStorageMetadata):
                chunk = next((c for c in md.chunks if list(c.offsets) == list(index.offset or [])), None)
                if chunk is None:
                    raise CorruptCheckpointError(f"{where}: no chunk at this offset in .metadata")
                shape = tuple(chunk.sizes)
                dtype = md.properties.dtype
                out.append(_Job(index, info, dtype, shape, tensor_nbytes(shape, dtype)))
            elif isinstance(md, BytesStorageMetadata):
                out.append(_Job(index, info, None, None, info.length))
            else:
                raise CorruptCheckpointError(f"{where}: no entry for {index.fqn!r} in state_dict_metadata")
        return out

    @staticmethod
    def is_nvdcp(info: _StorageInfo) -> bool:
        descs = info.transform_descriptors or ()
        return any(isinstance(d, str) and d.startswith(descriptor.PREFIX) for d in descs)

    def read(self, job: _Job) -> np.ndarray:
        """The item's raw bytes (flat uint8): tensor elements in C order, or the byte object."""
        if descriptor.is_delta(job.info):
            # A delta item: its bytes rebuilt from the base chain (every record and base digest
            # checked), so the destination stands alone.
            _, whole = self.reader.item_raw(job.index, self.report)
            return whole
        if self.is_nvdcp(job.info):
            codec, _ = descriptor.parse(job.info, self.reader.where(job.index))
            device = None
            if codec in GPU_ONLY and gpu_available():
                device = torch.device("cuda", torch.cuda.current_device())
            _, raw = self.reader.load_item(job.index, self.report, device)
            return raw.cpu().numpy() if isinstance(raw, torch.Tensor) else raw
        return self._read_stock(job)

    def _read_stock(self, job: _Job) -> np.ndarray:
        """A stock item through the reader's stock path (nvdcp.dcp.stock_items): fetched,
        transforms undone, ``torch.load``'ed and checked against .metadata."""
        t0 = time.perf_counter()
        item = self.reader.load_stock_item(job.index)
        t1 = time.perf_counter()
        raw = tensor_to_host_bytes(item) if isinstance(item, torch.Tensor) else np.frombuffer(item, dtype=np.uint8)
        self.report.add(job.raw_nbytes, job.info.length, read_s=t1 - t0, decode_s=time.perf_counter() - t1)
        return raw


class _Converter:
    def __init__(self, src: str, dst: str, options: ConvertOptions,
                 src_options: dict[str, Any] | None, dst_options: dict[str, Any] | None) -> None:
        self.options = options
        self.source = Source(src, threads=options.threads, codec_threads=options.codec_threads,
                             storage_options=src_options)
        self.metadata = self.source.metadata
        self.src = self.source.storage
        from nvdcp.storage import open_storage

        self.dst = open_storage(dst, sync=True, **(dst_options or {}))
        if self.dst.url.rstrip("/") == self.src.url.rstrip("/"):
            raise ValueError(f"source and destination are the same location ({self.src.url})")
        base = self.source.reader.base
        while base is not None:
            if base.storage.url.rstrip("/") == self.dst.url.rstrip("/"):
                raise ValueError(
                    f"{self.dst.url} is in the base chain of {self.src.url} (a delta checkpoint): writing there "
                    "would replace the base it is rebuilt from"
                )
            base = base.base
        self.dst_path = os.fspath(dst)
        self.encoder = ItemEncoder(options.encoding, options.gpu)
        self.report = Report("convert", self.dst.url)

    # -- writing -----------------------------------------------------------------------------
    def encode(self, job: _Job, raw: np.ndarray) -> tuple[list[bytes | memoryview], str | None]:
        """The stored bytes of the item (in parts) and, for nvdcp output, its main codec."""
        if job.dtype is None or job.shape is None:
            if self.options.to == "stock":
                return [raw.data], None
            data: Any = raw
        else:
            data = torch.from_numpy(raw).view(job.dtype).reshape(job.shape) if raw.size else torch.empty(job.shape, dtype=job.dtype)
            if self.options.to == "stock":
                buf = io.BytesIO()
                torch.save(data, buf)
                return [buf.getbuffer()], None
        where = f"{self.src.url} item {describe_index(job.index)}"
        enc = self.encoder.encode_owned(data, where, shares=self.options.threads)
        return [enc.header_bytes, *enc.chunks], descriptor_codec(enc)

    def convert_one(self, job: _Job) -> tuple[_Job, int, list[bytes | memoryview], str | None]:
        raw = self.source.read(job)
        t0 = time.perf_counter()
        parts, codec = self.encode(job, raw)
        self.report.add(0, 0, encode_s=time.perf_counter() - t0)
        return job, raw.size, parts, codec

    def run(self, progress: Callable[[int, int], None] | None) -> ConvertResult:
        started = time.perf_counter()
        opts = self.options
        if self.dst.exists(METADATA_NAME):
            if not opts.overwrite:
                raise CheckpointExistsError(f"{self.dst.describe(METADATA_NAME)} exists; pass --overwrite to replace it")
            if opts.to == "stock":
                # Stock file names are fixed (__rank_i.distcp): uncommit the old checkpoint before
                # its files are overwritten, so it is never read half-replaced.
                self.dst.delete([METADATA_NAME])
        self.dst.prepare()
        jobs = self.source.jobs()
        by_file: dict[str, list[_Job]] = {}
        for job in jobs:
            by_file.setdefault(job.info.relative_path, []).append(job)
        save_id = uuid.uuid4().hex
        names = _destination_names(sorted(by_file), opts.to, save_id[:12])
        commit = CheckpointCommit(self.dst)
        if opts.to == "nvdcp":
            commit.begin(save_id[:12])  # saves racing here keep their files, and we keep ours
        total = sum(j.raw_nbytes for j in jobs)
        done = 0
        storage_data: dict[MetadataIndex, _StorageInfo] = {}
        created: list[str] = []
        try:
            with ThreadPoolExecutor(opts.threads, thread_name_prefix="nvdcp-convert") as pool:
                for src_name in sorted(by_file):
                    name = names[src_name]
                    stream = self.dst.create(name)
                    created.append(name)
                    try:
                        if opts.to == "nvdcp":
                            stream.write(data_file_header(0, save_id, converted_from=self.src.url))
                        file_jobs = sorted(by_file[src_name], key=lambda j: j.info.offset)
                        for job, raw_nbytes, parts, codec in bounded_map(
                            self.convert_one, file_jobs, lambda j: j.cost, opts.max_memory, pool, 2 * opts.threads,
                        ):
                            t0 = time.perf_counter()
                            offset = stream.tell()
                            stream.writelines(parts)
                            length = stream.tell() - offset
                            storage_data[job.index] = (
                                descriptor.storage_info(name, offset, length, codec) if codec is not None
                                else _StorageInfo(name, offset, length)
                            )
                            self.report.add(raw_nbytes, length, io_s=time.perf_counter() - t0)
                            done += job.raw_nbytes
                            if progress:
                                progress(done, total)
                        t0 = time.perf_counter()
                        stream.commit()
                        self.report.add(0, 0, io_s=time.perf_counter() - t0)
                    except BaseException:
                        stream.abort()
                        raise
            metadata = copy.copy(self.metadata)
            if opts.to == "stock":
                metadata.version = metadata.version or CURRENT_DCP_VERSION  # as FileSystemWriter.finish
            commit.commit(metadata, storage_data, self.dst_path, save_id, stock_pickle=opts.to == "stock")
        except BaseException:
            commit.abort(created)
            raise
        finally:
            self.encoder.close()
        keep = {info.relative_path for info in storage_data.values()}
        if not commit.cleanup(keep):
            # Stock file names carry no save token (fixed __<rank>_<i>.distcp): an earlier stock
            # checkpoint's extra files go too, unless a later save now owns the location.
            self.dst.delete([n for n in self.dst.list() if _STOCK_DATA_FILE.match(n) and n not in keep])
        for phase, seconds in self.source.report.phases.items():
            self.report.add(0, 0, **{phase: seconds})
        self.report.seconds = time.perf_counter() - started
        kinds = {"nvdcp" if Source.is_nvdcp(j.info) else "stock" for j in jobs}
        return ConvertResult(
            self.src.url, self.dst.url, "mixed" if len(kinds) > 1 else (kinds.pop() if kinds else "empty"),
            sum(j.info.length for j in jobs), opts.to, opts.codec if opts.to == "nvdcp" else None,
            len(by_file), self.report,
            self.source.reader.base.path if self.source.reader.base is not None else None,
            sum(1 for j in jobs if descriptor.is_delta(j.info)),
        )


def convert_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    options: ConvertOptions | None = None,
    *,
    src_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ConvertResult:
    """Convert the checkpoint at ``src`` (stock DCP or nvdcp, any codec) into ``dst``; a delta
    checkpoint becomes a standalone one (its base chain resolved).

    ``progress(done, total)`` counts uncompressed bytes. The result's ``report`` has the bytes
    (``raw_bytes`` in, ``stored_bytes`` written) and the time per phase.

    Raises:
        IncompleteCheckpointError: no ``.metadata`` at ``src``.
        MissingBaseError, BaseMismatchError: ``src`` is a delta checkpoint whose base chain is
            gone or was replaced (nothing is written).
        CheckpointExistsError: ``dst`` holds a checkpoint and ``overwrite`` is False.
        CorruptCheckpointError: a source item fails its checks (the destination is left empty).
        CodecUnavailableError: a source item's codec, or the requested codec, cannot run here.
    """
    return _Converter(os.fspath(src), os.fspath(dst), options or ConvertOptions(), src_options, dst_options).run(progress)


__all__ = ["FORMATS", "ConvertOptions", "ConvertResult", "Source", "bounded_map", "convert_checkpoint"]

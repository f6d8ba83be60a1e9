"""``NvcompWriter``: a DCP StorageWriter that compresses every item it writes.

Layout on storage (docs/FORMAT.md): per rank, ``thread_count`` data files named
``__{rank}_{save}_{i}.nvdcp`` (``save`` is a token fresh for every save, so a new save never
overwrites a file the previous ``.metadata`` points at), then ``.metadata`` written last by the
coordinator atomically (temp file and rename on disk, one PUT on S3). Only after that commit are data files of
earlier saves to the same location deleted: at every instant the location holds either the old
complete checkpoint or the new one.

Saves racing on one location follow :mod:`nvdcp.dcp.save_guard`: an in-progress marker before
any data file, a check that every data file the new ``.metadata`` names is whole before the
commit, and cleanup that never deletes a live save's files (docs/RELIABILITY.md).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from nvdcp.codecs import GPU_ONLY, codec_name
from nvdcp.dcp import descriptor
from nvdcp.dcp.save_guard import SaveGuard
from nvdcp.dcp.stager import StagedShard, WriterStagingMixin, release_staged
from nvdcp.errors import (
    CheckpointExistsError,
    CodecUnavailableError,
)
from nvdcp.format.dtypes import dtype_code
from nvdcp.format.header import DEFAULT_CHUNK_BYTES, KIND_BYTES, KIND_TENSOR, pack_file_header
from nvdcp.gpu import gpu_available
from nvdcp.gpu.config import GpuConfig
from nvdcp.pipeline.cpu import EncodedItem, encode_item
from nvdcp.pipeline.policy import GPU_AUTO_CODEC, choose_layout, validate_codec_choice
from nvdcp.report import Report
from nvdcp.storage import Storage, open_storage

logger = logging.getLogger(__name__)

from nvdcp.dcp.metadata_io import METADATA_NAME

DATA_SUFFIX = ".nvdcp"


@dataclasses.dataclass(frozen=True)
class _FilePrefix:
    """Per-rank file-name prefix, chosen by the coordinator in ``prepare_global_plan``."""

    prefix: str


def _item_nbytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    numel = 1
    for s in item.tensor_data.size:
        numel *= s
    return numel * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()


def split_into_files(items: list[WriteItem], files: int) -> list[list[WriteItem]]:
    """Spread items over ``files`` buckets of similar byte size, largest first."""
    buckets: list[list[WriteItem]] = [[] for _ in range(files)]
    sizes = [0] * files
    for item in sorted(items, key=_item_nbytes, reverse=True):
        i = sizes.index(min(sizes))
        buckets[i].append(item)
        sizes[i] += _item_nbytes(item) or 1
    return [b for b in buckets if b] or [[]]


def tensor_to_host_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's elements as a flat uint8 array on the host, copying only the view's data."""
    t = tensor.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat_bytes(t).numpy()


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``t``'s elements in row-major order (copies only non-contiguous views)."""
    flat = t.contiguous().reshape(-1)
    if flat.stride(0) != 1:  # "contiguous" size-1 tensors may keep an odd stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


class NvcompWriter(WriterStagingMixin, StorageWriter):
    """Writes a DCP checkpoint whose items are compressed (nvCOMP on the GPU, CPU codecs otherwise).

    Args:
        path: checkpoint directory (created if missing) or URL.
        codec: ``"auto"`` (per-dtype choice, always decodable without a GPU), or a codec name:
            ``"zstd"``, ``"gdeflate"``, ``"none"`` (raw, still checksummed); ``"ans"`` and
            ``"bitcomp"`` need a GPU to save and to load.
        thread_count: data files written in parallel per rank (as torch's FileSystemWriter).
        sync_files: fsync data files, ``.metadata`` and the directory before the save returns.
        overwrite: allow saving over an existing checkpoint (atomically replaced; see module doc).
        chunk_bytes: uncompressed bytes per independently compressed chunk (default 64 KiB).
        codec_threads: CPU threads for compression (default: all cores).
        storage_options: backend options for URLs (see :func:`nvdcp.storage.open_storage`).
        gpu: bounds and choices of the GPU path (:class:`~nvdcp.gpu.config.GpuConfig`); tensors
            on a CUDA device are compressed there with nvCOMP when ``nvidia-nvcomp-cu12`` is
            installed, other tensors on the CPU.

    It is also a DCP ``AsyncStager`` (:class:`~nvdcp.dcp.stager.WriterStagingMixin`):
    ``dcp.async_save`` stages through nvdcp's stager, and ``write_data`` writes the items that
    stager pre-encoded as they are.

    Raises:
        UnknownCodecError: ``codec`` names no codec (a ``ValueError``).
        NotACheckpointDirectoryError: ``path`` is an existing file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        codec: str = "auto",
        thread_count: int = 1,
        sync_files: bool = True,
        overwrite: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        codec_threads: int | None = None,
        storage_options: dict[str, Any] | None = None,
        gpu: GpuConfig | None = None,
    ) -> None:
        super().__init__()
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        if not 1024 <= chunk_bytes <= (1 << 16):
            raise ValueError(f"chunk_bytes must be within 1 KiB..64 KiB, got {chunk_bytes}")
        self.codec = validate_codec_choice(codec)
        self.thread_count = thread_count
        self.sync_files = sync_files
        self.overwrite = overwrite
        self.chunk_bytes = chunk_bytes
        self.codec_threads = codec_threads or os.cpu_count() or 1
        self.storage_options = dict(storage_options or {})
        self.path = os.fspath(path)
        self.storage: Storage = open_storage(self.path, sync=sync_files, **self.storage_options)
        self.save_id = uuid.uuid4().hex
        self.rank: int = 0
        self.is_coordinator = True
        self.use_collectives = True
        self.gpu = gpu or GpuConfig()
        self.last_report: Report | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._caller_event: Any = None
        self._guard: SaveGuard | None = None

    # -- pickling (async_save PROCESS mode): no threads or handles travel ----------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None
        state["_caller_event"] = None
        state["last_report"] = None  # holds a lock; a writer reused after a save must still pickle
        return state

    def _codec_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.codec_threads, thread_name_prefix="nvdcp-codec")
        return self._pool

    # -- StorageWriter -------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if self._guard is not None:
            self._guard.abandon()  # a save that never reached finish() is over
            self._guard = None
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
            self.storage = open_storage(self.path, sync=self.sync_files, **self.storage_options)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") or 0
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.storage.prepare()
        if not self.overwrite and self.storage.exists(METADATA_NAME):
            raise CheckpointExistsError(
                f"{self.storage.describe(METADATA_NAME)} exists and overwrite=False"
            )
        if not self.use_collectives:
            # No global plan step will run: pick a prefix unique to this rank and save.
            token = self.save_id[:12]
            plan = dataclasses.replace(plan, storage_data=_FilePrefix(f"__{self.rank}_{token}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        token = uuid.uuid4().hex[:12]
        self._guard = SaveGuard(self.storage)
        self._guard.mark(token)  # before any rank creates a data file of this save
        return [
            dataclasses.replace(p, storage_data=_FilePrefix(f"__{i}_{token}_")) for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix: _FilePrefix = plan.storage_data
        started = time.perf_counter()
        buckets = split_into_files(list(plan.items), self.thread_count)
        names = [f"{prefix.prefix}{i}{DATA_SUFFIX}" for i in range(len(buckets))]
        report = Report("save", self.storage.url)
        # The caller's stream: GPU compression must not read tensors before it has written them.
        self._caller_event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._caller_event = torch.cuda.Event()
            self._caller_event.record(torch.cuda.current_stream())
        self._staged: list[StagedShard] = []
        try:
            if len(buckets) == 1:
                results = self._write_file(names[0], buckets[0], planner, report)
            else:
                with ThreadPoolExecutor(len(buckets), thread_name_prefix="nvdcp-file") as files:
                    futures = [
                        files.submit(self._write_file, n, b, planner, report) for n, b in zip(names, buckets)
                    ]
                    results = [r for f in futures for r in f.result()]
        finally:
            # Staged bytes are never read after this: their host buffers go back to the stager.
            release_staged(self._staged)
            self._staged = []
        report.seconds = time.perf_counter() - started
        self.last_report = report
        logger.debug("rank %d wrote %s", self.rank, report.summary())
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage_md = {wr.index: wr.storage_data for rank_results in results for wr in rank_results}
        metadata.storage_data = storage_md
        metadata.storage_meta = StorageMeta(checkpoint_id=self.path, save_id=self.save_id)
        blob = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        guard = self._guard or SaveGuard(self.storage)  # no marker without a global plan step
        guard.check_data_files(storage_md)
        self.storage.write_atomic(METADATA_NAME, blob)
        guard.cleanup({info.relative_path for info in storage_md.values()}, blob)
        self._guard = None
        total = Report.from_metadata("save", self.storage.url, metadata)
        if self.last_report is not None:
            # whole-checkpoint bytes, this rank's phase times (the coordinator's view)
            total.seconds = self.last_report.seconds
            total.add(0, 0, **self.last_report.phases)
            if len(results) == 1:
                total.raw_bytes = self.last_report.raw_bytes
        self.last_report = total
        logger.info("nvdcp save %s", total.summary())

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        from nvdcp.storage import supports_url

        return supports_url(os.fspath(checkpoint_id))

    # -- internals -----------------------------------------------------------------------------
    def _encode(self, item: WriteItem, data: torch.Tensor | io.BytesIO) -> EncodedItem:
        pool = self._codec_pool()
        if item.type == WriteItemType.BYTE_IO:
            assert isinstance(data, io.BytesIO)
            raw = np.frombuffer(data.getbuffer(), dtype=np.uint8)
            layout = choose_layout(None, self.codec)
            return encode_item(
                raw, kind=KIND_BYTES, dtype_code=0, shape=(), element_size=1, layout=layout,
                pool=pool, chunk_bytes=self.chunk_bytes,
            )
        assert isinstance(data, torch.Tensor)
        try:
            code = dtype_code(data.dtype)
        except ValueError as exc:
            raise ValueError(f"item {item.index.fqn}: {exc}") from None
        if self.codec in GPU_ONLY and data.numel() == 0:
            layout = choose_layout(data.dtype, "none")  # nothing to compress, nothing needs a GPU
            return encode_item(
                np.empty(0, dtype=np.uint8), kind=KIND_TENSOR, dtype_code=code, shape=tuple(data.shape),
                element_size=data.element_size(), layout=layout, pool=pool, chunk_bytes=self.chunk_bytes,
            )
        if self.codec in GPU_ONLY:
            raise CodecUnavailableError(
                f"item {item.index.fqn}: codec {self.codec!r} compresses only on an NVIDIA GPU with "
                "nvidia-nvcomp-cu12 installed; none is usable here"
            )
        raw = tensor_to_host_bytes(data)
        layout = choose_layout(data.dtype, self.codec)
        return encode_item(
            raw, kind=KIND_TENSOR, dtype_code=code, shape=tuple(data.shape),
            element_size=data.element_size(), layout=layout, pool=pool, chunk_bytes=self.chunk_bytes,
        )

    def _on_gpu(self, data: torch.Tensor) -> bool:
        if not gpu_available():
            return False
        return data.is_cuda or (self.codec in GPU_ONLY and data.numel() > 0)

    def _gpu_job(self, item: WriteItem, data: torch.Tensor) -> Any:
        from nvdcp.gpu.encoder import GpuJob

        t = data.detach().resolve_conj().resolve_neg()
        if not t.is_cuda:
            t = t.to(torch.device("cuda", torch.cuda.current_device()))
        flat = flat_bytes(t) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)
        layout = choose_layout(t.dtype, self.codec, auto_codec=GPU_AUTO_CODEC)
        return GpuJob(item, flat, layout, t.dtype, dtype_code(t.dtype), tuple(t.shape))

    def _write_gpu_items(self, jobs: list[Any], write: Any) -> None:
        from nvdcp.gpu.encoder import GpuEncoder, encode_on_devices
        from nvdcp.gpu.pinned import POOL

        POOL.limit = self.gpu.pinned_memory_bytes

        def encoder_for(device: torch.device) -> GpuEncoder:
            return GpuEncoder(
                device, chunk_bytes=self.chunk_bytes,
                budget_bytes=self.gpu.gpu_budget(device) // self.thread_count,
                gdeflate_type=self.gpu.gdeflate_algorithm_type,
                pinned_bytes=self.gpu.pinned_memory_bytes // self.thread_count,
            )

        for job, encoded in encode_on_devices(jobs, encoder_for):
            write(job.key, encoded)

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner, report: Report
    ) -> list[WriteResult]:
        stream = self.storage.create(name)
        results: list[WriteResult] = []
        clock = [time.perf_counter()]

        def write(item: WriteItem, encoded: EncodedItem) -> None:
            t1 = time.perf_counter()
            offset = stream.tell()
            stream.write(encoded.header_bytes)
            stream.writelines(encoded.chunks)
            t2 = time.perf_counter()
            report.add(encoded.header.raw_nbytes, encoded.nbytes, encode_s=t1 - clock[0], io_s=t2 - t1)
            clock[0] = t2
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=encoded.nbytes,
                    storage_data=descriptor.storage_info(name, offset, encoded.nbytes, _main_codec(encoded)),
                )
            )

        try:
            stream.write(pack_file_header(_writer_info(self.rank, self.save_id)))
            gpu_jobs = []
            if self._caller_event is not None:
                torch.cuda.current_stream().wait_event(self._caller_event)
            for item in items:
                data = planner.resolve_data(item)
                if isinstance(data, StagedShard):  # from NvcompStager (dcp.async_save)
                    self._staged.append(data)
                    if data.encoded is not None:
                        clock[0] = time.perf_counter()
                        write(item, data.encoded)
                        continue
                    data = data.host_tensor
                if isinstance(data, torch.Tensor) and self._on_gpu(data):
                    gpu_jobs.append(self._gpu_job(item, data))
                    continue
                clock[0] = time.perf_counter()
                write(item, self._encode(item, data))
            if gpu_jobs:
                clock[0] = time.perf_counter()
                self._write_gpu_items(gpu_jobs, write)
            t0 = time.perf_counter()
            stream.commit()
            report.add(0, 0, io_s=time.perf_counter() - t0)
        except BaseException:
            stream.abort()
            raise
        return results


def _main_codec(encoded: EncodedItem) -> str:
    ids = [c for c in encoded.header.plane_codecs if c != 0]
    return codec_name(ids[0]) if ids else "none"


def _writer_info(rank: int, save_id: str) -> dict[str, object]:
    from nvdcp import __version__
    from nvdcp.gpu_info import nvcomp_version

    return {
        "nvdcp": __version__,
        "torch": torch.__version__,
        "nvcomp": nvcomp_version(),
        "rank": rank,
        "save_id": save_id,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


__all__ = ["METADATA_NAME", "NvcompWriter", "split_into_files", "tensor_to_host_bytes"]

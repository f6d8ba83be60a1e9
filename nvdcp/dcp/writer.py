"""``NvcompWriter``: a DCP StorageWriter that compresses every item it writes.

Layout on storage (docs/FORMAT.md): per rank, ``thread_count`` data files (default: chosen per
save, :func:`auto_file_count`), each written by its own thread, named
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
import functools
import logging
import math
import os
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from operator import attrgetter
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from nvdcp.codecs import codec_name
from nvdcp.cores import usable_cores
from nvdcp.dcp import descriptor
from nvdcp.dcp.collector import collector_paused
from nvdcp.dcp.commit import (
    HISTORY,
    CheckpointCommit,
    ItemRecord,
    check_identical_save,
    data_file_header,
    identical_save_policy,
    identity_digests,
    split_results,
)
from nvdcp.dcp.delta import (
    DEFAULT_MAX_CHAIN,
    DELTA_CHUNK_BYTES,
    DeltaPolicy,
    DeltaSave,
    SaveRef,
    resolve_base,
)
from nvdcp.dcp.durability import PendingCommits
from nvdcp.dcp.metadata_io import METADATA_NAME
from nvdcp.dcp.stager import NvcompStager, StagedShard, WriterStagingMixin, release_staged
from nvdcp.dcp.stock_items import merge_fsspec_kwargs, warn_once
from nvdcp.errors import CheckpointExistsError, StaleSaveError
from nvdcp.format.delta import BaseRef
from nvdcp.format.digest import DIGEST_ATTR, digest_of_record_header
from nvdcp.format.header import DEFAULT_CHUNK_BYTES
from nvdcp.gpu import gpu_available
from nvdcp.gpu.config import GpuConfig
from nvdcp.gpu.gil import short_switch_interval
from nvdcp.pipeline.config import EncodeConfig
from nvdcp.pipeline.cpu import EncodedItem, StreamedRecord
from nvdcp.pipeline.delta import DEFAULT_MIN_GAIN, DeltaTensor, default_min_item_bytes
from nvdcp.pipeline.encoder import ItemEncoder, shared_encoder
from nvdcp.pipeline.record_batch import RecordBatch, split_by_load
from nvdcp.pipeline.tensors import tensor_nbytes
from nvdcp.report import Report
from nvdcp.storage import Storage, open_storage
from nvdcp.storage.base import WriteStream
from nvdcp.storage.local import LocalStorage
from nvdcp.storage.spans import ChunkSpans

logger = logging.getLogger(__name__)

DATA_SUFFIX = ".nvdcp"
#: torch's FileSystemWriter default ``per_thread_copy_ahead`` (10 MB).
STOCK_COPY_AHEAD = 10_000_000


@dataclasses.dataclass(frozen=True)
class _FilePrefix:
    """Per-rank file-name prefix, chosen by the coordinator in ``prepare_global_plan``, with
    the save's delta decision (its base, or None: saved whole) and id, the same for every rank."""

    prefix: str
    base: BaseRef | None = None
    save_id: str = ""


class _WrittenPrefixes:
    """File prefixes this process has written data files under (the most recent ones)."""

    def __init__(self, keep: int = 4096) -> None:
        self._seen: dict[str, None] = {}
        self._keep = keep
        self._lock = threading.Lock()

    def first_use(self, prefix: str) -> bool:
        """Record ``prefix``; whether no save of this process wrote under it before."""
        with self._lock:
            if prefix in self._seen:
                return False
            self._seen[prefix] = None
            if len(self._seen) > self._keep:
                del self._seen[next(iter(self._seen))]
            return True


_WRITTEN_PREFIXES = _WrittenPrefixes()


def _item_nbytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    return tensor_nbytes(item.tensor_data.size, item.tensor_data.properties.dtype)


def split_into_files(items: list[WriteItem], files: int) -> list[list[WriteItem]]:
    """Spread items over ``files`` buckets of similar byte size, largest first."""
    buckets: list[list[WriteItem]] = [[] for _ in range(files)]
    sizes = [0] * files
    for item in sorted(items, key=_item_nbytes, reverse=True):
        i = sizes.index(min(sizes))
        buckets[i].append(item)
        sizes[i] += _item_nbytes(item) or 1
    return [b for b in buckets if b] or [[]]


def _spread(items: list[tuple[WriteItem, Any]], files: int) -> tuple[list[list[tuple[WriteItem, Any]]], list[int]]:
    """:func:`split_into_files` of ``(item, data)`` pairs over exactly ``files`` lists (some may
    be empty), and each list's bytes."""
    lists: list[list[tuple[WriteItem, Any]]] = [[] for _ in range(files)]
    sizes = [0] * files
    nbytes = [_item_nbytes(item) for item, _ in items]  # once per item (a dtype's size, a product)
    for k in sorted(range(len(items)), key=nbytes.__getitem__, reverse=True):
        i = sizes.index(min(sizes))
        lists[i].append(items[k])
        sizes[i] += nbytes[k] or 1
    return lists, sizes


#: ``thread_count=None`` on local storage: one data file per this many bytes of the rank's
#: state, up to :data:`AUTO_MAX_FILES` and the number of cores. One file is written at ~3 GB/s
#: on /dev/shm (the kernel serializes writes to one inode), 8 at once at ~12 GB/s (H200 host,
#: ``python -m benchmarks.gpu_pipeline_bench``, its "files" probe, 2026-12-01).
AUTO_FILE_BYTES = 64 << 20
AUTO_MAX_FILES = 8
#: Buckets of GPU records held in pinned memory at once when several files are written: records
#: of up to this many buckets are being written while the next one is compressed.
PARALLEL_DEPTH = 4


def auto_file_count(storage: Storage, nbytes: int) -> int:
    """Data files a rank writes in parallel when ``thread_count`` is left at None."""
    if not isinstance(storage, LocalStorage):
        return 1  # S3 and fsspec: one stream per rank (their own uploads run in parallel)
    cap = min(AUTO_MAX_FILES, usable_cores())
    return max(1, min(cap, math.ceil(nbytes / AUTO_FILE_BYTES)))


def _default_chunk_bytes(encoder: ItemEncoder | None, saves_deltas: bool) -> int:
    """A writer's ``chunk_bytes`` when the caller gives none: its ``encoder``'s, else
    :data:`~nvdcp.dcp.delta.DELTA_CHUNK_BYTES` for a writer that saves deltas (nvCOMP's Zstd call
    on a GPU takes as long as one chunk), else the format's default."""
    if encoder is not None:
        return encoder.config.chunk_bytes
    return DELTA_CHUNK_BYTES if saves_deltas else DEFAULT_CHUNK_BYTES


class NvcompWriter(WriterStagingMixin, StorageWriter):
    """Writes a DCP checkpoint whose items are compressed (nvCOMP on the GPU, CPU codecs otherwise).

    A drop-in for torch's ``FileSystemWriter``: its arguments (torch 2.9 to 2.15) in the same
    positions, then nvdcp's own, keyword-only. ``FsspecWriter``'s agree up to
    ``per_thread_copy_ahead``; its later ones (``overwrite``, ``_extensions``...) pass by keyword,
    and its ``**kwargs`` (fsspec options) are accepted too. Stock arguments without a meaning
    here are accepted and ignored, with a one-time warning.

    Args:
        path: checkpoint directory (created if missing) or URL.
        single_file_per_rank: stock's default ``True`` (one data file per rank and I/O thread) is
            what nvdcp writes. ``False`` (stock: one file per item) is not supported: nvdcp still
            writes one file per rank and thread (warned); the checkpoint loads the same.
        sync_files: fsync data files, ``.metadata`` and the directory before the save returns.
        thread_count: data files written in parallel per rank, one thread each (as torch's
            FileSystemWriter). ``None`` (default): chosen per save. On local storage, one file
            per 64 MiB of the rank's state, up to 8 and the number of cores (one file is written
            at ~3 GB/s on /dev/shm, eight at once at ~12 GB/s); on S3 and fsspec, one. GPU items
            are compressed by one encoder at the full GPU and pinned budgets whatever the count,
            and their records spread over the files as they come out.
        per_thread_copy_ahead: ignored (warned when not stock's default): the GPU path bounds its
            own device-to-host traffic (:class:`~nvdcp.gpu.config.GpuConfig`).
        cache_staged_state_dict: ignored (warned when True): ``dcp.async_save`` stages through
            nvdcp's stager, which always keeps and reuses its host buffers across saves
            (:func:`nvdcp.release_resources` frees them).
        overwrite: allow saving over an existing checkpoint (atomically replaced; see module doc).
            ``False`` makes a save onto a checkpoint raise :class:`~nvdcp.CheckpointExistsError`,
            a ``RuntimeError`` as with stock DCP.
        _extensions: torch's stream transforms (``ZStandard``...): ignored for writing (warned),
            nvdcp compresses items itself (``codec``). :class:`~nvdcp.NvcompReader` does undo
            them when it reads a stock checkpoint.
        serialization_format: ``SerializationFormat.TORCH_SAVE`` (stock's default) or None;
            anything else (``SAFETENSORS``) is ignored, with a warning: nvdcp writes its own
            container (docs/FORMAT.md).
        codec: ``"auto"`` (per-dtype choice, always decodable without a GPU), or a codec name:
            ``"zstd"``, ``"gdeflate"``, ``"none"`` (raw, still checksummed); ``"ans"`` and
            ``"bitcomp"`` need a GPU to save and to load.
        chunk_bytes: uncompressed bytes per independently compressed chunk (1 KiB..64 KiB; default
            ``encoder``'s when one is given, else 64 KiB, or 32 KiB for a writer that saves
            deltas, ``delta=`` or ``base=``: see :data:`nvdcp.dcp.delta.DELTA_CHUNK_BYTES`).
        codec_threads: CPU threads for compression (default: all cores).
        storage_options: backend options for URLs (see :func:`nvdcp.storage.open_storage`).
        gpu: bounds and choices of the GPU path (:class:`~nvdcp.gpu.config.GpuConfig`); tensors
            on a CUDA device are compressed there with nvCOMP when ``nvidia-libnvcomp-cu12`` is
            installed, other tensors on the CPU.
        stager: the :class:`~nvdcp.NvcompStager` that ``dcp.async_save`` stages through (you hold
            it and close it); default: the process-wide stager for these settings.
        encoder: the :class:`~nvdcp.pipeline.encoder.ItemEncoder` that compresses (you hold it
            and close it); default: the process-wide encoder for these settings, so writers made
            per save reuse GPU encoders and pinned buffers. :func:`nvdcp.release_resources`
            frees the process-wide ones.
        delta: a :class:`~nvdcp.DeltaPolicy` (one per job, passed to every writer of the job):
            saves become deltas against the previous save this policy committed, with a full
            checkpoint every ``full_every`` saves (docs/FORMAT.md, "Delta checkpoints"). Items
            whose delta does not pay are stored whole; loads need the chain of bases.
        base: the location of an earlier nvdcp checkpoint to save this one against (a delta);
            overrides the policy's choice for this save. Must not be ``path`` itself.
        on_identical_save: when every item of a save is byte-identical to the previous save this
            process committed (stale weights saved again; compared by the items' digests,
            docs/RELIABILITY.md): ``"warn"`` (default) logs a warning, ``"error"`` raises
            :class:`~nvdcp.StaleSaveError` before ``.metadata`` is written (the save's data files
            are deleted, the checkpoint there before is intact), ``"ignore"`` does neither. A
            :class:`~nvdcp.NvcompStager` the save was staged through may set it instead.
        **fsspec_options: ``FsspecWriter``'s ``**kwargs``: fsspec options for a URL (merged into
            ``storage_options``; an ``s3://`` URL then goes through s3fs unless ``backend`` is
            given); ignored, with a warning, for a local path.

    It is also a DCP ``AsyncStager`` (:class:`~nvdcp.dcp.stager.WriterStagingMixin`):
    ``dcp.async_save`` stages through nvdcp's stager, and ``write_data`` writes the items that
    stager pre-encoded as they are.

    Raises:
        UnknownCodecError: ``codec`` names no codec (a ``ValueError``).
        ValueError: ``thread_count``, ``chunk_bytes`` or ``codec_threads`` out of range, or an
            unknown ``on_identical_save``.
        TypeError: a string where ``single_file_per_rank`` goes (pass ``codec=`` by keyword).
        NotACheckpointDirectoryError: ``path`` is an existing file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int | None = None,
        per_thread_copy_ahead: int = STOCK_COPY_AHEAD,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
        serialization_format: Any = None,
        *,
        codec: str = "auto",
        chunk_bytes: int | None = None,
        codec_threads: int | None = None,
        storage_options: dict[str, Any] | None = None,
        gpu: GpuConfig | None = None,
        stager: NvcompStager | None = None,
        encoder: ItemEncoder | None = None,
        on_identical_save: str = "warn",
        delta: DeltaPolicy | None = None,
        base: str | os.PathLike[str] | None = None,
        **fsspec_options: Any,
    ) -> None:
        super().__init__()
        if isinstance(single_file_per_rank, str):
            raise TypeError(
                f"NvcompWriter: single_file_per_rank must be a bool, got {single_file_per_rank!r} "
                "(nvdcp's own arguments are keyword-only: codec=...)"
            )
        _warn_stock_arguments(single_file_per_rank, per_thread_copy_ahead, cache_staged_state_dict,
                              _extensions, serialization_format)
        if thread_count is not None and thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        if chunk_bytes is None:
            chunk_bytes = _default_chunk_bytes(encoder, saves_deltas=delta is not None or base is not None)
        self.encoding = EncodeConfig(codec, chunk_bytes, codec_threads)
        self.gpu = gpu or GpuConfig()
        if encoder is not None and (encoder.config, encoder.gpu) != (self.encoding, self.gpu):
            raise ValueError("encoder= was built with other settings than this writer's codec/chunk_bytes/gpu")
        self.thread_count = thread_count
        self.sync_files = sync_files
        self.overwrite = overwrite
        # Stock arguments kept as stock's writer keeps them (read by nothing here).
        self.single_file_per_rank = single_file_per_rank
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.cache_staged_state_dict = cache_staged_state_dict
        self.serialization_format = serialization_format
        self.path = os.fspath(path)
        self.storage_options = merge_fsspec_kwargs("NvcompWriter", self.path, storage_options, fsspec_options)
        self.storage: Storage = open_storage(self.path, sync=sync_files, **self.storage_options)
        self.save_id = uuid.uuid4().hex
        self.rank: int = 0
        self.is_coordinator = True
        self.use_collectives = True
        self.stager = stager
        self.last_report: Report | None = None
        self._encoder = encoder
        self._caller_event: Any = None
        self._commit: CheckpointCommit | None = None
        self._staged: list[StagedShard] = []
        self.on_identical_save = identical_save_policy(on_identical_save)
        self._stager_policy: str | None = None  # the on_identical_save of the stager this save went through
        if delta is not None and not isinstance(delta, DeltaPolicy):
            raise TypeError(f"delta must be an nvdcp.DeltaPolicy, got {type(delta).__name__}")
        self.delta = delta
        self.base = os.fspath(base) if base is not None else None
        self._plan_base: BaseRef | None = None  # this save's base, as the coordinator chose it

    @property
    def codec(self) -> str:
        return self.encoding.codec

    @property
    def chunk_bytes(self) -> int:
        return self.encoding.chunk_bytes

    @property
    def encoder(self) -> ItemEncoder:
        """What compresses this writer's items (see the ``encoder`` argument)."""
        return self._encoder or shared_encoder(self.encoding, self.gpu)

    # -- pickling (async_save PROCESS mode): no threads or handles travel ----------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_caller_event"] = None
        state["_pending_commits"] = None  # threads; finish() runs where write_data() ran
        state["last_report"] = None  # holds a lock; a writer reused after a save must still pickle
        return state

    # -- StorageWriter -------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._settle_commits()  # a save that never reached finish(): its files are closed first
        if self._commit is not None:
            self._commit.abandon()  # a save that never reached finish() is over
            self._commit = None
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
                f"Checkpoint already exists: {self.storage.describe(METADATA_NAME)} exists and overwrite=False"
            )
        if not self.use_collectives:
            # No global plan step will run: pick a prefix unique to this rank and save.
            token = self.save_id[:12]
            self._plan_base = self._choose_base()
            plan = dataclasses.replace(
                plan, storage_data=_FilePrefix(f"__{self.rank}_{token}_", self._plan_base, self.save_id)
            )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        token = uuid.uuid4().hex[:12]
        self._plan_base = self._choose_base()  # one decision for every rank
        self._commit = CheckpointCommit(self.storage)
        self._commit.begin(token)  # before any rank creates a data file of this save
        return [
            dataclasses.replace(p, storage_data=_FilePrefix(f"__{i}_{token}_", self._plan_base, self.save_id))
            for i, p in enumerate(plans)
        ]

    def _choose_base(self) -> BaseRef | None:
        """This save's base (``base=``, else the policy's previous save), or None: saved whole."""
        if self.base is not None:
            max_chain = self.delta.max_chain if self.delta is not None else DEFAULT_MAX_CHAIN
            return resolve_base(self.path, self.base, self.storage_options, max_chain, explicit=True)
        if self.delta is None:
            return None
        candidate = self.delta.next_base()
        if candidate is None:
            return None
        return resolve_base(self.path, candidate, self.storage_options, self.delta.max_chain, explicit=False,
                            known=self.delta.known_base(candidate))

    @collector_paused
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = self._prefix_of_this_save(plan.storage_data)
        started = time.perf_counter()
        report = Report("save", self.storage.url)
        # The caller's stream: GPU compression must not read tensors before it has written them.
        self._caller_event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._caller_event = torch.cuda.Event()
            self._caller_event.record(torch.cuda.current_stream())
        self._staged = []
        self._stager_policy = None
        self._delta_save = self._delta_for(prefix)
        ok = False
        try:
            results = self._write_files(prefix.prefix, list(plan.items), planner, report)
            ok = True
        finally:
            if self._delta_save is not None:
                self._delta_save.finish(ok)
                self._delta_save = None
            self._stager_policy = _stager_policy(self._staged)
            # Staged bytes are never read after this: their host buffers go back to the stager.
            release_staged(self._staged)
            self._staged = []
        report.seconds = time.perf_counter() - started
        self.last_report = report
        logger.debug("rank %d wrote %s", self.rank, report.summary())
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _prefix_of_this_save(self, prefix: Any) -> _FilePrefix:
        """The plan's file prefix, or a new one for this rank where the plan is an earlier save's.

        A planner that caches plans (``DefaultSavePlanner(enable_plan_caching=True)``) hands
        ``write_data`` the final plan of the save that filled its cache, prefix included: this
        save would write that save's data file names again, in place in the same location (a
        crash midway would leave its checkpoint pointing at half-written files); that save may
        even have been another writer's (torch keys the cache by the planner's class). Such a
        save names its files itself, per rank, as a save without collectives does. A delta save
        is refused: the cached plan carries the earlier save's base decision, not this one's.
        """
        if isinstance(prefix, _FilePrefix) and _WRITTEN_PREFIXES.first_use(prefix.prefix):
            return prefix
        if getattr(prefix, "base", None) is not None or self.delta is not None or self.base is not None:
            raise ValueError(
                f"NvcompWriter({self.path!r}): the plan DCP handed write_data is an earlier save's "
                f"(its file prefix {getattr(prefix, 'prefix', prefix)!r} was used before): the planner "
                "caches plans (DefaultSavePlanner(enable_plan_caching=True)), and a delta save (delta= "
                "or base=) needs this save's own plan, which carries its base. Pass enable_plan_caching=False"
            )
        fresh = _FilePrefix(f"__{self.rank}_{uuid.uuid4().hex[:12]}_", None, self.save_id)
        _WRITTEN_PREFIXES.first_use(fresh.prefix)
        logger.debug("rank %d: cached plan; data files named %s*", self.rank, fresh.prefix)
        return fresh

    def _delta_for(self, prefix: _FilePrefix) -> DeltaSave | None:
        """This rank's delta bookkeeping for the save (None: no base and nothing to keep)."""
        if prefix.base is None and self.delta is None:
            return None
        cache = self.delta.cache if self.delta is not None and self.delta.cache.enabled else None
        if prefix.base is None and cache is None:
            return None
        keep_bytes = self.delta is not None and (self.delta.keeps_every_save or prefix.base is None)
        return DeltaSave(
            prefix.base, prefix.save_id or self.save_id, cache if keep_bytes or prefix.base else None,
            self.storage_options, self.delta.min_gain if self.delta is not None else DEFAULT_MIN_GAIN,
            pin=torch.cuda.is_available() and gpu_available(), keep_bytes=keep_bytes,
            min_item_bytes=self.delta.min_item_bytes if self.delta is not None else default_min_item_bytes(),
            gpu_encodes=functools.partial(self.encoder.uses_gpu, gpu_ok=gpu_available()),
        )

    _delta_save: DeltaSave | None = None

    #: Record the items' digests (docs/FORMAT.md); off only to measure what they cost
    #: (benchmarks/digest_cost.py): write_data then returns torch's records alone.
    _record_digests: bool = True

    #: This rank's data files still being committed (the coordinator's; see nvdcp.dcp.durability).
    _pending_commits: PendingCommits | None = None

    def _settle_commits(self) -> None:
        """Wait for data files still being committed by a save that will not publish them."""
        pending, self._pending_commits = self._pending_commits, None
        if pending is not None:
            try:
                pending.wait()
            except Exception as exc:  # noqa: BLE001 - that save is over; its files go with its cleanup
                logger.debug("a data file of an unpublished save failed to commit: %s", exc)

    def _hand_over_commits(self, files: list[_FileWriter], ok: bool) -> None:
        """Commit the files whose commit was deferred, in the background; after a failure
        (``ok`` false) abort them instead."""
        deferred = [(f.name, f.uncommitted) for f in files if f.uncommitted is not None]
        for f in files:
            f.uncommitted = None
        if not deferred:
            return
        if ok:
            self._pending_commits = PendingCommits(deferred)
            return
        for name, stream in deferred:
            try:
                stream.abort()
            except Exception as exc:  # noqa: BLE001 - the save's first error is the one raised
                logger.debug("aborting %s: %s", name, exc)

    @collector_paused
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage_md, digests = split_results(results)
        commit = self._commit or CheckpointCommit(self.storage)  # no marker without a global plan step
        if digests is not None:
            try:
                check_identical_save(self.storage.url, identity_digests(results, digests), self._identical_save_policy())
            except StaleSaveError:
                self._settle_commits()  # no commit may still be creating a file that refuse() deletes
                commit.refuse(storage_md)  # this save's files go; the checkpoint there stays
                self._commit = None
                raise

        def files_durable() -> None:
            """Wait for this rank's data files (nvdcp.dcp.durability); refuse the save if one failed."""
            pending, self._pending_commits = self._pending_commits, None
            if pending is None:
                return
            try:
                pending.wait()
            except BaseException:
                commit.refuse(storage_md)
                self._commit = None
                raise

        # no base planned: no rank wrote a delta (the scan is a Python call per item)
        base = self._plan_base
        if base is not None and not any(descriptor.is_delta(info) for info in storage_md.values()):
            base = None
        blob = commit.commit(
            metadata, storage_md, self.path, self.save_id, digests=digests,
            delta=base.as_record() if base is not None else None, before_publish=files_durable,
        )
        commit.cleanup({info.relative_path for info in storage_md.values()})
        self._commit = None
        if digests is not None:
            HISTORY.remember(self.storage.url, self.save_id, digests)
        if self.delta is not None:
            crc = getattr(metadata, DIGEST_ATTR, {}).get("crc") if digests is not None else None
            self.delta.committed(SaveRef(self.path, self.save_id, base.depth if base else 0, crc), blob)
        del blob
        own = self.last_report
        # whole-checkpoint bytes, this rank's phase times (the coordinator's view); a save by
        # one rank has counted its raw bytes already
        known_raw = own.raw_bytes if own is not None and len(results) == 1 else None
        total = Report.from_metadata("save", self.storage.url, metadata, raw_bytes=known_raw)
        if own is not None:
            total.seconds = own.seconds
            total.add(0, 0, **own.phases)
        self.last_report = total
        if logger.isEnabledFor(logging.INFO):
            logger.info("nvdcp save %s", total.summary())

    def _identical_save_policy(self) -> str:
        """``on_identical_save`` of this save: its stager's when that sets one, else this writer's."""
        stager_policy: str | None = getattr(self, "_stager_policy", None) or getattr(
            self.stager, "on_identical_save", None
        )
        return stager_policy or str(getattr(self, "on_identical_save", "warn"))

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
    def _file_count(self, items: list[WriteItem]) -> int:
        n = self.thread_count
        if n is None:
            n = auto_file_count(self.storage, sum(_item_nbytes(item) for item in items))
        return max(1, min(n, len(items)))

    def _write_files(
        self, prefix: str, items: list[WriteItem], planner: SavePlanner, report: Report
    ) -> list[WriteResult]:
        """Write the rank's items to its data files, one thread per file.

        CPU items are spread over the files up front (largest first, equal bytes) and encoded by
        each file's thread in batches (:meth:`ItemEncoder.encode_items`). GPU items are encoded
        by one GPU encoder per device at the full budgets, on this thread; each record goes to
        the file with the least bytes waiting to be written (then the fewest bytes so far), and
        the next bucket compresses while the files write the held ones.
        """
        n = self._file_count(items)
        encoder = self.encoder
        gpu_ok = gpu_available()
        cpu: list[tuple[WriteItem, Any]] = []
        gpu: list[tuple[WriteItem, torch.Tensor | DeltaTensor]] = []
        delta = self._delta_save
        resolved: dict[int, Any] = {
            id(item): planner.resolve_data(item) for item in items if item.type != WriteItemType.BYTE_IO
        }
        if delta is not None:  # bases the cache lacks, read back from storage in parallel
            delta.prefetch([(item.index, t) for item in items if isinstance(t := resolved.get(id(item)), torch.Tensor)])
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                cpu.append((item, None))  # resolved by its file's thread (a serialized object)
                continue
            data = resolved.pop(id(item))
            if delta is not None and isinstance(data, torch.Tensor):
                data = delta.prepare(item.index, data)  # its base, and where its bytes are kept
            tensor = data.tensor if isinstance(data, DeltaTensor) else data
            if isinstance(tensor, torch.Tensor) and encoder.uses_gpu(tensor, gpu_ok):
                gpu.append((item, data))
            else:
                cpu.append((item, data))  # a host tensor, or a StagedShard (finished by the file's thread)
        jobs = [encoder.gpu_job(item, t, _describe_item(item)) for item, t in gpu]
        del gpu
        per_file, sizes = _spread(cpu, n)
        del cpu
        names = [f"{prefix}{i}{DATA_SUFFIX}" for i in range(n)]
        # Several files at once on local storage: each file's writes stay on its thread (writes
        # to one inode serialize; slicing them over the I/O pool only adds contention).
        max_run = SMALL_WRITE_RUN_BYTES if n > 1 and isinstance(self.storage, LocalStorage) else None
        failed = threading.Event()  # any file (or the GPU encode) failed: every file stops
        files = [_FileWriter(self, names[i], per_file[i], planner, report, sizes[i], max_run, failed)
                 for i in range(n)]
        if n == 1 and not jobs:
            files[0].queue.put(None)  # no GPU records will come
            self._write_file(files[0])  # nothing to overlap with: this thread writes the file
            self._hand_over_commits(files, files[0].error is None)
            if files[0].error is not None:
                raise files[0].error
            return files[0].results
        with ThreadPoolExecutor(n, thread_name_prefix="nvdcp-file") as pool:
            futures = [pool.submit(self._write_file, f) for f in files]
            dispatch_error: BaseException | None = None
            try:
                if jobs:
                    with short_switch_interval():  # the encode thread launches between file threads
                        self._dispatch_gpu(jobs, files, failed)
            except BaseException as exc:  # noqa: BLE001 - raised below, once the files stopped
                dispatch_error = exc
                failed.set()
            finally:
                for f in files:
                    f.queue.put(None)
            for fut in futures:
                fut.result()
        first = dispatch_error or next((f.error for f in files if f.error is not None), None)
        self._hand_over_commits(files, first is None)
        if first is not None:
            raise first
        results = [r for f in files for r in f.results]
        return _in_plan_order(results, items)

    def _write_file(self, file: _FileWriter) -> None:
        """Write one data file (on its thread); its error is kept in ``file.error``."""
        file.run()

    def _dispatch_gpu(self, jobs: list[Any], files: list[_FileWriter], failed: threading.Event) -> None:
        """Encode ``jobs`` and queue each record on a file's thread; returns once every record
        is written (after a failure anywhere, the records not yet written are dropped). Deltas
        that do not pay are encoded again, whole, once the rest are queued."""
        whole = self._dispatch_gpu_pass(jobs, files, failed)
        if whole and not failed.is_set():
            self._dispatch_gpu_pass(whole, files, failed)

    def _dispatch_gpu_pass(self, jobs: list[Any], files: list[_FileWriter], failed: threading.Event) -> list[Any]:
        depth = 2 if len(files) == 1 else PARALLEL_DEPTH
        buckets = self.encoder.encode_gpu_buckets(jobs, depth, batches=True)
        again: list[Any] = []
        try:
            for bucket in buckets:
                if failed.is_set():
                    bucket.release()
                    break
                keep: list[tuple[Any, EncodedItem] | RecordBatch] = []
                for record in bucket.records:
                    if isinstance(record, RecordBatch):  # whole records without a base
                        keep.append(record)
                        continue
                    job, encoded = record
                    delta = getattr(job, "delta", None)  # (the CPU tests drive this with stand-in jobs)
                    if delta is not None and not delta.pays(encoded.nbytes):
                        again.append(job.whole(self.encoder.whole_layout(job.dtype)))
                    else:
                        keep.append((job, encoded))
                shares = _share_out(keep, files)
                refs = _BucketRefs(bucket, len(shares))
                for f, share in shares.items():
                    f.enqueue(share, refs)
                del bucket, refs, shares
        except BaseException:
            failed.set()  # the files drop what is queued instead of writing it
            raise
        finally:
            # Every queued record must be written or dropped before the buckets' buffers go back.
            for f in files:
                f.queue.put(_DRAIN)
            for f in files:
                f.drained.wait()
                f.drained.clear()
            buckets.close()
        return again

    def _batch_results(self, name: str, batch: RecordBatch, offsets: np.ndarray) -> list[WriteResult]:
        """:meth:`_result` for each record of ``batch`` (none is a delta), written at ``offsets``."""
        lo, hi = batch.lo, batch.hi
        results = []
        for job, fields, offset, size, digest in zip(
            batch.jobs[lo:hi], batch.fields[lo:hi], offsets.tolist(), batch.record_nbytes.tolist(),
            batch.digests[lo:hi].tolist(),
        ):
            item = job.key
            info = descriptor.storage_info(name, offset, size, _descriptor_codec(fields.plane_codecs))
            if self._delta_save is not None:
                self._delta_save.written(item.index, digest, size)
            results.append(WriteResult(index=item.index, size_in_bytes=size,
                                       storage_data=ItemRecord(info, digest) if self._record_digests else info))
        return results

    def _result(self, name: str, item: WriteItem, offset: int, encoded: EncodedItem) -> WriteResult:
        header = encoded.header
        info = descriptor.storage_info(name, offset, encoded.nbytes, _descriptor_codec(header.plane_codecs), header.is_delta)
        digest = header.stored_crc if header.stored_crc is not None else digest_of_record_header(encoded.header_bytes)
        if self._delta_save is not None:
            self._delta_save.written(item.index, digest, None if header.is_delta else encoded.nbytes, header)
        return WriteResult(
            index=item.index,
            size_in_bytes=encoded.nbytes,
            # the digest is the header's own CRC32C: no pass over the data (docs/FORMAT.md)
            storage_data=ItemRecord(info, digest, header.base_digest if encoded.unchanged else None)
            if self._record_digests else info,
        )


#: Put on a file's queue after the last GPU record of a save: the thread signals ``drained``.
_DRAIN = object()


#: What a file is given to write: one record, or a batch of them (:class:`RecordBatch`).
_ShareEntry = tuple[WriteItem, EncodedItem] | RecordBatch


def _share_out(records: list[tuple[Any, EncodedItem] | RecordBatch],
               files: list[_FileWriter]) -> dict[_FileWriter, list[_ShareEntry]]:
    """A bucket's records shared out over the files: each to the file with the fewest bytes
    waiting (then the fewest so far), as counted when the bucket came plus what it gave each; a
    batch in consecutive parts that even out the files' waiting bytes (:func:`split_by_load`).
    One queue entry per file and bucket: a lock and a queue handoff per record cost more than
    writing a small record (H200, 20,000 small tensors)."""
    if len(files) == 1:
        return {files[0]: [r if isinstance(r, RecordBatch) else (r[0].key, r[1]) for r in records]} if records else {}
    loads = [list(f.load()) for f in files]
    shares: dict[_FileWriter, list[_ShareEntry]] = {}
    for record in records:
        if isinstance(record, RecordBatch):
            for i, part in split_by_load(record, [load[0] for load in loads], [load[1] for load in loads]):
                loads[i][0] += part.nbytes
                loads[i][1] += part.nbytes
                shares.setdefault(files[i], []).append(part)
            continue
        job, encoded = record
        i = min(range(len(files)), key=loads.__getitem__)
        loads[i][0] += encoded.nbytes
        loads[i][1] += encoded.nbytes
        shares.setdefault(files[i], []).append((job.key, encoded))
    return shares


class _BucketRefs:
    """Shares of one GPU bucket not yet written: the bucket's pinned buffer goes back to the
    encoder's pool when the last is written (records of one bucket go to several files)."""

    def __init__(self, bucket: Any, count: int) -> None:
        self.bucket = bucket
        self.left = count
        self.lock = threading.Lock()
        if count == 0:
            bucket.release()

    def done(self) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self.bucket.release()


class _FileWriter:
    """One data file and the thread writing it: its CPU items (encoded in batches on the codec
    pool), then GPU records queued by the dispatcher (written first whenever some are waiting)."""

    def __init__(self, writer: NvcompWriter, name: str, items: list[tuple[WriteItem, Any]], planner: SavePlanner,
                 report: Report, cpu_bytes: int, max_run: int | None, failed: threading.Event) -> None:
        self.writer = writer
        self.name = name
        self.items = items
        self.planner = planner
        self.report = report
        self.max_run = max_run
        self.results: list[WriteResult] = []
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.failed = failed  # shared by the save's files
        self.drained = threading.Event()
        self.error: BaseException | None = None  # what failed here (None: fine, or another file failed)
        self.ended = False  # the end marker came: no more GPU records
        self._lock = threading.Lock()
        self.waiting = 0  # bytes queued, not yet written
        self.assigned = cpu_bytes  # bytes given to this file so far (CPU items: raw bytes)
        self.out: _RecordWriter | None = None
        self.uncommitted: WriteStream | None = None  # written, its commit left to the writer
        self.sizes = [0, 0]  # raw and stored bytes
        self.secs = [0.0, 0.0]  # encode (waiting for records) and io seconds
        self.clock = 0.0

    def load(self) -> tuple[int, int]:
        """Bytes waiting to be written here, then bytes given so far: the least loaded file
        gets the next GPU record. Read without the lock (once per file and record: a value a
        moment old only moves a record to another file)."""
        return self.waiting, self.assigned

    def enqueue(self, share: list[_ShareEntry], refs: _BucketRefs) -> None:
        """Queue a bucket's records for this file (written in order, then ``refs.done()``)."""
        nbytes = sum(entry.nbytes if isinstance(entry, RecordBatch) else entry[1].nbytes for entry in share)
        with self._lock:
            self.waiting += nbytes
            self.assigned += nbytes
        self.queue.put((share, nbytes, refs))

    # -- the file's thread -----------------------------------------------------------------------
    def write(self, item: WriteItem, encoded: EncodedItem, borrowed: bool = False) -> None:
        """Append a record (``borrowed``: its chunks stay valid until the next flush, so small
        records are not copied into a batch of their own)."""
        assert self.out is not None
        t1 = time.perf_counter()
        offset = self.out.append(encoded, borrowed)
        self._count(encoded.header.raw_nbytes, encoded.nbytes, t1)
        self.results.append(self.writer._result(self.name, item, offset, encoded))

    def write_streamed(self, item: WriteItem, record: StreamedRecord) -> None:
        """Append a record whose chunks are written as they are compressed, its header last."""
        assert self.out is not None
        t1 = time.perf_counter()
        try:
            offset, encoded = self.out.append_streamed(record)
        except BaseException:
            record.close()  # no group may still be compressing into a failed file's record
            raise
        self._count(encoded.header.raw_nbytes, encoded.nbytes, t1)
        self.results.append(self.writer._result(self.name, item, offset, encoded))

    def write_batch(self, batch: RecordBatch) -> None:
        """Append a batch of records (its memory stays valid until the next flush)."""
        assert self.out is not None
        t1 = time.perf_counter()
        offsets = self.out.append_batch(batch)
        self._count(batch.raw_nbytes, batch.nbytes, t1)
        self.results.extend(self.writer._batch_results(self.name, batch, offsets))

    def _count(self, raw: int, stored: int, write_started: float) -> None:
        """Bytes written and time spent: waiting for records since the last write, then writing."""
        now = time.perf_counter()
        self.sizes[0] += raw
        self.sizes[1] += stored
        self.secs[0] += write_started - self.clock
        self.secs[1] += now - write_started
        self.clock = now

    def _write_queued(self, block: bool) -> bool:
        """Write GPU records waiting in the queue (``block``: until the end marker). Returns
        whether the end marker came."""
        while not self.ended:
            try:
                got = self.queue.get(block=block)
            except queue.Empty:
                return False
            if got is None:
                self.drained.set()
                self.ended = True
                return True
            if got is _DRAIN:
                self.drained.set()  # the dispatcher may close the GPU buckets once all files say so
                continue
            share, nbytes, refs = got
            try:
                if not self.failed.is_set():
                    for entry in share:
                        if isinstance(entry, RecordBatch):
                            self.write_batch(entry)
                        else:
                            item, encoded = entry
                            self.write(item, encoded, borrowed=True)
                    assert self.out is not None
                    self.out.flush()  # before the bucket's buffer can go back: its records view it
            except BaseException:
                if self.out is not None:
                    self.out.discard()  # the file fails: no view of the bucket may outlive this
                raise
            finally:
                with self._lock:
                    self.waiting -= nbytes
                refs.done()
        return True

    def _resolved(self) -> Any:
        """CPU items to encode; items the stager pre-encoded are written on the way."""
        writer = self.writer
        for item, data in self.items:
            if data is None:
                data = self.planner.resolve_data(item)
            if isinstance(data, StagedShard):  # from NvcompStager (dcp.async_save)
                writer._staged.append(data)
                if data.encoded is not None:
                    self.clock = time.perf_counter()
                    self.write(item, data.encoded)
                    continue
                data = data.host_tensor
                if writer._delta_save is not None:
                    data = writer._delta_save.prepare(item.index, data)  # its base; its bytes kept
            yield item, data

    def run(self) -> None:
        """Write the file; an error is kept in :attr:`error` (every file stops, the save raises it)."""
        writer = self.writer
        stream: WriteStream | None = None
        try:
            stream = writer.storage.create(self.name)
            self.out = _RecordWriter(stream, self.max_run)
            self.out.start(data_file_header(writer.rank, writer.save_id))
            if writer._caller_event is not None:
                torch.cuda.current_stream().wait_event(writer._caller_event)
            self.clock = time.perf_counter()
            if self.items:
                # small host tensors come as batches (records back to back: one write each),
                # large ones as streamed records where the file can take a header last
                for entry in writer.encoder.encode_items(self._resolved(), _describe_item, batches=True,
                                                         streams=stream.fills_in):
                    if isinstance(entry, RecordBatch):
                        self.write_batch(entry)
                    elif isinstance(entry[1], StreamedRecord):
                        self.write_streamed(entry[0], entry[1])
                    else:
                        self.write(entry[0], entry[1])
                    self._write_queued(block=False)
                    if self.failed.is_set():
                        raise _SiblingFailed
            self._write_queued(block=True)
            t0 = time.perf_counter()
            self.out.flush()
            if self.failed.is_set():
                raise _SiblingFailed
            if writer.is_coordinator:
                self.uncommitted = stream  # committed while finish() pickles .metadata (durability.py)
            else:
                stream.commit()
            self.report.add(self.sizes[0], self.sizes[1], encode_s=self.secs[0],
                            io_s=self.secs[1] + time.perf_counter() - t0)
        except BaseException as exc:
            self.failed.set()
            if not isinstance(exc, _SiblingFailed):
                self.error = exc
            if stream is not None:
                try:
                    stream.abort()
                except Exception as abort_exc:  # the first error is the one reported
                    logger.debug("aborting %s: %s", self.name, abort_exc)
            if not self.ended:
                self._write_queued(block=True)  # drop the records queued here (their buckets go back)


class _SiblingFailed(Exception):
    """Another file of the save failed: this one is aborted without an error of its own."""


#: Records up to this size are copied into a write buffer, flushed with one system call per
#: ``WRITE_BATCH_BYTES``: a write per small item cost more than encoding it. Copied, not held:
#: GPU records' chunks view pinned memory that is reused once the next record is asked for.
SMALL_RECORD_BYTES = 256 << 10
WRITE_BATCH_BYTES = 4 << 20
_ZERO = np.zeros(1, dtype=np.int64)
#: Several local files written at once: large records go out in calls of at most this many
#: bytes, under local storage's threshold for slicing one call over its I/O threads (writes to
#: one file serialize on its inode; the files' own threads are the parallelism).
SMALL_WRITE_RUN_BYTES = 4 << 20


class _RecordWriter:
    """Appends records to a data file; small ones go out in batches. Tracks offsets itself.

    ``max_run``: large records are written in calls of at most about that many bytes; with it
    (one of several files), large borrowed records (a GPU bucket's) wait for :meth:`flush` too
    and go out with one vectored call for all of them."""

    def __init__(self, stream: WriteStream, max_run: int | None = None) -> None:
        self.stream = stream
        self.max_run = max_run
        self.pos = 0
        self.parts: list[bytes | memoryview] = []
        self.pending = 0
        #: large borrowed records waiting for :meth:`flush`, headers included (see :meth:`append`)
        self.spans = ChunkSpans()

    def start(self, file_header: bytes) -> None:
        self.stream.write(file_header)
        self.pos = self.stream.tell()

    def append(self, encoded: EncodedItem, borrowed: bool = False) -> int:
        """Queue or write ``encoded``; returns its offset in the file. ``borrowed``: the
        record's memory stays as it is until the caller's next :meth:`flush` (a GPU bucket's
        share), so a small record is queued as it lies instead of copied."""
        offset, size = self.pos, encoded.nbytes
        if size > SMALL_RECORD_BYTES and borrowed and self.max_run is not None and isinstance(encoded.chunks, ChunkSpans):
            # A GPU bucket's record (a delta's: those come one by one) waits for the flush at
            # the end of the bucket's share: a vectored call per record meant a wait for the
            # GIL after each, behind the encode thread's torch calls (H100, 80 fp32 delta
            # records: 0.24 s of waits in 0.58 s of writing).
            self._flush_parts()
            self.spans.add(memoryview(encoded.header_bytes), _ZERO, np.array([len(encoded.header_bytes)], dtype=np.int64))
            self.spans.extend(encoded.chunks)
            self.pos += size
            return offset
        if size <= SMALL_RECORD_BYTES:
            self._flush_spans()  # records go out in order
            # a batch's record is in memory of its own (kept until written); others are copied
            record = encoded.record
            if record is not None:
                self.parts.append(record)
            elif borrowed:
                self.parts.append(encoded.header_bytes)
                self.parts.extend(encoded.chunks)
            else:
                self.parts.append(b"".join([encoded.header_bytes, *encoded.chunks]))
            self.pending += size
            if self.pending >= WRITE_BATCH_BYTES:
                self.flush()
        else:
            self.flush()
            if isinstance(encoded.chunks, ChunkSpans):
                # Vectored writes straight from the spans (local files): no object per chunk.
                self.stream.write_spans(encoded.header_bytes, encoded.chunks, parallel=self.max_run is None)
            elif self.max_run is None:
                self.stream.writelines([encoded.header_bytes, *encoded.chunks])
            else:
                self._write_runs([encoded.header_bytes, *encoded.chunks])
        self.pos += size
        return offset

    def append_streamed(self, record: StreamedRecord) -> tuple[int, EncodedItem]:
        """Write ``record`` as its groups come: room for its header first, each group's chunks
        as soon as they are compressed (the groups after it compress meanwhile), then the header
        into the room. Returns its offset and the whole record."""
        self.flush()
        offset = self.stream.skip(record.head_nbytes)
        assert offset == self.pos, "the record writer and its stream disagree on the offset"
        for chunks in record.groups():
            if self.max_run is None:
                self.stream.writelines(chunks)
            else:
                self._write_runs(chunks)
        encoded = record.finish()
        self.stream.write_at(offset, encoded.header_bytes)
        self.pos += encoded.nbytes
        return offset, encoded

    def append_batch(self, batch: RecordBatch) -> np.ndarray:
        """Write ``batch``'s records; returns their offsets in the file. Small records go out
        in one gather; with no ``max_run`` (one file) a large record is written alone, so that
        local storage may split it over its I/O threads."""
        self.flush()
        sizes = batch.record_nbytes
        offsets = self.pos + np.cumsum(sizes) - sizes
        if not len(sizes):
            return offsets
        large = sizes > SMALL_RECORD_BYTES if self.max_run is None else np.zeros(len(sizes), dtype=bool)
        # consecutive records written together: runs of small ones, each large one alone
        cuts = np.flatnonzero(large[1:] | large[:-1]) + 1
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(sizes)]):
            part = batch.part(lo, hi)
            if large[lo]:
                (_, encoded), = part.items()
                assert isinstance(encoded.chunks, ChunkSpans)
                self.stream.write_spans(encoded.header_bytes, encoded.chunks, parallel=True)
            else:
                self.stream.write_gather(part.gather())
        self.pos += int(sizes.sum())
        return offsets

    def _write_runs(self, parts: list[Any]) -> None:
        assert self.max_run is not None
        run: list[Any] = []
        run_bytes = 0
        for whole in parts:
            view = memoryview(whole).cast("B")
            # a part larger than a run (a batch record's chunks are one view) is cut into runs
            for at in range(0, max(view.nbytes, 1), self.max_run):
                part = view[at : at + self.max_run]
                n = part.nbytes
                if run and run_bytes + n > self.max_run:
                    self.stream.writelines(run)
                    run, run_bytes = [], 0
                run.append(part)
                run_bytes += n
        if run:
            self.stream.writelines(run)

    def flush(self) -> None:
        self._flush_parts()
        self._flush_spans()

    def _flush_parts(self) -> None:
        if self.parts:
            self.stream.writelines(self.parts)
            self.parts, self.pending = [], 0

    def _flush_spans(self) -> None:
        if len(self.spans):
            self.stream.write_spans(b"", self.spans, parallel=False)
            self.spans = ChunkSpans()

    def discard(self) -> None:
        """Drop what is queued, unwritten (the file is failing)."""
        self.parts, self.pending = [], 0
        self.spans = ChunkSpans()


@functools.cache
def _descriptor_codec(plane_codecs: tuple[int, ...]) -> str:
    """:func:`~nvdcp.pipeline.encoder.descriptor_codec` of a record with these plane codecs,
    worked out once per layout: the first codec doing work."""
    ids = [c for c in plane_codecs if c != 0]
    return codec_name(ids[0]) if ids else "none"


def _in_plan_order(results: list[WriteResult], items: list[WriteItem]) -> list[WriteResult]:
    """``results`` in the order of their ``items``, whatever thread wrote what. Matched by the
    index object itself (each result carries its item's; an int hash in C, where a
    ``MetadataIndex`` hashes and compares in Python), by value for any other."""
    position = dict(zip(map(id, map(attrgetter("index"), items)), range(len(items))))
    if all(id(r.index) in position for r in results):
        return sorted(results, key=lambda r: position[id(r.index)])
    by_value = {item.index: i for i, item in enumerate(items)}
    return sorted(results, key=lambda r: by_value[r.index])


def _describe_item(item: WriteItem) -> str:
    return f"item {item.index.fqn}"


def _stager_policy(shards: list[StagedShard]) -> str | None:
    """The ``on_identical_save`` set on the stager these shards were staged by (None: unset, or
    not staged here, e.g. unpickled in async_save's checkpoint process)."""
    for shard in shards:
        stager = getattr(shard.lease, "stager", None)
        if stager is not None:
            policy: str | None = getattr(stager, "on_identical_save", None)
            return policy
    return None


def _warn_stock_arguments(
    single_file_per_rank: bool, per_thread_copy_ahead: int, cache_staged_state_dict: bool,
    extensions: Sequence[Any] | None, serialization_format: Any,
) -> None:
    """One warning per process for each stock argument given a value nvdcp does not honor."""
    if not single_file_per_rank:
        warn_once("single_file_per_rank", "NvcompWriter: single_file_per_rank=False (one file per item) is not "
                  "supported; nvdcp writes one data file per rank and thread. The checkpoint loads the same.")
    if per_thread_copy_ahead != STOCK_COPY_AHEAD:
        warn_once("per_thread_copy_ahead", "NvcompWriter: per_thread_copy_ahead is ignored; nvdcp's GPU path "
                  "bounds its own device-to-host copies (GpuConfig).")
    if cache_staged_state_dict:
        warn_once("cache_staged_state_dict", "NvcompWriter: cache_staged_state_dict is ignored; dcp.async_save "
                  "stages through nvdcp's stager, which always keeps and reuses its host buffers across saves "
                  "(nvdcp.release_resources() frees them).")
    if extensions:
        warn_once("_extensions", "NvcompWriter: _extensions (torch stream transforms) are ignored for writing; "
                  "nvdcp compresses every item itself (codec=...).")
    fmt = getattr(serialization_format, "value", serialization_format)
    if fmt not in (None, "torch_save"):
        warn_once("serialization_format", f"NvcompWriter: serialization_format={serialization_format!r} is "
                  "ignored; nvdcp writes its own container format (docs/FORMAT.md).")


__all__ = ["DATA_SUFFIX", "NvcompWriter", "auto_file_count", "split_into_files"]

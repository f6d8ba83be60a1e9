"""Committing a checkpoint: the steps every producer of an nvdcp checkpoint follows.

``NvcompWriter`` (through DCP's ``finish``) and ``nvdcp convert`` both write data files and then
commit them here, so the protocol exists once:

1. :meth:`CheckpointCommit.begin` marks the save in progress (:class:`~nvdcp.dcp.save_guard.SaveGuard`)
   before any data file of it exists;
2. every data file starts with :func:`data_file_header`;
3. :meth:`CheckpointCommit.commit` checks that every data file the new ``.metadata`` names is
   there and whole, then writes ``.metadata`` atomically (temp and rename; one PUT on S3);
4. :meth:`CheckpointCommit.cleanup` deletes data files of earlier saves that no live save needs;
   :meth:`CheckpointCommit.abort` deletes what a failed producer wrote and drops its marker.

Save digests (docs/FORMAT.md, docs/RELIABILITY.md): ``NvcompWriter.write_data`` returns an
:class:`ItemRecord` per item (torch's ``_StorageInfo`` and the item's digest);
:func:`split_results` separates them again on the coordinator, :meth:`CheckpointCommit.commit`
records the packed digests in ``.metadata``, and :func:`check_identical_save` compares them with
the last save this process committed (:data:`HISTORY`) to catch stale weights saved again.
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import logging
import pickle
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata

from nvdcp.dcp.collector import gc_paused
from nvdcp.dcp.metadata_io import METADATA_NAME
from nvdcp.dcp.save_guard import DATA_FILE, SaveGuard
from nvdcp.errors import NvdcpError, StaleSaveError
from nvdcp.format.delta import DELTA_ATTR
from nvdcp.format.digest import DIGEST_ATTR, digest_record, pack_digests, unpack_digests
from nvdcp.format.file_info import file_info
from nvdcp.format.header import pack_file_header
from nvdcp.storage import Storage

logger = logging.getLogger(__name__)


def data_file_header(rank: int, save_id: str, **extra: Any) -> bytes:
    """The header every nvdcp data file starts with (``extra`` goes into its info block)."""
    return pack_file_header(file_info(rank, save_id, **extra))


class CheckpointCommit:
    """One save's commit on ``storage`` (the coordinator's side)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.guard = SaveGuard(storage)
        self.blob: bytes | None = None

    def begin(self, token: str) -> None:
        """Mark the save ``token`` in progress; call before any of its data files is created."""
        self.guard.mark(token)

    def commit(
        self, metadata: Metadata, storage_data: dict[MetadataIndex, Any], checkpoint_id: str, save_id: str,
        *, stock_pickle: bool = False, digests: bytes | None = None, delta: dict[str, Any] | None = None,
        before_publish: Callable[[], None] | None = None,
    ) -> bytes:
        """Record ``storage_data`` in ``metadata``, check the data files, write ``.metadata``.

        ``stock_pickle`` pickles as torch's ``FileSystemWriter.finish`` does (default protocol),
        for checkpoints meant for stock readers. ``digests``: the items' digests packed in
        ``storage_data``'s order (:func:`split_results`), recorded as ``metadata.nvdcp_digests``;
        without them any digest record ``metadata`` carries (a copy of another checkpoint's)
        is dropped, since it would not describe these records. ``delta``: the base record of a
        delta checkpoint (:class:`~nvdcp.format.delta.BaseRef`), recorded as
        ``metadata.nvdcp_delta``; without it any such record is dropped likewise.
        ``before_publish`` runs once ``.metadata`` is pickled, before the data files are checked
        and it is written: it waits for data files still being committed
        (:mod:`nvdcp.dcp.durability`). Returns the committed bytes.

        Raises:
            MissingDataFileError, TruncatedCheckpointError: a data file is missing or short;
                nothing is committed.
        """
        metadata.storage_data = storage_data
        metadata.storage_meta = StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id)
        if digests and len(digests) == 4 * len(storage_data):  # a save without items has nothing to digest
            setattr(metadata, DIGEST_ATTR, digest_record(digests))
        else:
            vars(metadata).pop(DIGEST_ATTR, None)
        if delta is not None:
            setattr(metadata, DELTA_ATTR, delta)
        else:
            vars(metadata).pop(DELTA_ATTR, None)
        share_equal_values(metadata)
        blob = dump_metadata(metadata, pickle.DEFAULT_PROTOCOL if stock_pickle else pickle.HIGHEST_PROTOCOL)
        if before_publish is not None:
            before_publish()
        self.guard.check_data_files(storage_data)
        self.storage.write_atomic(METADATA_NAME, blob)
        self.blob = blob
        return blob

    def cleanup(self, keep: set[str]) -> bool:
        """After :meth:`commit`: delete other saves' data files that no live save needs, drop
        the marker. Returns whether a later save committed over this one (then only this save's
        own files were touched), and True as well when cleanup failed, so callers delete nothing
        more.

        The checkpoint is committed before this runs: a storage failure here (a listing or the
        read-back of ``.metadata`` failing, e.g. bytes damaged in flight on every retry) is
        logged, not raised, since failing the save would misreport a complete checkpoint. The
        leftover files go with the next save's cleanup or ``nvdcp.manage``.
        """
        try:
            return self.guard.cleanup(keep, self.blob)
        except NvdcpError as exc:
            logger.warning(
                "%s: checkpoint committed, but removing earlier saves' files failed (%s); "
                "the next save or nvdcp.manage removes them", self.storage.url, exc,
            )
            return True

    def abandon(self) -> None:
        """Forget a save that never reached its commit (its marker is left for cleanup)."""
        self.guard.abandon()

    def abort(self, created: list[str]) -> None:
        """Delete the data files a failed producer created and drop its marker."""
        self.storage.delete(created)
        self.guard.unmark()

    def refuse(self, storage_data: dict[MetadataIndex, Any]) -> None:
        """Give up a save whose data files are all written but which must not be committed:
        delete its files (those ``storage_data`` names and any other of its token, e.g. a rank's
        file without items) and drop its marker. The checkpoint committed before stays as it is."""
        names = {info.relative_path for info in storage_data.values()}
        token = self.guard.token
        if token is not None:
            names.update(n for n in self.storage.list() if (m := DATA_FILE.match(n)) and m.group(1) == token)
        self.abort(sorted(names))


# -- pickling .metadata ------------------------------------------------------------------------
def share_equal_values(metadata: Metadata) -> None:
    """Make equal immutable values of ``metadata`` one object each, so its pickle holds each once.

    DCP builds a ``torch.Size`` per chunk offset, chunk size and index offset, and a file name
    and descriptor tuple per record. At 20,000 items (CPU machine) the pickle went from 4.34 to
    3.55 MB, :func:`~nvdcp.dcp.metadata_io.load_metadata` (unpickling, checks, one young
    collection) from 1.03 to 0.79 s (medians of 8, alternating), and the objects the collector
    tracks from 260,000 to about 200,000; the coordinator's pickling took 0.13 s here plus 0.42 s
    for :func:`dump_metadata`, against 0.90 s unshared (medians of 5). Only immutable values are shared (sizes, tuples, strings: what the loaded
    ``Metadata`` holds compares and hashes the same); ``TensorProperties`` are not, since a
    planner may change one item's in place. Index keys get their shared offset as
    ``MetadataIndex.__init__`` sets it (``object.__setattr__``): equal, so hashes do not move.
    """
    sizes: dict[torch.Size, torch.Size] = {}
    size_type, shared = torch.Size, sizes.setdefault  # inlined below: a call per value was half the time
    for md in metadata.state_dict_metadata.values():
        if isinstance(md, TensorStorageMetadata):
            if type(size := md.size) is size_type:
                md.size = shared(size, size)
            for chunk in md.chunks:
                if type(offsets := chunk.offsets) is size_type:
                    chunk.offsets = shared(offsets, offsets)
                if type(lengths := chunk.sizes) is size_type:
                    chunk.sizes = shared(lengths, lengths)
    names: dict[str, str] = {}
    descriptors: dict[tuple[str, ...], tuple[str, ...]] = {}
    for index, info in metadata.storage_data.items():
        if type(offset := index.offset) is size_type:
            object.__setattr__(index, "offset", shared(offset, offset))
        if type(info) is _StorageInfo:
            if type(info.relative_path) is str:
                info.relative_path = names.setdefault(info.relative_path, info.relative_path)
            if type(info.transform_descriptors) is tuple:
                info.transform_descriptors = descriptors.setdefault(info.transform_descriptors, info.transform_descriptors)


def dump_metadata(metadata: Metadata, protocol: int) -> bytes:
    """``pickle.dumps(metadata, protocol)``, byte for byte, with less Python work per record.

    torch's ``_StorageInfo.__getstate__`` (a Python call and a dict comprehension per record,
    one record per item) is a tenth of pickling a ``.metadata``. This pickler's dispatch table
    gives the pickler the record's own ``__dict__`` instead, when no field is None: the same
    dict that ``__getstate__`` builds, so the bytes are the same (tests/dcp/test_commit_check.py).

    The collector is paused meanwhile: the pickler's memo and the reduce tuples, a few per item,
    start collections that walk the whole heap of a training process. In a save of 20,000 small
    tensors (CPU machine, alternating, 3 runs each) the pickle took 0.35-0.38 s so, against
    0.49-0.88 s with the collector running.
    """
    with gc_paused():
        if protocol < 2:  # NEWOBJ (what __reduce_ex__ gives) starts at protocol 2
            return pickle.dumps(metadata, protocol)
        out = io.BytesIO()
        pickler = pickle.Pickler(out, protocol)
        # Without its own table the pickler looks in copyreg's; with one, only there: copy it.
        pickler.dispatch_table = {**copyreg.dispatch_table, _StorageInfo: _reduce_storage_info}
        pickler.dump(metadata)
        return out.getvalue()


def _reduce_storage_info(info: _StorageInfo) -> Any:
    """What ``info.__reduce_ex__(2+)`` returns, without copying the state dict when no field is
    None (``__getstate__`` leaves those out)."""
    state = info.__dict__
    if None in state.values():
        return info.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # the same for every protocol >= 2
    return copyreg.__newobj__, (_StorageInfo,), state  # type: ignore[attr-defined]


# -- item records with digests -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class ItemRecord:
    """What ``NvcompWriter.write_data`` returns as a ``WriteResult``'s ``storage_data``: torch's
    ``_StorageInfo`` (what ``.metadata`` records) and the item's digest (its header's CRC32C,
    :mod:`nvdcp.format.digest`). DCP gathers it to the coordinator without looking inside;
    ``finish`` splits it again (:func:`split_results`), so ``.metadata`` holds torch's records only."""

    info: _StorageInfo
    digest: int
    #: a delta item equal to its base item: the base's digest, which the stale-save check
    #: compares with the previous save's (the record's own digest names a v2 record)
    same_as: int | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # compact: no per-item field names when gathered
        if self.same_as is None:
            return (ItemRecord, (self.info, self.digest))
        return (ItemRecord, (self.info, self.digest, self.same_as))


def identity_digests(results: list[list[Any]], digests: bytes) -> bytes:
    """``digests`` (from :func:`split_results`) with each delta item equal to its base item
    given its base's digest: what the stale-save check compares with the previous save."""
    same = [getattr(wr.storage_data, "same_as", None) for rank in results for wr in rank]
    if all(s is None for s in same) or len(same) * 4 != len(digests):
        return digests
    values = [s if s is not None else d for s, d in zip(same, unpack_digests(digests))]
    return pack_digests(values)


def split_results(results: list[list[Any]]) -> tuple[dict[MetadataIndex, Any], bytes | None]:
    """``storage_data`` for ``.metadata`` from every rank's ``WriteResult`` lists, and the items'
    digests packed in its order (None when some result carries no digest: an older writer, or
    digests switched off). Two comprehensions, as the dict alone was built before digests: the
    coordinator runs this once per item (benchmarks/digest_cost.py)."""
    try:
        storage_md = {wr.index: wr.storage_data.info for rank in results for wr in rank}
        listed = [wr.storage_data.digest for rank in results for wr in rank]
    except AttributeError:  # torch's records without digests, from some rank or all
        return {
            wr.index: wr.storage_data.info if type(wr.storage_data) is ItemRecord else wr.storage_data
            for rank in results for wr in rank
        }, None
    digests: Iterable[int] = listed
    if len(storage_md) != len(listed):  # a repeated index: the digest of the record kept
        digests = dict(zip((wr.index for rank in results for wr in rank), listed)).values()
    return storage_md, pack_digests(digests)


# -- identical saves ---------------------------------------------------------------------------
ON_IDENTICAL_SAVE = ("warn", "error", "ignore")


def identical_save_policy(value: str | None, *, allow_none: bool = False) -> str | None:
    """Validate an ``on_identical_save`` setting."""
    if value is None and allow_none:
        return None
    if value not in ON_IDENTICAL_SAVE:
        raise ValueError(f"on_identical_save must be one of {ON_IDENTICAL_SAVE}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class SavedDigests:
    """A save this process committed: where, which, when, and its items' digests (packed)."""

    location: str
    save_id: str
    when: float
    digests: bytes


def same_items(a: bytes, b: bytes) -> bool:
    """Whether two saves' digests are the same items: equal in order, or (a save staged another
    way orders its items differently) the same multiset. Unequal sums answer most saves in one
    pass; only equal sums pay for a sort."""
    if len(a) != len(b):
        return False
    if a == b:
        return True
    x, y = np.frombuffer(a, dtype="<u4"), np.frombuffer(b, dtype="<u4")
    if int(x.sum(dtype=np.uint64)) != int(y.sum(dtype=np.uint64)):
        return False
    return bool(np.array_equal(np.sort(x), np.sort(y)))


class SaveHistory:
    """The digests of the last save this process committed, per number of items.

    Why here, in the process, and not on a writer or a stager: successive saves of one job meet
    in the coordinator's process whatever objects they go through: a fresh ``NvcompWriter`` per
    save (``dcp.save(..., checkpoint_id=f"step{n}")``, torchtitan), ``dcp.async_save`` with an
    ``async_stager`` the writer never sees, or its PROCESS mode, where writer and staged data are
    pickled into the checkpoint process for every save (only that process lives on). Keyed by
    item count, so a job saving two different state dicts (a full checkpoint and weights only)
    compares each with its own previous save; at most ``keep`` counts are remembered (4 bytes
    per item each).
    """

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._by_count: OrderedDict[int, SavedDigests] = OrderedDict()

    def previous(self, count: int) -> SavedDigests | None:
        with self._lock:
            return self._by_count.get(count)

    def remember(self, location: str, save_id: str, digests: bytes) -> None:
        count = len(digests) // 4
        with self._lock:
            self._by_count.pop(count, None)
            self._by_count[count] = SavedDigests(location, save_id, time.time(), digests)
            while len(self._by_count) > self.keep:
                self._by_count.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._by_count.clear()


#: This process's record of its committed saves (see :class:`SaveHistory`).
HISTORY = SaveHistory()


def forget_previous_saves() -> None:
    """Forget the saves this process committed: the next save is compared with nothing."""
    HISTORY.clear()


def check_identical_save(location: str, digests: bytes, policy: str) -> SavedDigests | None:
    """Compare a save about to be committed at ``location`` with the last one this process
    committed with as many items; returns that save when every item is byte-identical to it.

    ``policy`` ``"warn"`` logs a warning, ``"error"`` raises :class:`~nvdcp.StaleSaveError`,
    ``"ignore"`` compares nothing. A save without items is never stale.
    """
    count = len(digests) // 4
    if policy == "ignore" or count == 0:
        return None
    previous = HISTORY.previous(count)
    if previous is None or not same_items(digests, previous.digests):
        return None
    where = "the same location" if previous.location == location else previous.location
    message = (
        f"save to {location}: all {count} items are byte-identical to the previous save of this process "
        f"({where}, {time.time() - previous.when:.0f}s ago): the model was saved again without changing "
        "(a failed optimizer step, weights not updated, a stale staged copy?)"
    )
    if policy == "error":
        raise StaleSaveError(f"{message}; on_identical_save='error': .metadata not written")
    logger.warning("nvdcp: %s; set on_identical_save='ignore' if this is expected", message)
    return previous


__all__ = [
    "HISTORY", "ON_IDENTICAL_SAVE", "CheckpointCommit", "ItemRecord", "SaveHistory", "SavedDigests",
    "check_identical_save", "data_file_header", "forget_previous_saves", "identical_save_policy", "same_items",
    "split_results",
]

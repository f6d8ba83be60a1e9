"""What a checkpoint holds, read from ``.metadata`` and item headers only (no payload is fetched).

Works on nvdcp checkpoints and on stock DCP ones (``FileSystemWriter``), whose items carry no
header: their codec is ``torch.save`` (or torch's own stream extensions, named by descriptor).
A delta checkpoint shows its base (as recorded, and where it is found: one ``.metadata`` read
per candidate location) and, per stored shard, whether it is stored as a delta against the base
or whole.
:func:`diff_checkpoints` compares two checkpoints item by item by their digests (recorded at save
time, or computed from the item headers), again without fetching any payload.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from nvdcp.codecs import codec_id, codec_names
from nvdcp.dcp import descriptor
from nvdcp.dcp.any_metadata import load_any_metadata
from nvdcp.errors import CorruptCheckpointError, NvdcpError
from nvdcp.format.delta import read_delta
from nvdcp.format.digest import RecordedDigests, digest_of_header, read_digests
from nvdcp.format.header import (
    FILE_FIXED_SIZE,
    ITEM_FIXED_SIZE,
    TRANSFORM_BYTEPLANES,
    ItemHeader,
    file_header_size,
    item_header_size,
    parse_file_header,
    parse_item_header_only,
)
from nvdcp.storage import Storage, open_storage

#: First fetch per item: enough for the header of an item up to ~500 MiB (64 KiB chunks, one
#: plane); larger headers cost one more ranged read.
HEADER_PREFIX_BYTES = 64 << 10

STOCK_CODEC = "torch.save"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class Shard:
    """One stored chunk of an item (one ``MetadataIndex``)."""

    offsets: list[int] | None
    sizes: list[int] | None
    file: str
    file_offset: int
    stored_bytes: int
    original_bytes: int
    #: The codec doing the work: nvdcp's from the item header, ``torch.save`` for stock items.
    codec: str
    descriptor: str | None = None
    #: nvdcp items: the transform and each byte plane's codec, from the stored item header.
    transform: str | None = None
    plane_codecs: list[str] | None = None
    chunk_bytes: int | None = None
    error: str | None = None
    #: Stored as the XOR with the same shard of the base checkpoint (a delta record), and the
    #: digest of that base shard's header the record names; False for a shard stored whole.
    delta: bool = False
    base_digest: int | None = None


@dataclass
class Item:
    """One entry of the state dict: a tensor (possibly sharded) or a bytes object."""

    fqn: str
    kind: str
    dtype: str | None
    shape: list[int] | None
    shards: list[Shard] = field(default_factory=list)

    @property
    def stored_bytes(self) -> int:
        return sum(s.stored_bytes for s in self.shards)

    @property
    def original_bytes(self) -> int:
        return sum(s.original_bytes for s in self.shards)

    @property
    def codecs(self) -> list[str]:
        return sorted({s.codec for s in self.shards})

    @property
    def stored_as(self) -> str:
        """``"delta"`` (every shard a delta against the base), ``"full"`` (none), or ``"mixed"``."""
        deltas = sum(s.delta for s in self.shards)
        return "full" if not deltas else "delta" if deltas == len(self.shards) else "mixed"


@dataclass
class DataFile:
    """A data file and what its file header says about the save that wrote it."""

    name: str
    items: int
    #: Container format version and the writer's info (nvdcp, torch, nvcomp versions, rank,
    #: save id, time); empty for stock DCP files, which have no header.
    format_version: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Totals:
    items: int = 0
    shards: int = 0
    original_bytes: int = 0
    stored_bytes: int = 0
    #: Items with a shard stored as a delta, such shards, and their stored bytes.
    delta_items: int = 0
    delta_shards: int = 0
    delta_bytes: int = 0

    @property
    def ratio(self) -> float | None:
        return self.original_bytes / self.stored_bytes if self.stored_bytes else None

    def add(self, item: Item) -> None:
        self.items += 1
        self.shards += len(item.shards)
        self.original_bytes += item.original_bytes
        self.stored_bytes += item.stored_bytes
        deltas = [s for s in item.shards if s.delta]
        self.delta_items += bool(deltas)
        self.delta_shards += len(deltas)
        self.delta_bytes += sum(s.stored_bytes for s in deltas)

    def as_dict(self) -> dict[str, Any]:
        ratio = self.ratio
        return {**asdict(self), "ratio": None if ratio is None else round(ratio, 4)}


@dataclass
class BaseInfo:
    """The base a delta checkpoint was saved against: as ``.metadata`` records it
    (:class:`~nvdcp.format.delta.BaseRef`), and where it was found (None: ``problem`` says why)."""

    location: str
    relative: str | None
    save_id: str
    depth: int
    found: str | None = None
    problem: str | None = None


@dataclass
class Inspection:
    """Everything ``nvdcp inspect`` shows; :meth:`as_dict` is its ``--json`` schema."""

    url: str
    #: ``"nvdcp"``, ``"stock"`` (torch's FileSystemWriter) or ``"mixed"``.
    format: str
    dcp_version: str | None
    metadata_bytes: int
    items: list[Item]
    files: list[DataFile]
    #: The save's per-item digests in ``.metadata`` (docs/FORMAT.md): ``"recorded"``,
    #: ``"absent"``, ``"unsupported"`` (newer record) or ``"damaged"``; and in words.
    digests: str = "absent"
    digest_note: str = ""
    #: A delta checkpoint's base (None: saved whole).
    base: BaseInfo | None = None
    #: ``.metadata``'s delta record is malformed or newer than this nvdcp (the checkpoint cannot load).
    delta_error: str | None = None

    @property
    def errors(self) -> list[str]:
        out = [f".metadata: {self.delta_error}"] if self.delta_error else []
        out += [f"{f.name}: {f.error}" for f in self.files if f.error]
        out += [f"{i.fqn}: {s.error}" for i in self.items for s in i.shards if s.error]
        return out

    def by_dtype(self) -> dict[str, Totals]:
        totals: dict[str, Totals] = {}
        for item in self.items:
            totals.setdefault(item.dtype or "bytes", Totals()).add(item)
        return dict(sorted(totals.items(), key=lambda kv: -kv[1].original_bytes))

    def total(self) -> Totals:
        t = Totals()
        for item in self.items:
            t.add(item)
        return t

    def saved_with(self) -> dict[str, list[Any]]:
        """Distinct values of each file-header field across the data files (``torch``, ``nvcomp``...)."""
        keys = ("nvdcp", "torch", "nvcomp")
        seen: dict[str, list[Any]] = {k: [] for k in keys}
        seen["format_version"] = []
        for f in self.files:
            if f.format_version is not None and f.format_version not in seen["format_version"]:
                seen["format_version"].append(f.format_version)
            for k in keys:
                if k in f.info and f.info[k] not in seen[k]:
                    seen[k].append(f.info[k])
        return seen

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "format": self.format,
            "dcp_version": self.dcp_version,
            "metadata_bytes": self.metadata_bytes,
            "saved_with": self.saved_with(),
            "totals": self.total().as_dict(),
            "by_dtype": {k: v.as_dict() for k, v in self.by_dtype().items()},
            "items": [
                {
                    "fqn": i.fqn, "kind": i.kind, "dtype": i.dtype, "shape": i.shape,
                    "stored_bytes": i.stored_bytes, "original_bytes": i.original_bytes,
                    "ratio": round(i.original_bytes / i.stored_bytes, 4) if i.stored_bytes else None,
                    "codecs": i.codecs, "stored_as": i.stored_as, "shards": [asdict(s) for s in i.shards],
                }
                for i in self.items
            ],
            "files": [asdict(f) for f in self.files],
            "digests": {"status": self.digests, "note": self.digest_note},
            "base": None if self.base is None else asdict(self.base),
            "errors": self.errors,
        }


def _chunk_bytes(md: TensorStorageMetadata, index: MetadataIndex) -> tuple[list[int] | None, list[int] | None, int]:
    for chunk in md.chunks:
        if list(chunk.offsets) == list(index.offset or []):
            numel = 1
            for s in chunk.sizes:
                numel *= s
            return list(chunk.offsets), list(chunk.sizes), numel * element_size(md.properties.dtype)
    return list(index.offset or []), None, 0


def _read_item_headers(storage: Storage, name: str, records: list[tuple[int, int]]) -> list[ItemHeader | str]:
    """Headers of the items at ``records`` (offset, length) of one file, or an error string each."""
    where = storage.describe(name)
    try:
        prefixes = storage.read_ranges(name, [(off, min(length, HEADER_PREFIX_BYTES)) for off, length in records])
    except (NvdcpError, OSError) as exc:
        return [str(exc)] * len(records)
    out: list[ItemHeader | str] = []
    for (off, length), prefix in zip(records, prefixes):
        here = f"{where} @ {off}"
        try:
            need = item_header_size(memoryview(prefix)[:ITEM_FIXED_SIZE], here)
            if need > length:
                raise CorruptCheckpointError(f"{here}: header of {need} bytes is longer than the item ({length})")
            if need > len(prefix):
                prefix = storage.read_range(name, off, need)
            header = parse_item_header_only(memoryview(prefix), here)
            if header.header_bytes + header.stored_nbytes != length:
                raise CorruptCheckpointError(
                    f"{here}: header and chunks hold {header.header_bytes + header.stored_nbytes} bytes, "
                    f".metadata records {length}"
                )
            out.append(header)
        except (NvdcpError, OSError) as exc:
            out.append(str(exc))
    return out


def _read_file_header(storage: Storage, name: str) -> tuple[int | None, dict[str, Any], str | None]:
    where = storage.describe(name)
    try:
        fixed = storage.read_range(name, 0, FILE_FIXED_SIZE)
        size = file_header_size(memoryview(fixed), where)
        info = parse_file_header(memoryview(storage.read_range(name, 0, size)), where)
        version = int.from_bytes(bytes(fixed[8:10]), "little")
        return version, info, None
    except (NvdcpError, OSError) as exc:
        return None, {}, str(exc)


def _plane_summary(header: ItemHeader) -> tuple[str, str, list[str]]:
    known = {codec_id(n): n for n in codec_names()}
    names = [known.get(c, f"id{c}") for c in header.plane_codecs]
    main = next((n for n in names if n != "none"), "none")
    transform = "byteplanes" if header.transform == TRANSFORM_BYTEPLANES else "none"
    return main, transform, names


def inspect_checkpoint(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    threads: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> Inspection:
    """Describe the checkpoint at ``path`` from its ``.metadata`` and the headers of its items.

    Reads ``.metadata``, each data file's header and each item's header (a bounded prefix of the
    item), never a payload. Unreadable headers are reported per item in ``Shard.error`` rather
    than raised; ``nvdcp verify`` checks the payloads.

    Raises:
        IncompleteCheckpointError: no ``.metadata`` at ``path``.
        CorruptCheckpointError: ``.metadata`` is unreadable.
    """
    storage = open_storage(path, **(storage_options or {}))
    metadata: Metadata = load_any_metadata(storage)
    metadata_bytes = storage.size(".metadata")
    records: dict[MetadataIndex, Any] = metadata.storage_data or {}
    if not isinstance(records, dict):
        raise CorruptCheckpointError(f"{storage.url}: .metadata has no storage records")

    # Which records are ours: nvdcp descriptors get their headers read; others are stock items.
    nvdcp_by_file: dict[str, list[MetadataIndex]] = {}
    kinds: set[str] = set()
    for index, info in records.items():
        descs = getattr(info, "transform_descriptors", None) or ()
        if any(isinstance(d, str) and d.startswith(descriptor.PREFIX) for d in descs):
            nvdcp_by_file.setdefault(info.relative_path, []).append(index)
            kinds.add("nvdcp")
        else:
            kinds.add("stock")

    headers: dict[MetadataIndex, ItemHeader | str] = {}
    file_names = sorted({info.relative_path for info in records.values() if isinstance(info, _StorageInfo)})
    file_meta: dict[str, tuple[int | None, dict[str, Any], str | None]] = {}

    def one_file(name: str) -> None:
        indexes = sorted(nvdcp_by_file.get(name, []), key=lambda ix: records[ix].offset)
        if indexes:
            file_meta[name] = _read_file_header(storage, name)
            found = _read_item_headers(storage, name, [(records[ix].offset, records[ix].length) for ix in indexes])
            headers.update(zip(indexes, found))
        else:
            file_meta[name] = (None, {}, None)

    with ThreadPoolExecutor(max(1, threads)) as pool:
        for done, _ in enumerate(pool.map(one_file, file_names), 1):
            if progress:
                progress(done, len(file_names))

    items: list[Item] = []
    by_fqn: dict[str, list[MetadataIndex]] = {}
    for index in records:
        by_fqn.setdefault(index.fqn, []).append(index)
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            item = Item(fqn, "tensor", dtype_name(md.properties.dtype), list(md.size))
        else:
            item = Item(fqn, "bytes", None, None)
        for index in sorted(by_fqn.get(fqn, []), key=lambda ix: list(ix.offset or [])):
            item.shards.append(_shard(storage, index, records[index], md, headers.get(index)))
        items.append(item)

    files = [
        DataFile(name, sum(1 for i in records.values() if i.relative_path == name), *file_meta.get(name, (None, {}, None)))
        for name in file_names
    ]
    fmt = "mixed" if len(kinds) > 1 else (kinds.pop() if kinds else "nvdcp")
    digests = read_digests(metadata)
    base, delta_error = _base_info(os.fspath(path), metadata, storage, storage_options)
    return Inspection(storage.url, fmt, getattr(metadata, "version", None), metadata_bytes, items, files,
                      digests.status, digests.note, base, delta_error)


def _base_info(path: str, metadata: Metadata, storage: Storage,
               storage_options: dict[str, Any] | None) -> tuple[BaseInfo | None, str | None]:
    """The base of a delta checkpoint and where it is found; or the delta record's problem."""
    from nvdcp.manage import find_base

    try:
        ref = read_delta(metadata, storage.url)
    except NvdcpError as exc:
        return None, str(exc)
    if ref is None:
        return None, None
    found, problem = find_base(path.removeprefix("file://"), ref, storage_options)
    return BaseInfo(ref.location, ref.relative, ref.save_id, ref.depth, found, problem), None


def _shard(storage: Storage, index: MetadataIndex, info: Any, md: Any, header: ItemHeader | str | None) -> Shard:
    if isinstance(md, TensorStorageMetadata):
        offsets, sizes, original = _chunk_bytes(md, index)
    else:
        offsets, sizes, original = None, None, info.length
    descs = list(getattr(info, "transform_descriptors", None) or ())
    shard = Shard(
        offsets, sizes, info.relative_path, info.offset, info.length, original,
        codec="+".join(descs) if descs else (STOCK_CODEC if isinstance(md, TensorStorageMetadata) else "raw"),
        descriptor=descs[0] if descs else None, delta=descriptor.is_delta(info),
    )
    if header is None:  # a stock item
        return shard
    if isinstance(header, str):
        shard.codec = "?"
        shard.error = header
        return shard
    shard.codec, shard.transform, shard.plane_codecs = _plane_summary(header)
    shard.chunk_bytes = header.chunk_bytes
    shard.base_digest = header.base_digest
    if header.is_delta != shard.delta:
        shard.error = (
            f"{storage.describe(info.relative_path)} @ {info.offset}: the record is "
            f"{'a delta' if header.is_delta else 'stored whole'}, its .metadata descriptor says "
            f"{'delta' if shard.delta else 'whole'}"
        )
        return shard
    if isinstance(md, BytesStorageMetadata):
        shard.original_bytes = header.raw_nbytes
    elif header.raw_nbytes != original or (sizes is not None and list(header.shape) != sizes):
        shard.error = (
            f"{storage.describe(info.relative_path)} @ {info.offset}: item header says shape "
            f"{list(header.shape)} ({header.raw_nbytes} bytes), .metadata says {sizes} ({original} bytes)"
        )
    return shard


# -- diff --------------------------------------------------------------------------------------
@dataclass
class DiffResult:
    """What changed from checkpoint ``a`` to checkpoint ``b``, per state dict entry (FQN).

    ``added``: only in ``b``; ``removed``: only in ``a``; ``changed``: in both, and some stored
    shard differs (another digest, dtype or shape); ``unchanged``: every shard has the same
    digest; ``unknown``: in both but not comparable without decoding (a stock item, which has no
    header; an unreadable header; shards cut differently; another codec). ``reasons`` says why,
    for ``changed`` and ``unknown`` entries. Digests compare stored records: the same values
    stored with another codec, chunk size or encoder read as changed, never the other way round.
    """

    a: str
    b: str
    #: How each side's digests were had: ``"recorded"`` (``.metadata``) or ``"headers"`` (read
    #: from the item headers: a checkpoint saved without digests, or ``use_recorded=False``).
    sources: dict[str, str]
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    #: Item headers that could not be read (their entries are ``unknown``).
    errors: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not (self.added or self.removed or self.changed or self.unknown)

    def as_dict(self) -> dict[str, Any]:
        return {
            "a": self.a, "b": self.b, "sources": self.sources, "identical": self.identical,
            "counts": {k: len(getattr(self, k)) for k in ("added", "removed", "changed", "unchanged", "unknown")},
            "added": self.added, "removed": self.removed, "changed": self.changed,
            "unchanged": self.unchanged, "unknown": self.unknown, "reasons": self.reasons, "errors": self.errors,
        }


@dataclass
class _Side:
    url: str
    metadata: Metadata
    #: digest per MetadataIndex; None: no digest to be had (stock item, unreadable header)
    digests: dict[MetadataIndex, int | None]
    source: str
    why_none: dict[MetadataIndex, str]


def _is_nvdcp(info: Any) -> bool:
    descs = getattr(info, "transform_descriptors", None) or ()
    return any(isinstance(d, str) and d.startswith(descriptor.PREFIX) for d in descs)


def _side(path: str | os.PathLike[str], storage_options: dict[str, Any] | None, threads: int, use_recorded: bool) -> _Side:
    storage = open_storage(path, **(storage_options or {}))
    metadata: Metadata = load_any_metadata(storage)
    records: dict[MetadataIndex, Any] = metadata.storage_data or {}
    if not isinstance(records, dict):
        raise CorruptCheckpointError(f"{storage.url}: .metadata has no storage records")
    recorded: RecordedDigests = read_digests(metadata)
    if recorded.by_index is not None and use_recorded:
        return _Side(storage.url, metadata, dict(recorded.by_index), "recorded", {})
    # No usable record: the digests are the item headers' CRCs, read as `inspect` reads them.
    digests: dict[MetadataIndex, int | None] = {}
    why: dict[MetadataIndex, str] = {}
    by_file: dict[str, list[MetadataIndex]] = {}
    for index, info in records.items():
        if _is_nvdcp(info):
            by_file.setdefault(info.relative_path, []).append(index)
        else:
            digests[index] = None
            why[index] = "a stock DCP item (no header to compare)"

    def one_file(name: str) -> None:
        indexes = sorted(by_file[name], key=lambda ix: records[ix].offset)
        found = _read_item_headers(storage, name, [(records[ix].offset, records[ix].length) for ix in indexes])
        for ix, header in zip(indexes, found):
            if isinstance(header, str):
                digests[ix] = None
                why[ix] = f"unreadable item header: {header}"
            else:
                digests[ix] = digest_of_header(header)

    with ThreadPoolExecutor(max(1, threads)) as pool:
        list(pool.map(one_file, sorted(by_file)))
    return _Side(storage.url, metadata, digests, "headers", why)


def _entry_type(md: Any) -> str:
    if isinstance(md, TensorStorageMetadata):
        return f"{dtype_name(md.properties.dtype)} {list(md.size)}"
    return "bytes"


def diff_checkpoints(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    b_storage_options: dict[str, Any] | None = None,
    threads: int = 8,
    use_recorded: bool = True,
) -> DiffResult:
    """Compare checkpoint ``b`` with checkpoint ``a`` entry by entry, without decoding anything.

    Each stored shard is compared by its digest (:mod:`nvdcp.format.digest`): the one recorded in
    ``.metadata`` at save time, or, for a checkpoint saved without digests, the CRC32C of its item
    header (one bounded read per item, no payload). ``use_recorded=False`` reads the headers
    even where digests were recorded: recorded digests say what was saved, headers what is
    stored now (``verify_checkpoint`` checks that the two agree). ``storage_options`` opens
    ``a`` (and ``b`` unless ``b_storage_options`` is given).

    Raises:
        IncompleteCheckpointError: no ``.metadata`` at ``a`` or ``b``.
        CorruptCheckpointError: a ``.metadata`` is unreadable.
    """
    side_a = _side(a, storage_options, threads, use_recorded)
    side_b = _side(b, storage_options if b_storage_options is None else b_storage_options, threads, use_recorded)
    result = DiffResult(side_a.url, side_b.url, {"a": side_a.source, "b": side_b.source})
    for side in (side_a, side_b):
        result.errors += sorted({why for why in side.why_none.values() if why.startswith("unreadable")})
    sdm_a, sdm_b = side_a.metadata.state_dict_metadata, side_b.metadata.state_dict_metadata
    result.removed = sorted(set(sdm_a) - set(sdm_b))
    result.added = sorted(set(sdm_b) - set(sdm_a))
    shards_a: dict[str, dict[Any, MetadataIndex]] = {}
    shards_b: dict[str, dict[Any, MetadataIndex]] = {}
    for side, shards in ((side_a, shards_a), (side_b, shards_b)):
        for index in side.metadata.storage_data:
            shards.setdefault(index.fqn, {})[None if index.offset is None else tuple(index.offset)] = index
    records_a, records_b = side_a.metadata.storage_data, side_b.metadata.storage_data
    for fqn in sorted(set(sdm_a) & set(sdm_b)):
        kind_a, kind_b = _entry_type(sdm_a[fqn]), _entry_type(sdm_b[fqn])
        here_a, here_b = shards_a.get(fqn, {}), shards_b.get(fqn, {})
        if kind_a != kind_b:
            result.changed.append(fqn)
            result.reasons[fqn] = f"{kind_a} -> {kind_b}"
            continue
        if here_a.keys() != here_b.keys():
            result.unknown.append(fqn)
            result.reasons[fqn] = (
                f"stored in other shards ({len(here_a)} -> {len(here_b)}): digests compare shards; load both to compare"
            )
            continue
        differ, why_unknown = 0, ""
        for key, ix_a in here_a.items():
            ix_b = here_b[key]
            da, db = side_a.digests.get(ix_a), side_b.digests.get(ix_b)
            if da is None or db is None:
                why_unknown = side_a.why_none.get(ix_a) or side_b.why_none.get(ix_b) or "no digest"
                continue
            desc_a = getattr(records_a[ix_a], "transform_descriptors", None)
            desc_b = getattr(records_b[ix_b], "transform_descriptors", None)
            if da != db and tuple(desc_a or ()) != tuple(desc_b or ()):
                why_unknown = (
                    f"stored with another codec ({', '.join(desc_a or ())} -> {', '.join(desc_b or ())}): "
                    "digests compare stored records"
                )
                continue
            differ += da != db
        if differ:
            result.changed.append(fqn)
            result.reasons[fqn] = "data" if len(here_a) == 1 else f"data ({differ} of {len(here_a)} shards)"
        elif why_unknown:
            result.unknown.append(fqn)
            result.reasons[fqn] = why_unknown
        else:
            result.unchanged.append(fqn)
    return result

"""Whole-checkpoint verification: every item's header, every chunk's CRC32C, a full decode, and
each item's header against the digest the save recorded in ``.metadata`` (docs/FORMAT.md).

A delta checkpoint is verified with its whole chain: its own records (a delta item's chunks
decode to the XOR with its base item: checked as stored, never combined), each delta item's
recorded base digest against the base item's header, and then each base in turn, down to the
checkpoint saved whole. A base that is gone or was replaced is damage, not an exception."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from nvdcp.dcp import descriptor
from nvdcp.dcp.reader import NvcompReader, base_problem, describe_index
from nvdcp.dcp.stock_items import is_nvdcp_record
from nvdcp.errors import CodecUnavailableError, DeltaBaseError, IncompleteCheckpointError, NvdcpError
from nvdcp.format.delta import BaseRef, base_candidates, read_delta, same_location
from nvdcp.format.digest import digest_of_header, read_digests
from nvdcp.format.header import FILE_FIXED_SIZE, ItemHeader, file_header_size, parse_file_header
from nvdcp.pipeline.cpu import verify_chunks
from nvdcp.report import Report


@dataclass
class Damage:
    """One item that failed verification."""

    item: str
    file: str
    error: str
    kind: str


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_checkpoint`."""

    url: str
    items: int = 0
    stored_bytes: int = 0
    raw_bytes: int = 0
    damaged: list[Damage] = field(default_factory=list)
    #: Items whose codec cannot run here: their checksums were checked, not their decode.
    checksum_only: list[str] = field(default_factory=list)
    #: The save's per-item digests: ``"checked"`` (every item's header compared with the digest
    #: recorded at save time), ``"absent"`` (none recorded: an older checkpoint),
    #: ``"unsupported"`` (a newer digest record) or ``"damaged"`` (the record itself is bad).
    digests: str = "absent"
    #: What :attr:`digests` means for this checkpoint, in words.
    digest_note: str = ""
    #: A delta checkpoint's base as recorded (:class:`~nvdcp.format.delta.BaseRef`; None: saved
    #: whole) and where it was found (None: gone or replaced, which is listed in ``damaged``).
    base: BaseRef | None = None
    base_found: str | None = None
    #: Items stored as deltas against the base, and their stored bytes.
    delta_items: int = 0
    delta_bytes: int = 0
    #: The reports of the bases, nearest first (empty: saved whole, base missing, or
    #: ``chain=False``); each lists its own damage.
    chain: list[VerifyReport] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Nothing damaged here nor in any base of the chain."""
        return not self.damaged and all(not r.damaged for r in self.chain)

    def as_dict(self) -> dict[str, Any]:
        """The report as plain values (``nvdcp verify --json``), the chain's reports nested."""
        return {
            "url": self.url, "ok": self.ok, "items": self.items, "stored_bytes": self.stored_bytes,
            "raw_bytes": self.raw_bytes, "damaged": [vars(d) for d in self.damaged],
            "checksum_only": self.checksum_only, "digests": self.digests, "digest_note": self.digest_note,
            "base": None if self.base is None else {**self.base.as_record(), "found": self.base_found},
            "delta_items": self.delta_items, "delta_bytes": self.delta_bytes,
            "chain": [{k: v for k, v in r.as_dict().items() if k != "chain"} for r in self.chain],
        }


def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    decode: bool = True,
    threads: int | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    chain: bool = True,
) -> VerifyReport:
    """Check a whole checkpoint without loading it into a model.

    Reads ``.metadata``, then every stored item: header fields and CRC, every chunk's CRC32C,
    and (``decode=True``) a full decode compared with ``.metadata``'s dtype and shape. Items whose
    codec needs a GPU this machine lacks are checked by checksum only and listed in
    ``checksum_only``. When the save recorded digests, each item's header must also match its
    digest (else the item is damaged, kind ``"digest"``: its record was replaced after the save by
    another, self-consistent one); ``digests`` says whether they were checked.
    ``progress(done, total)`` is called after each item (of each checkpoint of a chain).

    A delta checkpoint: each delta item's record is checked as stored (its chunks hold the XOR
    with the base item), and the base item's header must have the digest the delta recorded
    (kind ``"BaseMismatchError"`` otherwise); a base that is gone or was replaced is one damage
    entry (kind ``"MissingBaseError"`` / ``"BaseMismatchError"``, item ``"(base checkpoint)"``).
    With ``chain`` (the default) each base is then verified the same way, down the chain, into
    :attr:`VerifyReport.chain`; :attr:`VerifyReport.ok` covers them all.

    Raises:
        IncompleteCheckpointError: no ``.metadata`` (nothing to verify).
        CorruptCheckpointError: ``.metadata`` itself is unreadable.
    """
    reader = NvcompReader(path, storage_options=storage_options, thread_count=threads)
    report = _verify_one(reader, reader.read_metadata(), decode, progress)
    if chain:
        seen = [reader.path]
        current = report
        while current.base_found is not None:
            if any(same_location(current.base_found, s) for s in seen):
                current.damaged.append(Damage(
                    "(base checkpoint)", ".metadata", f"{current.url}: its chain of bases loops back to "
                    f"{current.base_found}", "BaseMismatchError",
                ))
                break
            seen.append(current.base_found)
            base_reader = NvcompReader(current.base_found, storage_options=storage_options, thread_count=threads)
            current = _verify_one(base_reader, base_reader.read_metadata(), decode, progress)
            report.chain.append(current)
    return report


def _verify_one(
    reader: NvcompReader, metadata: Metadata, decode: bool, progress: Callable[[int, int], None] | None,
) -> VerifyReport:
    """One checkpoint of a chain: its own records, and its delta items against its base's headers."""
    try:
        reader.set_up_storage_reader(metadata, True)
    except DeltaBaseError:
        pass  # the base is looked for below, and reported there; this checkpoint's records still get checked
    report = VerifyReport(reader.storage.url)
    recorded = read_digests(metadata)
    expected = recorded.by_index or {}
    report.digests = "checked" if recorded.recorded else recorded.status
    report.digest_note = recorded.note
    if recorded.status == "damaged":
        report.damaged.append(Damage("(digest record)", ".metadata", recorded.note, "digest"))
    ref = read_delta(metadata, reader.storage.url)
    report.base = ref
    base: tuple[NvcompReader, Metadata] | None = None
    if ref is not None:
        base, problem = _find_base(reader, ref)
        if base is None:
            report.damaged.append(Damage("(base checkpoint)", ".metadata", problem[1], problem[0]))
        else:
            report.base_found = base[0].path
    indexes: list[MetadataIndex] = sorted(
        metadata.storage_data, key=lambda ix: (metadata.storage_data[ix].relative_path, metadata.storage_data[ix].offset)
    )
    totals = Report("verify", reader.storage.url)

    def check(index: MetadataIndex) -> tuple[MetadataIndex, Damage | None, bool]:
        info = metadata.storage_data[index]
        file = getattr(info, "relative_path", "?")
        delta = descriptor.is_delta(info)
        try:
            checksum_only = decode
            header = None
            if decode:
                try:
                    header = _load_delta(reader, index, totals) if delta else reader.load_item(index, totals)[0]
                    checksum_only = False
                except CodecUnavailableError:
                    pass
            if header is None:
                name, offset, length = reader.record_of(index)
                header = verify_chunks(memoryview(reader.storage.read_range(name, offset, length)), reader.where(index))
                if header.is_delta != delta:
                    stored = "a delta" if header.is_delta else "stored whole"
                    return index, Damage(
                        describe_index(index), file, f"{reader.where(index)}: the record is {stored}, its "
                        f".metadata descriptor says {'delta' if delta else 'whole'}", "CorruptCheckpointError",
                    ), False
        except NvdcpError as exc:
            return index, Damage(describe_index(index), file, str(exc), type(exc).__name__), False
        want = expected.get(index)
        if want is not None and (got := digest_of_header(header)) != want:
            return index, Damage(
                describe_index(index), file,
                f"{reader.where(index)}: the item's header (digest {got:08x}) is not the one saved "
                f"(digest {want:08x} in .metadata): the record was replaced after the save",
                "digest",
            ), False
        if header.is_delta and base is not None:
            damage = _check_base_item(reader, index, header, *base)
            if damage is not None:
                return index, damage, False
        return index, None, checksum_only

    with ThreadPoolExecutor(reader.thread_count) as pool:
        for done, (index, damage, checksum_only) in enumerate(pool.map(check, indexes), 1):
            report.items += 1
            report.stored_bytes += metadata.storage_data[index].length
            if descriptor.is_delta(metadata.storage_data[index]):
                report.delta_items += 1
                report.delta_bytes += metadata.storage_data[index].length
            if damage:
                report.damaged.append(damage)
            if checksum_only:
                report.checksum_only.append(describe_index(index))
            if progress:
                progress(done, len(indexes))
    missing = {d.file for d in report.damaged if d.kind == "MissingDataFileError"}
    for name in sorted({metadata.storage_data[ix].relative_path for ix in indexes} - missing):
        file_damage = _check_file_header(reader, name)
        if file_damage:
            report.damaged.append(file_damage)
    report.raw_bytes = totals.raw_bytes
    return report


def _find_base(reader: NvcompReader, ref: BaseRef) -> tuple[tuple[NvcompReader, Metadata] | None, tuple[str, str]]:
    """The base of ``reader``'s checkpoint where a load finds it (a reader and its ``.metadata``,
    not set up), or None and (error kind, message) when it is gone or replaced."""
    found: list[str] = []
    candidates = base_candidates(reader.path, ref)
    for location in candidates:
        base = NvcompReader(location, storage_options=reader.storage_options, thread_count=reader.thread_count)
        try:
            base_md = base.read_metadata()
        except IncompleteCheckpointError:
            continue
        except NvdcpError as exc:
            found.append(f"{location} (unreadable .metadata: {exc})")
            continue
        problem = base_problem(base_md, ref)
        if problem is None:
            return (base, base_md), ("", "")
        found.append(f"{location} ({problem})")
    if found:
        return None, ("BaseMismatchError", (
            f"{reader.storage.url}: is a delta against save {ref.save_id} of {ref.location}, but "
            f"{'; '.join(found)}: that base was replaced; the delta cannot be loaded"
        ))
    return None, ("MissingBaseError", (
        f"{reader.storage.url}: is a delta against {ref.location} (save {ref.save_id}), and no checkpoint is "
        f"there (looked at {', '.join(candidates)}); restore that checkpoint to load this one"
    ))


def _load_delta(reader: NvcompReader, index: MetadataIndex, totals: Report) -> ItemHeader:
    """Check and decode a delta item's record as stored (the XOR bytes, not combined with its base)."""
    return reader.decode_record(index, totals)


def _check_base_item(reader: NvcompReader, index: MetadataIndex, header: ItemHeader, base: NvcompReader,
                     base_md: Metadata) -> Damage | None:
    """Whether the base holds the item a delta record was saved against: the base item's header
    (read alone, no payload) must have the digest and size the delta recorded."""
    file = reader.record_of(index)[0]
    where = reader.where(index)
    base_info = base_md.storage_data.get(index)
    if base_info is None or not is_nvdcp_record(base_info):
        return Damage(describe_index(index), file, f"{where}: a delta item, and its base {base.storage.url} "
                      f"holds no nvdcp item {describe_index(index)}", "BaseMismatchError")
    base_where = f"{base.storage.describe(base_info.relative_path)} @ {base_info.offset} item {describe_index(index)}"
    try:
        base_header = base.read_header(base_info.relative_path, base_info.offset, base_info.length, base_where)
    except NvdcpError as exc:
        return Damage(describe_index(index), file, f"{where}: its base item is unreadable: {exc}", type(exc).__name__)
    got = digest_of_header(base_header)
    if got != header.base_digest or base_header.raw_nbytes != header.raw_nbytes:
        return Damage(
            describe_index(index), file,
            f"{where}: saved against a base item of digest {header.base_digest:#010x}, but {base_where} has "
            f"digest {got:#010x}: not the base of this delta", "BaseMismatchError",
        )
    return None


def _check_file_header(reader: NvcompReader, name: str) -> Damage | None:
    """A data file's own header (magic, version, writer info, CRC): loads never read it."""
    where = reader.storage.describe(name)
    try:
        prefix = memoryview(reader.storage.read_range(name, 0, FILE_FIXED_SIZE))
        size = file_header_size(prefix, where)
        parse_file_header(memoryview(reader.storage.read_range(name, 0, size)), where)
    except NvdcpError as exc:
        return Damage("(data file header)", name, str(exc), type(exc).__name__)
    return None

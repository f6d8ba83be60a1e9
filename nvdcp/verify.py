"""Whole-checkpoint verification: every item's header, every chunk's CRC32C, a full decode, and
each item's header against the digest the save recorded in ``.metadata`` (docs/FORMAT.md)."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex

from nvdcp.dcp.reader import NvcompReader, describe_index
from nvdcp.errors import CodecUnavailableError, NvdcpError
from nvdcp.format.digest import digest_of_header, read_digests
from nvdcp.format.header import FILE_FIXED_SIZE, file_header_size, parse_file_header
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

    @property
    def ok(self) -> bool:
        return not self.damaged


def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    decode: bool = True,
    threads: int | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check a whole checkpoint without loading it into a model.

    Reads ``.metadata``, then every stored item: header fields and CRC, every chunk's CRC32C,
    and (``decode=True``) a full decode compared with ``.metadata``'s dtype and shape. Items whose
    codec needs a GPU this machine lacks are checked by checksum only and listed in
    ``checksum_only``. When the save recorded digests, each item's header must also match its
    digest (else the item is damaged, kind ``"digest"``: its record was replaced after the save by
    another, self-consistent one); ``digests`` says whether they were checked.
    ``progress(done, total)`` is called after each item.

    Raises:
        IncompleteCheckpointError: no ``.metadata`` (nothing to verify).
        CorruptCheckpointError: ``.metadata`` itself is unreadable.
    """
    reader = NvcompReader(path, storage_options=storage_options, thread_count=threads)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    report = VerifyReport(reader.storage.url)
    recorded = read_digests(metadata)
    expected = recorded.by_index or {}
    report.digests = "checked" if recorded.recorded else recorded.status
    report.digest_note = recorded.note
    if recorded.status == "damaged":
        report.damaged.append(Damage("(digest record)", ".metadata", recorded.note, "digest"))
    indexes: list[MetadataIndex] = sorted(
        metadata.storage_data, key=lambda ix: (metadata.storage_data[ix].relative_path, metadata.storage_data[ix].offset)
    )
    totals = Report("verify", reader.storage.url)

    def check(index: MetadataIndex) -> tuple[MetadataIndex, Damage | None, bool]:
        info = metadata.storage_data[index]
        file = getattr(info, "relative_path", "?")
        try:
            checksum_only = decode
            header = None
            if decode:
                try:
                    header, _ = reader.load_item(index, totals)
                    checksum_only = False
                except CodecUnavailableError:
                    pass
            if header is None:
                name, offset, length = reader.record_of(index)
                header = verify_chunks(memoryview(reader.storage.read_range(name, offset, length)), reader.where(index))
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
        return index, None, checksum_only

    with ThreadPoolExecutor(reader.thread_count) as pool:
        for done, (index, damage, checksum_only) in enumerate(pool.map(check, indexes), 1):
            report.items += 1
            report.stored_bytes += metadata.storage_data[index].length
            if damage:
                report.damaged.append(damage)
            if checksum_only:
                report.checksum_only.append(describe_index(index))
            if progress:
                progress(done, len(indexes))
    missing = {d.file for d in report.damaged if d.kind == "MissingDataFileError"}
    for name in sorted({metadata.storage_data[ix].relative_path for ix in indexes} - missing):
        damage = _check_file_header(reader, name)
        if damage:
            report.damaged.append(damage)
    report.raw_bytes = totals.raw_bytes
    return report


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

"""Save digests: one 32-bit digest per stored item, recorded in ``.metadata`` (docs/FORMAT.md).

An item's digest is the CRC32C its header already carries: the CRC of the header's fields
(kind, dtype, shape, raw size, transform, chunk size, plane codecs and every chunk's stored size
and CRC32C). The writer has it the moment the header is packed, so recording it costs no pass
over the data; it does not depend on where the record sits (file, offset), so two saves of the
same tensors with the same settings give equal digests. It compares *stored records*: the same
values stored with another codec, chunk size or encoder (CPU vs GPU GDeflate) give another digest.
Equal digests mean equal stored bytes (up to CRC collisions, 2^-32 per item); unequal digests
mean the data changed or was stored differently.

The save's digests go into ``.metadata`` as one extra attribute of torch's ``Metadata``
(:data:`DIGEST_ATTR`), a dict of plain values (no class to resolve when unpickling)::

    {"version": 1, "algorithm": "crc32c-item-header", "count": N,
     "crc": CRC32C(digests), "digests": N little-endian uint32, in storage_data's order}

Nothing here imports torch: the record is read from any object with ``storage_data``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nvdcp.format.header import ItemHeader, checksum

#: Attribute of ``Metadata`` holding the digest record (stock unpickling just sets it).
DIGEST_ATTR = "nvdcp_digests"
#: Version of the digest record this nvdcp writes and reads.
DIGEST_VERSION = 1
ALGORITHM = "crc32c-item-header"


def digest_of_record_header(header_bytes: bytes | bytearray | memoryview) -> int:
    """The digest of an item from its packed header (the header's own CRC32C, its last 4 bytes)."""
    return int.from_bytes(bytes(header_bytes[-4:]), "little")


def digest_of_header(header: ItemHeader) -> int:
    """The digest of an item header: the CRC32C of its fields, as the writer packed them (the
    stored CRC of a parsed header, which parsing checked; else the header packed again)."""
    if header.stored_crc is not None:
        return header.stored_crc
    return digest_of_record_header(header.pack())


def pack_digests(values: Iterable[int]) -> bytes:
    """Digests as little-endian uint32 (C speed: the coordinator packs one per item)."""
    packed = array("I", values)
    if packed.itemsize != 4:  # pragma: no cover - every platform torch runs on has 4-byte unsigned int
        packed = array("L", packed)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def unpack_digests(blob: bytes) -> array[int]:
    values = array("I")
    values.frombytes(blob)
    if sys.byteorder == "big":  # pragma: no cover
        values.byteswap()
    return values


def digest_record(packed: bytes) -> dict[str, Any]:
    """The value of :data:`DIGEST_ATTR` for digests packed by :func:`pack_digests`."""
    return {
        "version": DIGEST_VERSION, "algorithm": ALGORITHM, "count": len(packed) // 4,
        "crc": checksum(packed), "digests": packed,
    }


@dataclass
class RecordedDigests:
    """What a ``.metadata`` says about its items' digests (:func:`read_digests`)."""

    #: ``"recorded"`` (``by_index`` holds them), ``"absent"`` (written before nvdcp recorded
    #: digests, or by another tool), ``"unsupported"`` (a newer record version: not checked) or
    #: ``"damaged"`` (the record contradicts itself or the storage records).
    status: str
    note: str = ""
    by_index: dict[Any, int] | None = None

    @property
    def recorded(self) -> bool:
        return self.by_index is not None


def read_digests(metadata: Any) -> RecordedDigests:
    """The per-item digests recorded in ``metadata`` (an unpickled ``.metadata``), by ``MetadataIndex``."""
    record = getattr(metadata, "__dict__", {}).get(DIGEST_ATTR)
    if record is None:
        return RecordedDigests("absent", "no save digests recorded (saved before nvdcp recorded them, or by another writer)")
    if not isinstance(record, dict) or type(record.get("version")) is not int:
        return RecordedDigests("damaged", f"the digest record is malformed ({type(record).__name__})")
    version = record["version"]
    if version > DIGEST_VERSION or record.get("algorithm") != ALGORITHM:
        return RecordedDigests(
            "unsupported",
            f"digest record v{version} ({record.get('algorithm')!r}) is newer than this nvdcp reads "
            f"(v{DIGEST_VERSION}); digests not checked",
        )
    blob, count, crc = record.get("digests"), record.get("count"), record.get("crc")
    if not isinstance(blob, bytes) or type(count) is not int or type(crc) is not int or len(blob) != 4 * count:
        return RecordedDigests("damaged", "the digest record is malformed (sizes or fields)")
    if checksum(blob) != crc:
        return RecordedDigests("damaged", "the digest record fails its CRC32C (.metadata damaged)")
    records = getattr(metadata, "storage_data", None)
    if not isinstance(records, dict) or len(records) != count:
        return RecordedDigests(
            "damaged",
            f"the digest record holds {count} digests for {len(records) if isinstance(records, dict) else 0} "
            "storage records (.metadata edited after the save?)",
        )
    return RecordedDigests("recorded", f"{count} digests (v{version}, {ALGORITHM})",
                           dict(zip(records, unpack_digests(blob))))


__all__ = [
    "ALGORITHM", "DIGEST_ATTR", "DIGEST_VERSION", "RecordedDigests", "digest_of_header", "digest_of_record_header",
    "digest_record", "pack_digests", "read_digests", "unpack_digests",
]

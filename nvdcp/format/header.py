"""Binary layout of data files and item records (container format v1 and v2, docs/FORMAT.md).

Version 2 adds one kind of item record, the *delta*: an item stored as the XOR of its bytes with
the same item of a base checkpoint (:attr:`ItemHeader.base_digest` names that base item). Items
stored whole are still written as version 1 records, byte for byte as before.

Everything is little-endian and parsed with :mod:`struct`; nothing here unpickles. Parsing
validates every field against the bytes actually present before anything is allocated, so a
corrupt or hostile header fails fast with :class:`CorruptCheckpointError`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import crc32c
import numpy as np

from nvdcp.errors import CorruptCheckpointError, FormatVersionError, TruncatedCheckpointError

#: The newest item record version this nvdcp reads (and writes, for delta items).
FORMAT_VERSION = 2
#: Items stored whole keep the version 1 record (golden files, digests and old readers agree).
FULL_ITEM_VERSION = 1
#: Delta items (:attr:`ItemHeader.base_digest` set): a v1 reader refuses them by version.
DELTA_ITEM_VERSION = 2
#: Data file headers are unchanged since version 1.
FILE_VERSION = 1
#: v2 item flag: the decoded bytes are the XOR of the item with its base item.
FLAG_XOR_BASE = 1

FILE_MAGIC = b"NVDCPF\x00\x01"
ITEM_MAGIC = b"NVDI"

KIND_TENSOR = 0
KIND_BYTES = 1
TRANSFORM_NONE = 0
TRANSFORM_BYTEPLANES = 1

DEFAULT_CHUNK_BYTES = 1 << 16
MIN_CHUNK_BYTES = 1 << 10
MAX_CHUNK_BYTES = 1 << 16  # the spec's range (docs/FORMAT.md); nvCOMP GDeflate's chunk limit
MAX_NDIM = 64
MAX_PLANES = 16

# magic, version, kind, dtype, transform, n_planes, ndim, reserved, chunk_bytes, raw_nbytes, header_bytes
_ITEM_FIXED = struct.Struct("<4sHBBBBBBIQI")
_FILE_FIXED = struct.Struct("<8sHHI")  # magic, version, reserved, info_len
_CHUNK = struct.Struct("<II")  # stored bytes, crc32c of the stored bytes
_BASE = struct.Struct("<II")  # v2 delta items: digest of the base item's record, delta kind
#: delta kinds of v2 records (:mod:`nvdcp.transform.delta`): 0 XOR, 1 zigzag integer difference
DELTA_KINDS = (0, 1)
_CRC = struct.Struct("<I")


def checksum(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C (Castagnoli); hardware-accelerated by the ``crc32c`` package."""
    return crc32c.crc32c(data, value)


class ChunkTable(Sequence[tuple[int, int]]):
    """``(stored_bytes, crc32c)`` of every chunk of a record: a sequence of pairs held as one
    ``(n, 2)`` uint32 array, the layout of the table in the header (``_CHUNK``, little-endian).

    One array per record instead of a tuple per chunk: a GB of state has ~16,000 chunks, and
    per-chunk tuples cost both the packing and parsing time and the allocations that set off
    the garbage collector during a background save (see :mod:`nvdcp.storage.spans`).
    ``numpy.asarray(table)`` is the array; iterating yields ``(size, crc)`` tuples.
    """

    __slots__ = ("array",)

    def __init__(self, pairs: Iterable[tuple[int, int]] | np.ndarray = ()) -> None:
        if isinstance(pairs, np.ndarray):
            array = pairs
        else:
            pairs = list(pairs)
            array = np.array(pairs, dtype=np.int64) if pairs else np.zeros((0, 2), dtype=np.int64)
        if array.size and (array.min() < 0 or array.max() > 0xFFFFFFFF):
            raise ValueError("chunk sizes and CRCs must fit in 32 bits")
        self.array = np.ascontiguousarray(array, dtype=np.uint32).reshape(-1, 2)

    @classmethod
    def from_columns(cls, sizes: Any, crcs: Any) -> ChunkTable:
        """A table from the chunks' stored sizes and CRC32Cs (arrays or lists of the same
        length, values in 32 bits: what an encoder produced)."""
        if len(sizes) != len(crcs):
            raise ValueError(f"{len(sizes)} chunk sizes for {len(crcs)} CRCs")
        array = np.empty((len(sizes), 2), dtype=np.uint32)
        array[:, 0] = sizes
        array[:, 1] = crcs
        return cls._wrap(array)

    @classmethod
    def of_array(cls, array: np.ndarray) -> ChunkTable:
        """A table viewing ``array`` (``(n, 2)`` uint32, little-endian: sizes, CRC32Cs), not copied."""
        return cls._wrap(array)

    @classmethod
    def unpack(cls, data: bytes | memoryview, count: int) -> ChunkTable:
        """``count`` packed entries (``<II`` each), copied out of ``data``."""
        return cls._wrap(np.frombuffer(data, dtype="<u4", count=2 * count).astype(np.uint32).reshape(-1, 2))

    @classmethod
    def _wrap(cls, array: np.ndarray) -> ChunkTable:
        table = cls.__new__(cls)
        table.array = array
        return table

    @property
    def sizes(self) -> np.ndarray:
        """Each chunk's stored bytes (uint32)."""
        return self.array[:, 0]

    @property
    def crcs(self) -> np.ndarray:
        """Each chunk's CRC32C (uint32)."""
        return self.array[:, 1]

    @property
    def total(self) -> int:
        """Stored bytes of all chunks."""
        return int(self.array[:, 0].sum(dtype=np.int64))

    def pack(self) -> bytes:
        return self.array.astype("<u4", copy=False).tobytes()

    def __len__(self) -> int:
        return len(self.array)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter([(s, c) for s, c in self.array.tolist()])

    @overload
    def __getitem__(self, index: int) -> tuple[int, int]: ...

    @overload
    def __getitem__(self, index: slice) -> list[tuple[int, int]]: ...

    def __getitem__(self, index: int | slice) -> tuple[int, int] | list[tuple[int, int]]:
        if isinstance(index, slice):
            return [(s, c) for s, c in self.array[index].tolist()]
        size, crc = self.array[index].tolist()
        return size, crc

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.array if dtype is None else self.array.astype(dtype)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkTable):
            return bool(np.array_equal(self.array, other.array))
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and all(tuple(o) == t for o, t in zip(other, self))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.array.tobytes())

    def __repr__(self) -> str:
        return f"ChunkTable({len(self)} chunks, {self.total} bytes)"


@dataclass(frozen=True)
class ItemHeader:
    """The record in front of every stored item.

    The item's elements are cut into *blocks* of ``chunk_bytes`` elements (``chunk_bytes`` bytes
    when there is no transform). Each block yields one chunk per plane: plane ``p`` holds byte
    ``p`` of every element of the block (``TRANSFORM_BYTEPLANES``), or the block's bytes as they
    are (one plane, ``TRANSFORM_NONE``). ``plane_codecs[p]`` compresses plane ``p``. ``chunks``
    lists ``(stored_bytes, crc32c)`` for every chunk, block-major: chunk ``i`` is plane
    ``i % n_planes`` of block ``i // n_planes``, so any block range can be encoded, streamed and
    decoded on its own. A chunk whose stored size equals its uncompressed size is stored raw
    (compression never pays for it to be that large).

    ``base_digest`` set (a version 2 record): the bytes the chunks decode to are the item's
    delta against the raw bytes of the same item in the base checkpoint, whose record digest (its
    header CRC32C, :mod:`nvdcp.format.digest`) is ``base_digest``; ``delta_kind`` says which delta
    (:mod:`nvdcp.transform.delta`: 0 XOR, 1 zigzag integer difference of whole elements).
    """

    kind: int
    dtype_code: int
    shape: tuple[int, ...]
    raw_nbytes: int
    transform: int
    plane_codecs: tuple[int, ...]
    chunks: ChunkTable  # a sequence of (size, crc) pairs is converted
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    base_digest: int | None = None
    delta_kind: int = 0
    header_bytes: int = field(default=0, compare=False)
    #: the header's own CRC32C as stored (set by parsing, which checked it): the item's digest
    #: without packing the header again
    stored_crc: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, ChunkTable):
            object.__setattr__(self, "chunks", ChunkTable(self.chunks))

    @property
    def version(self) -> int:
        return FULL_ITEM_VERSION if self.base_digest is None else DELTA_ITEM_VERSION

    @property
    def is_delta(self) -> bool:
        """Stored as the XOR with its base item (see the class doc)."""
        return self.base_digest is not None

    @property
    def plane_nbytes(self) -> int:
        return self.raw_nbytes // len(self.plane_codecs)

    @property
    def n_planes(self) -> int:
        return len(self.plane_codecs)

    @property
    def n_blocks(self) -> int:
        return -(-self.plane_nbytes // self.chunk_bytes)

    @property
    def stored_nbytes(self) -> int:
        return self.chunks.total

    def block_elements(self, block: int) -> int:
        """Elements in ``block`` (bytes per plane chunk of that block)."""
        return min(self.chunk_bytes, self.plane_nbytes - block * self.chunk_bytes)

    def pack(self) -> bytes:
        n_planes = len(self.plane_codecs)
        delta = self.base_digest is not None
        size = self.packed_size(len(self.shape), n_planes, len(self.chunks), delta)
        parts = [
            _ITEM_FIXED.pack(
                ITEM_MAGIC, self.version, self.kind, self.dtype_code, self.transform,
                n_planes, len(self.shape), FLAG_XOR_BASE if delta else 0, self.chunk_bytes, self.raw_nbytes, size,
            ),
            _BASE.pack(self.base_digest, self.delta_kind) if delta else b"",
            struct.pack(f"<{len(self.shape)}Q", *self.shape),
            bytes(self.plane_codecs) + b"\x00" * _pad4(n_planes),
            self.chunks.pack(),
        ]
        body = b"".join(parts)
        return body + _CRC.pack(checksum(body))

    @staticmethod
    def packed_size(ndim: int, n_planes: int, n_chunks: int, delta: bool = False) -> int:
        return (
            _ITEM_FIXED.size + (_BASE.size if delta else 0) + 8 * ndim + n_planes + _pad4(n_planes)
            + _CHUNK.size * n_chunks + _CRC.size
        )


def _pad4(n: int) -> int:
    return (-n) % 4


def item_header_size(prefix: memoryview, where: str) -> int:
    """Declared size of the item header at the start of ``prefix``, its fixed fields validated.

    Needs only the first ``ITEM_FIXED_SIZE`` bytes: tells a reader how many bytes to fetch to
    parse the whole header (:func:`parse_item_header_only`) without fetching the payload.
    """
    if len(prefix) < _ITEM_FIXED.size:
        raise TruncatedCheckpointError(f"{where}: item record is {len(prefix)} bytes, shorter than its header")
    (magic, version, kind, dtype_code, transform, n_planes, ndim, flags, chunk_bytes, raw_nbytes,
     header_bytes) = _ITEM_FIXED.unpack_from(prefix, 0)
    if magic != ITEM_MAGIC:
        raise CorruptCheckpointError(f"{where}: bad item magic {bytes(magic)!r}")
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{where}: item written by container format v{version}; this nvdcp reads up to "
            f"v{FORMAT_VERSION}; upgrade nvdcp (if no newer nvdcp wrote it, the item header is damaged)"
        )
    if version < 1 or kind not in (KIND_TENSOR, KIND_BYTES) or transform not in (
        TRANSFORM_NONE, TRANSFORM_BYTEPLANES
    ):
        raise CorruptCheckpointError(f"{where}: invalid item header fields")
    # v1: the byte is reserved (0); v2 records are delta items, the only kind v2 added.
    if flags != (0 if version == FULL_ITEM_VERSION else FLAG_XOR_BASE):
        raise CorruptCheckpointError(f"{where}: invalid flags {flags:#x} in a v{version} item header")
    if (
        not 1 <= n_planes <= MAX_PLANES or ndim > MAX_NDIM
        or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES
    ):
        raise CorruptCheckpointError(
            f"{where}: item header out of range ({n_planes} planes, ndim {ndim}, chunk size {chunk_bytes})"
        )
    if kind == KIND_BYTES and (n_planes != 1 or transform != TRANSFORM_NONE or ndim or dtype_code or flags):
        raise CorruptCheckpointError(f"{where}: a bytes item must have one plane, no transform, no shape and no base")
    if raw_nbytes % n_planes:
        raise CorruptCheckpointError(f"{where}: {raw_nbytes} bytes do not split into {n_planes} planes")
    plane_nbytes = raw_nbytes // n_planes
    n_chunks = n_planes * (-(-plane_nbytes // chunk_bytes))
    expected = ItemHeader.packed_size(ndim, n_planes, n_chunks, bool(flags & FLAG_XOR_BASE))
    if header_bytes != expected:
        raise CorruptCheckpointError(
            f"{where}: header claims {header_bytes} bytes but its fields need {expected}"
        )
    return int(header_bytes)


ITEM_FIXED_SIZE = _ITEM_FIXED.size


def parse_item_header_only(buf: memoryview, where: str) -> ItemHeader:
    """Parse and validate the item header at the start of ``buf``, which may end anywhere after it.

    The same checks as :func:`parse_item_header` (fields, declared size, header CRC) except the
    last: chunk sizes are not compared with a payload, so ``buf`` can be a prefix of the item
    (``item_header_size`` bytes or more) fetched to inspect it without reading its data.
    """
    header_bytes = item_header_size(buf, where)
    if header_bytes > len(buf):
        raise TruncatedCheckpointError(
            f"{where}: header needs {header_bytes} bytes, only {len(buf)} present"
        )
    (_m, version, kind, dtype_code, transform, n_planes, ndim, flags, chunk_bytes, raw_nbytes,
     _hb) = _ITEM_FIXED.unpack_from(buf, 0)
    (stored_crc,) = _CRC.unpack_from(buf, header_bytes - _CRC.size)
    if checksum(buf[: header_bytes - _CRC.size]) != stored_crc:
        raise CorruptCheckpointError(f"{where}: item header checksum mismatch")
    n_chunks = n_planes * (-(-(raw_nbytes // n_planes) // chunk_bytes))
    off = _ITEM_FIXED.size
    base_digest, delta_kind = None, 0
    if flags & FLAG_XOR_BASE:
        base_digest, delta_kind = _BASE.unpack_from(buf, off)
        if delta_kind not in DELTA_KINDS:
            raise CorruptCheckpointError(f"{where}: unknown delta kind {delta_kind}")
        off += _BASE.size
    shape = struct.unpack_from(f"<{ndim}Q", buf, off)
    off += 8 * ndim
    plane_codecs = tuple(buf[off : off + n_planes])
    off += n_planes + _pad4(n_planes)
    chunks = ChunkTable.unpack(buf[off : off + _CHUNK.size * n_chunks], n_chunks)
    return ItemHeader(
        kind=kind, dtype_code=dtype_code, shape=tuple(shape), raw_nbytes=raw_nbytes,
        transform=transform, plane_codecs=plane_codecs, chunks=chunks,
        chunk_bytes=chunk_bytes, base_digest=base_digest, delta_kind=delta_kind, header_bytes=header_bytes,
        stored_crc=stored_crc,
    )


def parse_item_header(buf: memoryview, where: str) -> ItemHeader:
    """Parse and validate the item record at the start of ``buf`` (the item's stored bytes).

    ``where`` names the file and item for error messages. Checks, in order: enough bytes for the
    fixed part, magic, version, field ranges, the declared header size against ``len(buf)``, the
    header CRC, then chunk sizes against the payload that follows.
    """
    header = parse_item_header_only(buf, where)
    payload = len(buf) - header.header_bytes
    if header.stored_nbytes != payload:
        cls = TruncatedCheckpointError if header.stored_nbytes > payload else CorruptCheckpointError
        raise cls(f"{where}: chunks hold {header.stored_nbytes} bytes, record has {payload}")
    return header


def pack_file_header(info: dict[str, object]) -> bytes:
    """The data file's leading record: magic, format version, and who wrote it (JSON)."""
    blob = json.dumps(info, sort_keys=True, separators=(",", ":")).encode()
    body = _FILE_FIXED.pack(FILE_MAGIC, FILE_VERSION, 0, len(blob)) + blob
    return body + _CRC.pack(checksum(body))


def file_header_size(prefix: memoryview, where: str) -> int:
    """Total size of the file header, from its first ``_FILE_FIXED.size`` bytes."""
    if len(prefix) < _FILE_FIXED.size:
        raise TruncatedCheckpointError(f"{where}: file shorter than its header")
    magic, version, _r, info_len = _FILE_FIXED.unpack_from(prefix, 0)
    if magic != FILE_MAGIC:
        raise CorruptCheckpointError(f"{where}: not an nvdcp data file (magic {bytes(magic)!r})")
    if version > FILE_VERSION:
        raise FormatVersionError(
            f"{where}: data file written by container format v{version}; this nvdcp reads up to "
            f"v{FILE_VERSION}; upgrade nvdcp"
        )
    if info_len > 1 << 20:
        raise CorruptCheckpointError(f"{where}: file header info of {info_len} bytes is implausible")
    return _FILE_FIXED.size + info_len + _CRC.size


FILE_FIXED_SIZE = _FILE_FIXED.size


def parse_file_header(buf: memoryview, where: str) -> dict[str, object]:
    """Validate a whole file header (as sized by :func:`file_header_size`) and return its info."""
    size = file_header_size(buf, where)
    if len(buf) < size:
        raise TruncatedCheckpointError(f"{where}: file shorter than its header")
    (stored_crc,) = _CRC.unpack_from(buf, size - _CRC.size)
    if checksum(buf[: size - _CRC.size]) != stored_crc:
        raise CorruptCheckpointError(f"{where}: file header checksum mismatch")
    try:
        info = json.loads(bytes(buf[_FILE_FIXED.size : size - _CRC.size]))
    except ValueError as exc:
        raise CorruptCheckpointError(f"{where}: file header info is not JSON") from exc
    if not isinstance(info, dict):
        raise CorruptCheckpointError(f"{where}: file header info is not an object")
    return info

"""Reading ``.metadata``: existence, size bounds, unpickling with an allow-list, record checks.

``.metadata`` is a pickle, as in stock DCP. Loading a pickle runs code named in it, so nvdcp
unpickles with a restricted ``Unpickler`` that resolves only what a DCP ``Metadata`` contains:
the dataclasses and enums *defined in* ``torch.distributed.checkpoint.metadata`` and
``.filesystem``, torch dtypes, layouts, memory formats and ``torch.Size``, ``OrderedDict``, sets
(and ``copyreg._reconstructor`` on ``object``, which protocols 0 and 1 use to build them, and
``_codecs.encode`` of a ``str`` to latin-1 only, how protocols 0-2 spell ``bytes``).
Nothing callable beyond those constructors (no ``getattr``, no dotted names, no functions
imported into those modules) is reachable. ``allow_paths`` (what :class:`~nvdcp.NvcompReader`
and the CLI use) also admits ``pathlib`` paths, the one other type a stock ``.metadata`` holds. Before unpickling, the opcodes are walked once so a
damaged memo index cannot make the C unpickler allocate gigabytes. That narrows, but does not
replace, the rule to load only checkpoints you trust (docs/SECURITY.md).
"""

from __future__ import annotations

import copyreg
import ctypes
import dataclasses
import enum
import functools
import gc
import io
import math
import os
import pickle
import pickletools
import re
import sys
from collections.abc import Callable
from itertools import chain, compress, cycle, islice, repeat
from operator import add, attrgetter, eq, itemgetter, le, not_
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from nvdcp._native import load_function
from nvdcp.dcp.collector import gc_paused
from nvdcp.errors import CorruptCheckpointError, IncompleteCheckpointError, MissingDataFileError
from nvdcp.storage import Storage
from nvdcp.storage.base import check_name

METADATA_NAME = ".metadata"
#: Largest ``.metadata`` read. DCP's pickle takes about 200 bytes per item: a 7B model's FSDP2
#: save on 16,384 ranks (14.3 million items) is 2.8 GB, past the 2 GiB this was (docs/SCALE.md).
MAX_METADATA_BYTES = 1 << 34
#: :func:`load_metadata` runs one full garbage collection after unpickling (with the collector
#: paused) when the new objects are more than this share of the process's memory blocks: about
#: when CPython's own rule (objects promoted since the last full pass > a quarter of those that
#: survived it) would start one during whatever runs next (docs/SCALE.md).
COLLECT_ABOVE_SHARE = 0.2
#: Largest offset or length a storage record may hold (S3 objects stop at 5 TiB).
MAX_RECORD_BYTES = 1 << 62

#: Modules whose dataclasses and enums may be rebuilt (only classes defined in them, by plain name).
_DCP_MODULES = frozenset({"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"})
_ALLOWED = {
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "object"), ("collections", "OrderedDict"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
}
_PY2_NAMES = {"__builtin__": "builtins", "copy_reg": "copyreg"}  # protocols 0-2 spell them so


def _latin1_bytes(text: str, encoding: str) -> bytes:
    """``_codecs.encode`` as pickle protocols 0-2 spell a ``bytes`` object (nvdcp's save digest
    record, docs/FORMAT.md): the latin-1 encoding of a ``str``, and nothing else."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("refusing _codecs.encode other than a latin-1 str from .metadata")
    return text.encode("latin-1")


def _reconstructor(cls: type, base: type, state: Any) -> Any:
    """``copyreg._reconstructor`` (how protocols 0 and 1 build objects) for plain ``object`` bases."""
    if base is not object:
        raise pickle.UnpicklingError(f"refusing to rebuild {cls!r} on {base!r} from .metadata")
    return copyreg._reconstructor(cls, base, state)  # type: ignore[attr-defined]


#: Stock FileSystemWriter pickles ``storage_meta.checkpoint_id`` as a ``pathlib`` path; building
#: one handles strings and nothing else (no file system access). Python 3.13 pickles them from
#: ``pathlib._local``.
_PATH_MODULES = frozenset({"pathlib", "pathlib._local"})
_PATH_NAMES = frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path", "PurePath"})


def _path_class(name: str) -> type:
    """The ``pathlib`` class ``name``; a concrete path of the other OS (a checkpoint written on
    Windows read on Linux) becomes its pure flavour, which can be built anywhere."""
    import pathlib

    if name == "WindowsPath" and os.name != "nt":
        name = "PureWindowsPath"
    elif name == "PosixPath" and os.name == "nt":
        name = "PurePosixPath"
    cls: type = getattr(pathlib, name)
    return cls


class _MetadataUnpickler(pickle.Unpickler):
    allow_paths = False

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if self.allow_paths and module in _PATH_MODULES and name in _PATH_NAMES:
            return _path_class(name)

        # A dotted name walks attributes (pickle protocol 4): ``<allowed module>.os.system``.
        if not name.isidentifier():
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from .metadata")
        module = _PY2_NAMES.get(module, module)
        if (module, name) == ("copyreg", "_reconstructor"):
            return _reconstructor
        if (module, name) == ("_codecs", "encode"):
            return _latin1_bytes
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module in _DCP_MODULES:
            obj = super().find_class(module, name)
            if (
                isinstance(obj, type)
                and obj.__module__ == module
                and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
            ):
                return obj
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from .metadata")


class _StockMetadataUnpickler(_MetadataUnpickler):
    allow_paths = True


def load_metadata(storage: Storage, *, allow_paths: bool = False) -> Metadata:
    """Read and validate ``.metadata`` from ``storage``.

    Beyond unpickling, every storage record must name a plain file inside the checkpoint (no
    ``/``, ``..`` or absolute path) and hold a non-negative integer offset and length, so a
    hostile record fails here, before any data is fetched or allocated. ``allow_paths`` also
    admits ``pathlib`` paths, which stock DCP checkpoints hold (the CLI reads those too).
    """
    return parse_metadata(read_metadata_bytes(storage), storage.describe(METADATA_NAME), allow_paths=allow_paths)


def read_metadata_bytes(storage: Storage) -> bytes:
    """The bytes of ``storage``'s ``.metadata``, unparsed.

    Raises:
        IncompleteCheckpointError: there is none (no committed checkpoint there).
    """
    try:
        return storage.read(METADATA_NAME)
    except (MissingDataFileError, FileNotFoundError):
        raise IncompleteCheckpointError(
            f"{storage.url}: no committed checkpoint here ({METADATA_NAME} is missing: the save "
            "never finished, or this is not a checkpoint)"
        ) from None


def parse_metadata(blob: bytes, where: str, *, allow_paths: bool = False) -> Metadata:
    """A ``.metadata``'s bytes (read from ``where``) unpickled and checked as :func:`load_metadata` says."""
    if len(blob) > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{where}: {len(blob)} bytes is implausibly large")
    check_memo_indices(blob, where)
    blocks_before = sys.getallocatedblocks()
    collecting = gc.isenabled()
    with gc_paused():
        try:
            unpickler = _StockMetadataUnpickler if allow_paths else _MetadataUnpickler
            metadata = unpickler(io.BytesIO(blob)).load()
        except Exception as exc:  # a corrupt pickle can raise almost anything
            raise CorruptCheckpointError(f"{where}: cannot unpickle: {exc}") from exc
        if not isinstance(metadata, Metadata):
            raise CorruptCheckpointError(f"{where}: holds {type(metadata).__name__}, not Metadata")
        check_records(metadata, where)
        if collecting and _collect_now(blocks_before, sys.getallocatedblocks()):
            # The objects just built are all young: left so, the collector's next young passes would
            # walk them all, twice, during whatever runs next (a rank's load plan ran 2x slower at
            # 64 ranks). One pass over the young generations now walks them once and leaves them
            # old; whether the old generation then needs a full pass is CPython's own rule, as for
            # any objects (a full pass here walked the whole heap: 0.15 s more per 20,000-item
            # .metadata in a loading process, and did not make the rest of the load faster).
            # It runs before the collector is back on: else the first allocation after that
            # starts a young pass over the same objects first (two walks: 42-92 ms against
            # 44-47 ms per 20,000-item .metadata on the CPU machine).
            # (Moving them to the oldest generation without a collection, gc.freeze() + unfreeze(),
            # was tried: it moves the process's young garbage too, uncollected until the next full
            # pass; the reader fuzz target, capped in address space, ran out of memory with it.)
            gc.collect(1)
    return metadata


def _collect_now(blocks_before: int, blocks_after: int) -> bool:
    """Whether the objects a ``.metadata`` just added (in pymalloc blocks: O(1) to count) would
    soon start a full collection anyway. A small one in a large process (a training job's heap)
    is left to the young passes: a full pass would walk the whole heap for it."""
    added = blocks_after - blocks_before
    return added > COLLECT_ABOVE_SHARE * blocks_after


def _opcode_table() -> dict[int, tuple[int, int]]:
    """Per opcode byte: (0 no argument, 1 fixed bytes, 2 lines, 3 counted) and the size/count."""
    table: dict[int, tuple[int, int]] = {}
    for op in pickletools.opcodes:
        code, n = ord(op.code), op.arg.n if op.arg is not None else 0
        if op.arg is None:
            table[code] = (0, 0)
        elif n >= 0:
            table[code] = (1, n)
        elif n == pickletools.UP_TO_NEWLINE:
            table[code] = (2, 2 if op.name in ("GLOBAL", "INST") else 1)  # module\nname\n
        else:
            table[code] = (3, {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
                               pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}[n])
    return table


_OPCODES = _opcode_table()
_PUT, _LONG_BINPUT, _STOP = ord(pickle.PUT), ord(pickle.LONG_BINPUT), ord(pickle.STOP)
# What follows each opcode byte, as one int (the scan's fast path is one list index and an add):
# n >= 0: n fixed bytes; -1/-4/-8: a count of that many bytes, then that many bytes;
# _LINES: newline-terminated arguments; _STOP_OP, _LONG_BINPUT_OP; _UNKNOWN: no such opcode.
_LINES, _STOP_OP, _LONG_BINPUT_OP, _UNKNOWN = -10, -20, -5, -30


def _skip_table() -> list[int]:
    skip = [_UNKNOWN] * 256
    for code, (kind, k) in _OPCODES.items():
        skip[code] = {0: 0, 1: k, 2: _LINES, 3: -k}[kind]
    skip[_STOP] = _STOP_OP
    skip[_LONG_BINPUT] = _LONG_BINPUT_OP
    return skip


_SKIP = _skip_table()


def _simple_run() -> re.Pattern[bytes]:
    """A run of opcodes the scan only steps over: no argument, a fixed-size one (all but ``STOP``
    and ``LONG_BINPUT``), or a one-byte count and that many bytes. Matching it is
    :func:`check_memo_indices`'s walk done by the C regex engine instead of the Python loop, which
    then sees only the other opcodes (``STOP``, long strings, lines...): 4x faster on a DCP
    ``.metadata`` (docs/SCALE.md)."""
    by_size: dict[int, list[int]] = {}
    for code, step in enumerate(_SKIP):
        if step >= 0:
            by_size.setdefault(step, []).append(code)
    alternatives = [_byte_class(codes) + (b".{%d}" % k if k else b"") for k, codes in sorted(by_size.items())]
    # A one-byte count, then that many bytes (SHORT_BINUNICODE: every record's fqn): one
    # alternative per count, each starting with its literal count byte, which sre checks first.
    counted = [code for code, step in enumerate(_SKIP) if step == -1]
    alternatives.append(_byte_class(counted) + b"(?:" + b"|".join(
        b"\\x%02x" % k + (b".{%d}" % k if k else b"") for k in range(256)
    ) + b")")
    # Possessive (3.11+): never backtracks, so the engine keeps no state per opcode.
    repeat = b"*+" if sys.version_info >= (3, 11) else b"*"
    return re.compile(b"(?:" + b"|".join(alternatives) + b")" + repeat, re.DOTALL)


def _byte_class(codes: list[int]) -> bytes:
    return b"[" + b"".join(b"\\x%02x" % c for c in codes) + b"]"


_SIMPLE_RUN = _simple_run()
_SKIP_INT32 = (ctypes.c_int32 * 256)(*_SKIP)
_FORMAT_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "format")


@functools.cache
def _native_pickle_skip() -> Callable[[bytes, int, int, Any], int] | None:
    """The native library's step over the opcodes :func:`check_memo_indices` only steps over
    (``nvdcp_pickle_skip``: the same walk in C, ~10x faster than the regex on a 20,000-item
    ``.metadata``), or None without the library (the regex then)."""
    fn = load_function(_FORMAT_DIR, "_crc32c_batch", "nvdcp_pickle_skip")
    if fn is not None:
        fn.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_int32)]
        fn.restype = ctypes.c_int64
    return fn  # type: ignore[no-any-return]


def check_memo_indices(blob: bytes, where: str) -> None:
    """Refuse a pickle that stores to a memo slot no valid pickle of its size could use.

    CPython's C unpickler grows its memo table to twice the index a ``PUT``/``LONG_BINPUT`` names
    and zeroes it: one damaged byte (``MEMOIZE`` read as ``LONG_BINPUT``) made it allocate 9.5 GiB
    and spend 22 s before failing (docs/RELIABILITY.md). This walks the opcodes without building
    anything and checks every index against the size. Runs of opcodes it only steps over go by
    in one call of the native library's ``nvdcp_pickle_skip`` (or, without it, one regex match:
    :func:`_simple_run`), the others through the loop.
    """
    n, i, skip, frombytes, run = len(blob), 0, _SKIP, int.from_bytes, _SIMPLE_RUN.match
    native = _native_pickle_skip() if type(blob) is bytes else None
    try:
        while i < n:
            if native is not None:
                i = native(blob, n, i, _SKIP_INT32)
            else:
                i = run(blob, i).end()  # type: ignore[union-attr]  # it matches the empty run too
            if i >= n:
                break
            s = skip[blob[i]]
            i += 1
            if s >= 0:
                i += s
            elif s == -1:
                i += 1 + (blob[i] if i < n else 0)
            elif s == -4 or s == -8:
                i += -s + frombytes(blob[i : i - s], "little")
            elif s == _LONG_BINPUT_OP:
                if frombytes(blob[i : i + 4], "little") > n:
                    raise CorruptCheckpointError(f"{where}: cannot unpickle: memo index beyond the data")
                i += 4
            elif s == _STOP_OP:
                return
            elif s == _LINES:
                code, start = blob[i - 1], i
                for _ in range(_OPCODES[code][1]):
                    i = blob.index(b"\n", i) + 1
                if code == _PUT and int(blob[start : i - 1]) > n:
                    raise CorruptCheckpointError(f"{where}: cannot unpickle: memo index beyond the data")
            else:
                raise KeyError(blob[i - 1])
    except CorruptCheckpointError:
        raise
    except (KeyError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: cannot unpickle: malformed opcode at byte {i - 1}") from exc
    raise CorruptCheckpointError(f"{where}: cannot unpickle: the pickle has no end (truncated)")


def check_records(metadata: Metadata, where: str) -> None:
    """Refuse storage records that point outside the checkpoint or hold impossible ranges, and
    tensors whose chunks do not tile them (see ``_check_layout``)."""
    try:
        _check_records(metadata, where)
    except (AttributeError, TypeError, ValueError, KeyError) as exc:
        if isinstance(exc, CorruptCheckpointError):
            raise
        # Objects of the allowed classes, but not as DCP builds them (a damaged field name...)
        raise CorruptCheckpointError(f"{where}: malformed metadata: {exc}") from exc


def _check_records(metadata: Metadata, where: str) -> None:
    records = metadata.storage_data
    if not isinstance(records, dict):
        raise CorruptCheckpointError(f"{where}: has no storage records")
    if not _records_pass(records):
        _check_each_record(records, where)  # finds and names the first bad record
    _check_layout(metadata, where)


def _records_pass(records: dict[Any, Any]) -> bool:
    """Whether every record passes :func:`_check_each_record`, checked column by column in C
    (``map``, ``set``, ``min``); False also when that cannot tell, e.g. a record of another class
    (the per-record loop then decides and names the item). A 16M-item ``.metadata`` costs ~2 s
    here instead of ~30 s (docs/SCALE.md)."""
    infos = records.values()
    if not infos:
        return True
    if set(map(type, infos)) != {_StorageInfo}:
        return False
    try:
        names = set(map(attrgetter("relative_path"), infos))
        descs = set(map(attrgetter("transform_descriptors"), infos))
        offsets = list(map(attrgetter("offset"), infos))
        lengths = list(map(attrgetter("length"), infos))
    except (AttributeError, TypeError):  # a field missing, an unhashable name or descriptor list
        return False
    for name in names:
        try:
            check_name(name, "")
        except CorruptCheckpointError:
            return False
    for desc in descs:
        if desc is not None and (not isinstance(desc, (tuple, list)) or not all(isinstance(d, str) for d in desc)):
            return False
    return all(
        set(map(type, values)) == {int} and min(values) >= 0 and max(values) < MAX_RECORD_BYTES
        for values in (offsets, lengths)
    )


def _check_each_record(records: dict[Any, Any], where: str) -> None:
    names: set[int] = set()  # ids: records of one file share one name object (pickle memo)
    for index, info in records.items():
        name = getattr(info, "relative_path", None)
        offset = getattr(info, "offset", None)
        length = getattr(info, "length", None)
        fqn = getattr(index, "fqn", index)
        if id(name) not in names:
            check_name(name, f"{where}: item {fqn!r}")  # type: ignore[arg-type]
            names.add(id(name))
        descs = getattr(info, "transform_descriptors", None)
        if descs is not None and (not isinstance(descs, (tuple, list)) or not all(isinstance(d, str) for d in descs)):
            raise CorruptCheckpointError(f"{where}: item {fqn!r} has malformed descriptors {descs!r}")
        for value in (offset, length):
            if type(value) is not int or not 0 <= value < MAX_RECORD_BYTES:
                raise CorruptCheckpointError(
                    f"{where}: item {fqn!r} has an invalid byte range (offset {offset!r}, length {length!r})"
                )


def _check_layout(metadata: Metadata, where: str) -> None:
    """Every tensor's chunks tile it exactly, and every chunk and bytes item has a record.

    DCP's planner reads only the chunks that overlap what is asked for: a chunk whose offsets or
    sizes were damaged would leave part of a tensor unread, and the load would succeed with the
    destination's old values there. Pickle has no checksum; this is the check instead.
    """
    records = metadata.storage_data
    sdm = metadata.state_dict_metadata
    if not isinstance(sdm, dict):
        raise CorruptCheckpointError(f"{where}: has no state_dict_metadata")
    # What ``MetadataIndex(fqn, offsets) in records`` finds, as plain tuples: a MetadataIndex
    # hashes and compares as its (fqn, offset), and only equals another MetadataIndex. Each
    # record's fqn is swapped for the equal key of state_dict_metadata: every record of a rank
    # holds its own copy of the string, and comparing one object with itself skips the bytes.
    keys = list(records)
    if set(map(type, keys)) <= {MetadataIndex}:
        named = list(map(attrgetter("fqn"), keys))
        fqns = list(map({f: f for f in sdm}.get, named))
        unknown = None in fqns
        recorded = set(zip(named if unknown else fqns, map(attrgetter("offset"), keys)))
    else:
        recorded = {(k.fqn, k.offset) for k in keys if type(k) is MetadataIndex}
        unknown = True
    items = list(sdm.items())
    one_chunk = [type(md) is TensorStorageMetadata and type(getattr(md, "chunks", None)) is list and len(md.chunks) == 1
                 for md in sdm.values()]
    if _all_whole_and_recorded(list(compress(items, one_chunk)), recorded):
        items = list(compress(items, map(not_, one_chunk)))  # the common case checked in C passes: the rest here
    for fqn, md in items:
        if isinstance(md, TensorStorageMetadata):
            boxes = _tile(fqn, md, where)
            if not recorded.issuperset(zip(repeat(fqn), map(itemgetter(0), boxes))):
                for offsets, _ in boxes:
                    if (fqn, offsets) not in recorded:
                        raise CorruptCheckpointError(
                            f"{where}: item {fqn!r} chunk at {list(offsets)} has no storage record"
                        )
        elif isinstance(md, BytesStorageMetadata):
            if (fqn, None) not in recorded:
                raise CorruptCheckpointError(f"{where}: item {fqn!r} has no storage record")
        else:
            raise CorruptCheckpointError(f"{where}: item {fqn!r} is described by {type(md).__name__}")
    if unknown:
        for index in records:
            if getattr(index, "fqn", None) not in sdm:
                raise CorruptCheckpointError(
                    f"{where}: storage record for unknown item {getattr(index, 'fqn', index)!r}"
                )


def _all_whole_and_recorded(items: list[tuple[str, Any]], recorded: set[Any]) -> bool:
    """Whether every tensor of ``items`` (each in one chunk) passes what :func:`_tile` and
    :func:`_check_layout` check of it, the chunk whole (int offsets all 0, int sizes >= 0 equal
    to its size, as :func:`_whole` says), its dtype a dtype, its chunk recorded: column by column
    in C passes (a Python loop with a call per item was a quarter of reading a 20,000-item
    ``.metadata``). False when some is not, or when this cannot tell: the loop then checks each
    and names the first bad one."""
    import torch

    if not items:
        return True
    try:
        mds = list(map(itemgetter(1), items))
        if set(map(type, map(attrgetter("properties.dtype"), mds))) != {torch.dtype}:
            return False
        chunks = list(map(itemgetter(0), map(attrgetter("chunks"), mds)))
        offsets, sizes = list(map(attrgetter("offsets"), chunks)), list(map(attrgetter("sizes"), chunks))
        dims = list(map(attrgetter("size"), mds))
        if not set(map(type, offsets)) | set(map(type, sizes)) | set(map(type, dims)) <= {torch.Size, tuple}:
            return False
        if not all(map(eq, sizes, dims)) or list(map(len, offsets)) != list(map(len, dims)):
            return False
        starts, lengths = list(chain.from_iterable(offsets)), list(chain.from_iterable(sizes))
        if not set(map(type, starts)) | set(map(type, lengths)) <= {int} or any(starts) or min(lengths, default=0) < 0:
            return False
        return recorded.issuperset(zip(map(itemgetter(0), items), offsets))
    except (AttributeError, TypeError, IndexError):
        return False


def _tile(fqn: str, md: TensorStorageMetadata, where: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    import torch

    size = tuple(md.size)
    if not isinstance(md.properties.dtype, torch.dtype):
        raise CorruptCheckpointError(f"{where}: item {fqn!r} has no dtype")
    chunks = md.chunks
    if type(chunks) is list and len(chunks) == 1:  # the tensor whole in one chunk (not sharded)
        whole = _whole(chunks[0], size)
        if whole is not None:
            return [whole]
    boxes = _inside(chunks, size)
    if boxes is None:  # some chunk is not as DCP builds it: check one at a time, name the first
        boxes = []
        for chunk in md.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if len(offsets) != len(size) or len(sizes) != len(size) or not all(
                type(o) is int and type(n) is int and 0 <= o and 0 <= n and o + n <= d
                for o, n, d in zip(offsets, sizes, size)
            ):
                raise CorruptCheckpointError(
                    f"{where}: item {fqn!r} chunk at {list(offsets)} of {list(sizes)} lies outside its {list(size)}"
                )
            boxes.append((offsets, sizes))
    total = sum(map(math.prod, map(itemgetter(1), boxes)))
    if total != math.prod(size):
        raise CorruptCheckpointError(
            f"{where}: item {fqn!r} chunks hold {total} elements, the tensor has {math.prod(size)}"
        )
    # Same volume and all inside: any overlap leaves a gap. Sweep along the dimension the
    # chunks are cut along most (the shard dimension), so a 1-D sharding costs O(n log n).
    # Each step is a pass in C (map, set, sort): a 16,384-rank tensor has 16,384 chunks.
    solid = list(compress(boxes, map(all, map(itemgetter(1), boxes))))  # empty chunks overlap nothing
    corners = list(map(itemgetter(0), solid))
    # (a dimension with as many distinct starts as chunks wins: no other can have more)
    d = 0 if size and len(set(map(itemgetter(0), corners))) == len(corners) else max(
        range(len(size)), key=lambda k: len(set(map(itemgetter(k), corners))), default=0
    )
    if size and len(solid) > 1:
        starts = list(map(itemgetter(d), corners))
        if not all(map(le, starts, islice(starts, 1, None))):  # not in order yet (a stable sort)
            solid.sort(key=lambda b: b[0][d])
            starts = [o[d] for o, _ in solid]
        ends = map(add, starts, map(itemgetter(d), map(itemgetter(1), solid)))
        if all(map(le, ends, islice(starts, 1, None))):
            return boxes  # each box ends before the next starts along d: none overlap
    count = len(solid)
    for i, (off_a, len_a) in enumerate(solid):
        for j in range(i + 1, count):
            off_b, len_b = solid[j]
            if size and off_b[d] >= off_a[d] + len_a[d]:
                break
            if all(ob < oa + la and oa < ob + lb for oa, la, ob, lb in zip(off_a, len_a, off_b, len_b)):
                raise CorruptCheckpointError(
                    f"{where}: item {fqn!r} chunks at {list(off_a)} and {list(off_b)} overlap"
                )
    return boxes


def _whole(chunk: Any, size: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``chunk``'s (offsets, sizes) when it covers the whole tensor of ``size`` exactly (int
    offsets all 0, int sizes >= 0 equal to ``size``); None otherwise (the general checks decide
    and name what is wrong)."""
    try:
        offsets, sizes = chunk.offsets, chunk.sizes
        if len(offsets) != len(size) or any(offsets) or tuple(sizes) != size:
            return None
        if not set(map(type, offsets)) | set(map(type, sizes)) <= {int} or min(size, default=0) < 0:
            return None
    except (AttributeError, TypeError):
        return None
    return offsets, sizes


def _inside(chunks: Any, size: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """The chunks' (offsets, sizes) when every one has the tensor's rank and lies inside it (int
    offsets and lengths >= 0), checked in a few passes in C; None when not, or when that cannot
    tell (then :func:`_tile` checks chunk by chunk and names the first bad one). ``torch.Size``
    and tuples are kept as they are (a Size hashes, compares and prints as its tuple)."""
    import torch

    try:
        boxes = list(map(attrgetter("offsets", "sizes"), chunks))
        offsets, sizes = list(map(itemgetter(0), boxes)), list(map(itemgetter(1), boxes))
        if not set(map(type, offsets)) | set(map(type, sizes)) <= {torch.Size, tuple}:
            offsets, sizes = list(map(tuple, offsets)), list(map(tuple, sizes))
            boxes = list(zip(offsets, sizes))
        ndim = len(size)
        if offsets and (set(map(len, offsets)) != {ndim} or set(map(len, sizes)) != {ndim}):
            return None
        if offsets and ndim:
            starts, lengths = list(chain.from_iterable(offsets)), list(chain.from_iterable(sizes))
            if set(map(type, starts)) != {int} or set(map(type, lengths)) != {int}:
                return None
            if min(starts) < 0 or min(lengths) < 0 or not all(map(le, map(add, starts, lengths), cycle(size))):
                return None
    except (AttributeError, TypeError):
        return None
    return boxes

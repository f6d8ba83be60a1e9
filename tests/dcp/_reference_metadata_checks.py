"""nvdcp's ``.metadata`` checks as they were before the scale work (docs/SCALE.md), kept as the
reference the faster ones must agree with, error for error (tests/dcp/test_metadata_checks_fast.py)."""

from __future__ import annotations

import math
import pickle
import pickletools

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from nvdcp.errors import CorruptCheckpointError
from nvdcp.storage.base import check_name

MAX_RECORD_BYTES = 1 << 62


def _opcode_table() -> dict[int, tuple[int, int]]:
    table: dict[int, tuple[int, int]] = {}
    for op in pickletools.opcodes:
        code, n = ord(op.code), op.arg.n if op.arg is not None else 0
        if op.arg is None:
            table[code] = (0, 0)
        elif n >= 0:
            table[code] = (1, n)
        elif n == pickletools.UP_TO_NEWLINE:
            table[code] = (2, 2 if op.name in ("GLOBAL", "INST") else 1)
        else:
            table[code] = (3, {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
                               pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}[n])
    return table


_OPCODES = _opcode_table()
_PUT, _LONG_BINPUT, _STOP = ord(pickle.PUT), ord(pickle.LONG_BINPUT), ord(pickle.STOP)


def check_memo_indices(blob: bytes, where: str) -> None:
    n, i, table, frombytes = len(blob), 0, _OPCODES, int.from_bytes
    try:
        while i < n:
            code = blob[i]
            i += 1
            kind, k = table[code]
            if kind == 1:
                if code == _LONG_BINPUT and frombytes(blob[i : i + 4], "little") > n:
                    raise CorruptCheckpointError(f"{where}: cannot unpickle: memo index beyond the data")
                i += k
            elif kind == 3:
                i += k + frombytes(blob[i : i + k], "little")
            elif kind == 2:
                start = i
                for _ in range(k):
                    i = blob.index(b"\n", i) + 1
                if code == _PUT and int(blob[start : i - 1]) > n:
                    raise CorruptCheckpointError(f"{where}: cannot unpickle: memo index beyond the data")
            elif code == _STOP:
                return
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
    _check_layout(metadata, where)


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
    for fqn, md in sdm.items():
        if isinstance(md, TensorStorageMetadata):
            boxes = _tile(fqn, md, where)
            for offsets, _ in boxes:
                if MetadataIndex(fqn, offsets) not in records:
                    raise CorruptCheckpointError(f"{where}: item {fqn!r} chunk at {list(offsets)} has no storage record")
        elif isinstance(md, BytesStorageMetadata):
            if MetadataIndex(fqn) not in records:
                raise CorruptCheckpointError(f"{where}: item {fqn!r} has no storage record")
        else:
            raise CorruptCheckpointError(f"{where}: item {fqn!r} is described by {type(md).__name__}")
    for index in records:
        if getattr(index, "fqn", None) not in sdm:
            raise CorruptCheckpointError(f"{where}: storage record for unknown item {getattr(index, 'fqn', index)!r}")


def _tile(fqn: str, md: TensorStorageMetadata, where: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    import torch

    size = tuple(md.size)
    if not isinstance(md.properties.dtype, torch.dtype):
        raise CorruptCheckpointError(f"{where}: item {fqn!r} has no dtype")
    boxes = []
    total = 0
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
        total += math.prod(sizes)
    if total != math.prod(size):
        raise CorruptCheckpointError(
            f"{where}: item {fqn!r} chunks hold {total} elements, the tensor has {math.prod(size)}"
        )
    # Same volume and all inside: any overlap leaves a gap. Sweep along the dimension the
    # chunks are cut along most (the shard dimension), so a 1-D sharding costs O(n log n).
    solid = [b for b in boxes if all(b[1])]
    d = max(range(len(size)), key=lambda k: len({o[k] for o, _ in solid}), default=0)
    solid.sort(key=lambda b: b[0][d] if size else 0)
    for i, (off_a, len_a) in enumerate(solid):
        for off_b, len_b in solid[i + 1 :]:
            if size and off_b[d] >= off_a[d] + len_a[d]:
                break
            if all(ob < oa + la and oa < ob + lb for oa, la, ob, lb in zip(off_a, len_a, off_b, len_b)):
                raise CorruptCheckpointError(
                    f"{where}: item {fqn!r} chunks at {list(off_a)} and {list(off_b)} overlap"
                )
    return boxes

"""The faster ``.metadata`` checks (docs/SCALE.md) refuse exactly what the per-item ones refused,
with the same message: compared error for error with the reference (the code before, in
tests/dcp/_reference_metadata_checks.py) over damaged pickles and damaged metadata; plus the
quadratic costs that are gone (chunk lookup per item in the save report, slice per chunk in the
overlap sweep) and the garbage collector paused while unpickling.
"""

from __future__ import annotations

import copy
import gc
import pickle
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from nvdcp import report as report_module
from nvdcp.dcp import metadata_io
from nvdcp.errors import CorruptCheckpointError
from nvdcp.report import Report
from tests.dcp import _reference_metadata_checks as reference

DESC = ("nvdcp.zstd/1",)


def _tensor(size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in boxes],
    )


def sample() -> Metadata:
    """Row shards, column shards, one empty shard at the end, a 0-d tensor, a tensor whole in one
    chunk and a bytes item."""
    sdm: dict[str, Any] = {
        "a": _tensor((8, 3), [((2 * r, 0), (2, 3)) for r in range(4)]),
        "b": _tensor((3,), [((0,), (1,)), ((1,), (1,)), ((2,), (1,)), ((3,), (0,))]),
        "c": _tensor((4, 6), [((0, 2 * r), (4, 2)) for r in range(3)]),
        "s": _tensor((), [((), ())]),
        "w": _tensor((5, 2), [((0, 0), (5, 2))]),  # whole in one chunk (the single-chunk fast path)
        "bytes": BytesStorageMetadata(),
    }
    records: dict[MetadataIndex, Any] = {}
    offset = 0
    for fqn, md in sdm.items():
        chunks = md.chunks if isinstance(md, TensorStorageMetadata) else [None]
        for i, chunk in enumerate(chunks):
            name = f"__{i % 2}_0123456789ab_0.nvdcp"
            index = MetadataIndex(fqn, None if chunk is None else chunk.offsets, i)
            records[index] = _StorageInfo(name, offset, 10 + i, DESC)
            offset += 10 + i
    return Metadata(sdm, storage_data=records, storage_meta=StorageMeta("x", "y"))


def outcome(check: Callable[[Metadata, str], None], md: Metadata) -> str | None:
    try:
        check(md, "W")
    except CorruptCheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


# -- targeted damage -----------------------------------------------------------------------------
def _chunk(md: Metadata, fqn: str, i: int) -> ChunkStorageMetadata:
    return md.state_dict_metadata[fqn].chunks[i]  # type: ignore[union-attr]


def _record(md: Metadata, n: int) -> tuple[Any, Any]:
    return list(md.storage_data.items())[n]


def _set_record_field(n: int, field: str, value: Any) -> Callable[[Metadata], None]:
    def damage(md: Metadata) -> None:
        _record(md, n)[1].__dict__[field] = value
    return damage


def _set_chunk(fqn: str, i: int, field: str, value: Any) -> Callable[[Metadata], None]:
    def damage(md: Metadata) -> None:
        setattr(_chunk(md, fqn, i), field, value)
    return damage


def _replace_record(n: int, value: Any) -> Callable[[Metadata], None]:
    def damage(md: Metadata) -> None:
        md.storage_data[_record(md, n)[0]] = value
    return damage


def _drop_record(n: int) -> Callable[[Metadata], None]:
    def damage(md: Metadata) -> None:
        del md.storage_data[_record(md, n)[0]]
    return damage


def _add_record(key: Any) -> Callable[[Metadata], None]:
    def damage(md: Metadata) -> None:
        md.storage_data[key] = _StorageInfo("__0_0123456789ab_0.nvdcp", 0, 1, DESC)
    return damage


def _del_attr(n: int, field: str) -> Callable[[Metadata], None]:
    def damage(md: Metadata) -> None:
        del _record(md, n)[1].__dict__[field]
    return damage


DAMAGE: dict[str, Callable[[Metadata], None]] = {
    "none": lambda md: None,
    "negative offset": _set_record_field(3, "offset", -1),
    "float length": _set_record_field(5, "length", 10.0),
    "bool offset": _set_record_field(0, "offset", True),
    "huge length": _set_record_field(2, "length", 1 << 62),
    "escaping name": _set_record_field(4, "relative_path", "../etc/passwd"),
    "name not a string": _set_record_field(4, "relative_path", 7),
    "list name": _set_record_field(4, "relative_path", ["a"]),
    "descriptor list": _set_record_field(1, "transform_descriptors", ["nvdcp.zstd/1"]),
    "descriptor ints": _set_record_field(1, "transform_descriptors", (1, 2)),
    "descriptor string": _set_record_field(1, "transform_descriptors", "nvdcp.zstd/1"),
    "no descriptors": _set_record_field(1, "transform_descriptors", None),
    "missing offset": _del_attr(6, "offset"),
    "missing descriptors": _del_attr(6, "transform_descriptors"),
    "record of another class": _replace_record(2, ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))),
    "record is None": _replace_record(7, None),
    "dropped chunk record": _drop_record(9),
    "dropped bytes record": _drop_record(len(sample().storage_data) - 1),
    "unknown item": _add_record(MetadataIndex("nope", torch.Size([0]))),
    "key of another class": _add_record("a"),
    "chunk outside": _set_chunk("a", 2, "offsets", torch.Size([7, 0])),
    "chunk negative": _set_chunk("a", 1, "offsets", torch.Size([-2, 0])),
    "chunk wrong rank": _set_chunk("c", 0, "sizes", torch.Size([4])),
    "chunk float": _set_chunk("b", 1, "sizes", (1.0,)),
    "chunk bool": _set_chunk("b", 0, "offsets", (False,)),
    "chunk sizes None": _set_chunk("a", 3, "sizes", None),
    "chunk offsets missing": lambda md: delattr(_chunk(md, "a", 0), "offsets"),
    "overlap, same volume": lambda md: (
        _set_chunk("a", 1, "offsets", torch.Size([1, 0]))(md), _set_chunk("a", 0, "sizes", torch.Size([1, 3]))(md),
        _set_chunk("a", 3, "sizes", torch.Size([3, 3]))(md),
    ),
    "columns overlap": _set_chunk("c", 1, "offsets", torch.Size([0, 1])),
    "empty shard outside": _set_chunk("b", 3, "offsets", torch.Size([4])),
    "duplicate chunk": lambda md: md.state_dict_metadata["b"].chunks.append(_chunk(md, "b", 0)),  # type: ignore[union-attr]
    "size a string": lambda md: setattr(md.state_dict_metadata["a"], "size", ("8", 3)),
    "no dtype": lambda md: setattr(md.state_dict_metadata["a"].properties, "dtype", "float32"),  # type: ignore[union-attr]
    "whole chunk bool offset": _set_chunk("w", 0, "offsets", (False, 0)),
    "whole chunk float size": _set_chunk("w", 0, "sizes", (5.0, 2)),
    "whole chunk too large": _set_chunk("w", 0, "sizes", torch.Size([6, 2])),
    "whole chunk too small": _set_chunk("w", 0, "sizes", torch.Size([4, 2])),
    "whole chunk moved": _set_chunk("w", 0, "offsets", torch.Size([1, 0])),
    "whole chunk wrong rank": _set_chunk("w", 0, "sizes", torch.Size([10])),
    "whole chunk sizes None": _set_chunk("w", 0, "sizes", None),
    "whole chunk of a negative size": lambda md: (
        setattr(md.state_dict_metadata["w"], "size", torch.Size([-5, 2])),
        _set_chunk("w", 0, "sizes", torch.Size([-5, 2]))(md),
    ),
    "whole chunk of a zero size": lambda md: (
        setattr(md.state_dict_metadata["w"], "size", torch.Size([0, 2])),
        _set_chunk("w", 0, "sizes", torch.Size([0, 2]))(md),
    ),
    "chunks None": lambda md: setattr(md.state_dict_metadata["c"], "chunks", None),
    "chunks missing": lambda md: delattr(md.state_dict_metadata["c"], "chunks"),
    "described by a chunk": lambda md: md.state_dict_metadata.__setitem__("s", _chunk(md, "a", 0)),
    "no records": lambda md: setattr(md, "storage_data", None),
    "no sdm": lambda md: setattr(md, "state_dict_metadata", []),
    "two damages": lambda md: (_set_chunk("a", 2, "offsets", torch.Size([7, 0]))(md), _drop_record(12)(md)),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_metadata_refused_as_before(damage: str) -> None:
    md = sample()
    DAMAGE[damage](md)
    got, want = outcome(metadata_io.check_records, md), outcome(reference.check_records, md)
    assert got == want
    assert (want is None) == (damage in (
        "none", "no descriptors", "missing descriptors", "descriptor list", "whole chunk of a zero size",
    ))


POOL = [-1, 0, 1, 2, 3, 4, 6, 7, 8, 100, 1.0, True, None, "2", (0,), (1, 0), (0, 0, 0)]


def _random_damage(md: Metadata, rng: random.Random) -> None:
    fqn = rng.choice(["a", "b", "c", "s"])
    chunks = md.state_dict_metadata[fqn].chunks  # type: ignore[union-attr]
    what = rng.randrange(6)
    if what < 3:
        chunk = rng.choice(chunks)
        field = rng.choice(["offsets", "sizes"])
        values = list(getattr(chunk, field))
        if values and what < 2:
            values[rng.randrange(len(values))] = rng.choice(POOL)
            setattr(chunk, field, tuple(values))
        else:
            setattr(chunk, field, rng.choice(POOL[-3:]))
    elif what == 3:
        key, info = _record(md, rng.randrange(len(md.storage_data)))
        field = rng.choice(["offset", "length", "relative_path", "transform_descriptors"])
        info.__dict__[field] = rng.choice([*POOL, "../x", "ok.nvdcp", ("nvdcp.x/1",), ["y"]])
    elif what == 4:
        _drop_record(rng.randrange(len(md.storage_data)))(md)
    else:
        chunks.append(ChunkStorageMetadata(torch.Size(rng.choice([(0, 0), (1,), (2, 1)])), torch.Size(rng.choice([(1, 1), (1,)]))))


def test_random_damage_refused_as_before() -> None:
    rng = random.Random(1234)
    refused = 0
    for _ in range(600):
        md = sample()
        for _ in range(rng.randint(1, 3)):
            try:
                _random_damage(md, rng)
            except (TypeError, ValueError, IndexError):
                pass  # torch.Size refuses some values; keep what was applied
        want = outcome(reference.check_records, md)
        assert outcome(metadata_io.check_records, md) == want
        refused += want is not None
    assert refused > 400


# -- the memo-index pre-scan ---------------------------------------------------------------------
def scan_outcome(check: Callable[[bytes, str], None], blob: bytes) -> str | None:
    try:
        check(blob, "W")
    except CorruptCheckpointError as exc:
        return str(exc)
    return None


INTERESTING = [pickle.LONG_BINPUT, pickle.PUT, pickle.STOP, pickle.BINUNICODE, pickle.SHORT_BINUNICODE,
               pickle.FRAME, pickle.BINPUT, pickle.MEMOIZE, pickle.GLOBAL, b"\n", b"\xff", b"\x00"]


@pytest.fixture(params=["native", "regex"])
def scan_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The memo scan with the native library's step (skipped where it is not built) or the regex's."""
    if request.param == "native":
        if metadata_io._native_pickle_skip() is None:
            pytest.skip("the native library is not built (python setup.py build_ext --inplace)")
    else:
        monkeypatch.setattr(metadata_io, "_native_pickle_skip", lambda: None)
    return str(request.param)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_memo_scan_agrees_on_damaged_pickles(protocol: int, scan_path: str) -> None:
    blob = pickle.dumps(sample(), protocol=protocol)
    assert scan_outcome(metadata_io.check_memo_indices, blob) is None
    rng = random.Random(protocol)
    for _ in range(400):
        damaged = bytearray(blob)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(damaged))
            kind = rng.randrange(4)
            if kind == 0:
                damaged[at] = rng.randrange(256)
            elif kind == 1:
                damaged[at : at + 1] = rng.choice(INTERESTING)
            elif kind == 2:
                damaged[at : at + 5] = pickle.LONG_BINPUT + rng.randrange(1 << 32).to_bytes(4, "little")
            else:
                del damaged[at:]
        data = bytes(damaged)
        assert scan_outcome(metadata_io.check_memo_indices, data) == scan_outcome(reference.check_memo_indices, data)


def test_memo_scan_still_catches_a_huge_index_after_a_long_run(scan_path: str) -> None:
    blob = pickle.dumps(sample(), protocol=5)
    stop = blob.rindex(pickle.STOP)
    bad = blob[:stop] + pickle.LONG_BINPUT + (len(blob) + 10).to_bytes(4, "little") + blob[stop:]
    assert "memo index beyond the data" in str(scan_outcome(metadata_io.check_memo_indices, bad))


def test_memo_scan_of_counted_arguments_cut_off_by_the_end(scan_path: str) -> None:
    """Opcodes whose count or argument runs past the end: refused as the reference does."""
    for tail in (pickle.BINUNICODE + (1 << 31).to_bytes(4, "little"), pickle.BINUNICODE8 + b"\xff" * 8,
                 pickle.SHORT_BINUNICODE + b"\x09abc", pickle.SHORT_BINUNICODE, pickle.BINUNICODE + b"\x01",
                 pickle.LONG_BINPUT + b"\x01\x00", pickle.BININT + b"\x00"):
        data = pickle.PROTO + b"\x04" + tail
        assert scan_outcome(metadata_io.check_memo_indices, data) == scan_outcome(reference.check_memo_indices, data)
        assert scan_outcome(metadata_io.check_memo_indices, data) is not None


# -- costs that grew faster than the checkpoint ----------------------------------------------------
def _sharded(ranks: int, fqns: int = 2) -> Metadata:
    sdm: dict[str, Any] = {}
    records: dict[MetadataIndex, Any] = {}
    for f in range(fqns):
        fqn = f"layer{f}.weight"
        sdm[fqn] = _tensor((ranks * 2, 5), [((2 * r, 0), (2, 5)) for r in range(ranks)])
        for r, chunk in enumerate(sdm[fqn].chunks):
            records[MetadataIndex(fqn, chunk.offsets, r)] = _StorageInfo(f"__{r}_0123456789ab_0.nvdcp", 8 * f, 8, DESC)
    sdm["extra"] = BytesStorageMetadata()
    records[MetadataIndex("extra")] = _StorageInfo("__0_0123456789ab_0.nvdcp", 99, 7, DESC)
    return Metadata(sdm, storage_data=records)


def _report_before(md: Metadata) -> tuple[int, int, int]:
    """Report.from_metadata's totals as it computed them before (a chunk scan per item)."""
    raw_total = stored_total = items = 0
    for index, info in md.storage_data.items():
        sdm_md = md.state_dict_metadata.get(index.fqn)
        raw = info.length
        if sdm_md is not None and not isinstance(sdm_md, BytesStorageMetadata):
            chunk = next((c for c in sdm_md.chunks if list(c.offsets) == list(index.offset or [])), None)
            if chunk is not None:
                raw = int(torch.Size(chunk.sizes).numel()) * torch.empty((), dtype=sdm_md.properties.dtype).element_size()
        raw_total, stored_total, items = raw_total + raw, stored_total + info.length, items + (1 if raw or info.length else 0)
    return raw_total, stored_total, items


def test_save_report_totals_unchanged() -> None:
    odd = sample()
    odd.state_dict_metadata["z"] = _tensor((), [((), ())])  # its record has no offsets: matches ()
    odd.storage_data[MetadataIndex("z")] = _StorageInfo("x", 0, 5, DESC)
    odd.state_dict_metadata["dup"] = _tensor((3,), [((0,), (2,)), ((0,), (3,))])  # the first counts
    odd.storage_data[MetadataIndex("dup", torch.Size([0]))] = _StorageInfo("x", 0, 6, DESC)
    odd.storage_data[MetadataIndex("b", torch.Size([5]))] = _StorageInfo("x", 0, 0, DESC)  # no chunk there
    odd.state_dict_metadata["lst"] = _tensor((4,), [((0,), (4,))])
    odd.state_dict_metadata["lst"].chunks[0].offsets = [0]  # type: ignore[union-attr]  (a list: unhashable)
    odd.storage_data[MetadataIndex("lst", torch.Size([0]))] = _StorageInfo("x", 0, 9, DESC)
    wrong_hints = _sharded(8)  # hints that point at other chunks: the table decides
    wrong_hints.storage_data = {
        MetadataIndex(k.fqn, k.offset, None if k.index is None else (k.index + 1) % 8): v
        for k, v in wrong_hints.storage_data.items()
    }
    no_hints = _sharded(8)
    no_hints.storage_data = {MetadataIndex(k.fqn, k.offset): v for k, v in no_hints.storage_data.items()}
    for md, by_hint in ((sample(), True), (_sharded(50), True), (odd, False), (wrong_hints, False), (no_hints, False)):
        md.storage_data[MetadataIndex("not-in-sdm")] = _StorageInfo("x", 0, 3, DESC)
        report = Report.from_metadata("save", "u", md)
        assert (report.raw_bytes, report.stored_bytes, report.items) == _report_before(md)
        keys, lengths = list(md.storage_data), [v.length for v in md.storage_data.values()]
        hinted = report_module._totals_by_hint(md.state_dict_metadata, keys, lengths)
        assert (hinted is not None) == by_hint
        assert report_module._totals_by_table(md.state_dict_metadata, keys, lengths) == (report.raw_bytes, report.items)


def test_save_report_with_known_raw_bytes_counts_the_rest_as_before() -> None:
    """A one-rank save passes its own raw total: stored bytes and items as the full count
    gives them; a record storing no bytes sends it to the full count (items then differ)."""
    md = _sharded(8)
    full = Report.from_metadata("save", "u", md)
    quick = Report.from_metadata("save", "u", md, raw_bytes=12345)
    assert (quick.raw_bytes, quick.stored_bytes, quick.items) == (12345, full.stored_bytes, full.items)
    md.storage_data[MetadataIndex("b", torch.Size([5]))] = _StorageInfo("x", 0, 0, DESC)  # stores nothing
    full = Report.from_metadata("save", "u", md)
    counted = Report.from_metadata("save", "u", md, raw_bytes=777)
    assert (counted.raw_bytes, counted.items) == (777, full.items) and full.items == len(md.storage_data) - 1


def test_save_report_is_linear_in_ranks() -> None:
    """40,000 chunks per tensor: the scan per item took minutes (800M list comparisons)."""
    md = _sharded(40_000)
    t0 = time.process_time()
    report = Report.from_metadata("save", "u", md)
    assert time.process_time() - t0 < 10
    assert report.raw_bytes == 2 * 40_000 * 2 * 5 * 4 + 7


def test_overlap_sweep_is_linear_in_chunks() -> None:
    """100,000 row shards: the sweep copied the rest of the list per chunk (5e9 pointers)."""
    md = _sharded(100_000, fqns=1)
    t0 = time.process_time()
    metadata_io.check_records(md, "W")
    assert time.process_time() - t0 < 10


def test_layout_check_scales_and_still_finds_one_bad_chunk() -> None:
    md = _sharded(20_000, fqns=1)
    md.state_dict_metadata["layer0.weight"].chunks[12_345].offsets = torch.Size([2 * 12_345 + 1, 0])  # type: ignore[union-attr]
    assert outcome(metadata_io.check_records, md) == outcome(reference.check_records, md)
    assert "overlap" in str(outcome(metadata_io.check_records, md))


# -- unpickling without the garbage collector ------------------------------------------------------
class _Store:
    url = "mem://"

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def read(self, name: str) -> bytes:
        return self.blob

    def describe(self, name: str) -> str:
        return f"mem://{name}"


@pytest.mark.parametrize("enabled", [True, False])
def test_collector_paused_while_unpickling_and_restored(enabled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    real = metadata_io._MetadataUnpickler.load

    def load(self: Any) -> Any:
        seen.append(gc.isenabled())
        return real(self)

    monkeypatch.setattr(metadata_io._MetadataUnpickler, "load", load)
    (gc.enable if enabled else gc.disable)()
    try:
        md = metadata_io.load_metadata(_Store(pickle.dumps(sample())))  # type: ignore[arg-type]
        assert seen == [False] and gc.isenabled() == enabled
        assert md.state_dict_metadata.keys() == sample().state_dict_metadata.keys()
        with pytest.raises(CorruptCheckpointError):
            metadata_io.load_metadata(_Store(pickle.dumps(sample())[:-30] + pickle.STOP))  # type: ignore[arg-type]
        assert gc.isenabled() == enabled
    finally:
        gc.enable()


def test_sample_is_deep_copyable_and_valid() -> None:
    md = copy.deepcopy(sample())
    metadata_io.check_records(md, "W")


def test_metadata_of_16k_ranks_is_within_the_size_bound() -> None:
    """A 7B model's FSDP2 save on 16,384 ranks: 14.3M items of about 200 bytes (docs/SCALE.md)."""
    assert metadata_io.MAX_METADATA_BYTES >= 16_384 * 873 * 200 * 2


def test_one_full_collection_only_when_the_metadata_is_a_large_share_of_the_heap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A .metadata that is most of the process gets its full pass at once (else the collector's
    young passes, then a full one, walk it during the rank's planning); a small one in a large
    heap is left to the young passes (a full pass would walk the whole heap for it)."""
    assert metadata_io._collect_now(1_000_000, 1_500_000)  # a third of the blocks: new
    assert not metadata_io._collect_now(1_000_000, 1_010_000)
    collected: list[int] = []
    monkeypatch.setattr(metadata_io.gc, "collect", lambda *a: collected.append(1) or 0)
    blob = pickle.dumps(sample())
    for share, expected in ((0.0, [1]), (1.0, [])):
        collected.clear()
        monkeypatch.setattr(metadata_io, "COLLECT_ABOVE_SHARE", share)
        metadata_io.load_metadata(_Store(blob))  # type: ignore[arg-type]
        assert collected == expected


def test_the_new_objects_are_walked_by_one_collection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass that ages a large .metadata's objects runs before the collector is back on: the
    first allocation after re-enabling it would otherwise start a young pass over all of them
    first (two walks of the same objects: about 20 ms of 45 per 20,000 items on the CPU machine)."""
    sdm: dict[str, Any] = {f"t{i}": _tensor((4,), [((0,), (4,))]) for i in range(3000)}
    records = {MetadataIndex(f"t{i}", torch.Size((0,)), 0): _StorageInfo("__0_0.nvdcp", 10 * i, 10, DESC)
               for i in range(3000)}
    blob = pickle.dumps(Metadata(sdm, storage_data=records, storage_meta=StorageMeta("x", "y")))
    monkeypatch.setattr(metadata_io, "COLLECT_ABOVE_SHARE", 0.0)  # this one is collected at once
    passes: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            passes.append(info["generation"])

    gc.collect()
    gc.callbacks.append(seen)
    try:
        metadata_io.load_metadata(_Store(blob))  # type: ignore[arg-type]
        [object() for _ in range(10)], [[] for _ in range(10)]  # allocations: a pending young pass starts here
    finally:
        gc.callbacks.remove(seen)
    assert passes == [1]

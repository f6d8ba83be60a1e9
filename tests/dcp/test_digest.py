"""Save digests (docs/FORMAT.md, "Save digests"): recorded per item in .metadata at no extra pass,
equal for equal data, checked by verify, compared by diff, and the stale-save warning/error."""

from __future__ import annotations

import logging
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

import nvdcp
from nvdcp.dcp.commit import ItemRecord, forget_previous_saves, same_items, split_results
from nvdcp.dcp.metadata_io import load_metadata
from nvdcp.format.digest import (
    DIGEST_ATTR,
    digest_of_header,
    digest_record,
    pack_digests,
    read_digests,
    unpack_digests,
)
from nvdcp.format.header import ItemHeader, checksum, parse_item_header, parse_item_header_only
from nvdcp.inspection import diff_checkpoints
from nvdcp.storage import open_storage
from tests._dist import run_ranks
from tests.dcp.helpers import failure_of, load, save

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "v1"


@pytest.fixture(autouse=True)
def _fresh_history() -> Any:
    """Every test starts with a process that has committed no save (the stale check's memory)."""
    forget_previous_saves()
    yield
    forget_previous_saves()


def _state(seed: int = 3) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(200, 64, generator=g) * 0.02,
            "b16": (torch.randn(33, 40, generator=g) * 0.02).bfloat16(),
            "ids": torch.arange(3000),
            "empty": torch.zeros(0, 4),
        },
        "step": torch.tensor(11.0),
        "note": {"lr": 0.1},
    }


def _metadata(path: str | os.PathLike[str]) -> Any:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)


def _by_fqn(path: str | os.PathLike[str]) -> dict[str, int]:
    recorded = read_digests(_metadata(path))
    assert recorded.status == "recorded" and recorded.by_index is not None
    return {ix.fqn: d for ix, d in recorded.by_index.items()}


def _header_digests(path: str | os.PathLike[str]) -> dict[MetadataIndex, int]:
    """Each item's digest computed from the header stored in its data file."""
    md = _metadata(path)
    out = {}
    for ix, info in md.storage_data.items():
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            out[ix] = digest_of_header(parse_item_header(memoryview(f.read(info.length)), "test"))
    return out


# -- what a save records -------------------------------------------------------------------------
def test_identical_saves_record_equal_digests_and_a_changed_item_only_its_own(tmp_path: Path) -> None:
    sd = _state()
    save(sd, tmp_path / "a")
    save(sd, tmp_path / "b", thread_count=2)  # another file layout: digests do not depend on where
    a, b = _by_fqn(tmp_path / "a"), _by_fqn(tmp_path / "b")
    assert a == b and len(a) == 6
    sd["model"]["w"][3, 5] += 1.0
    save(sd, tmp_path / "c")
    c = _by_fqn(tmp_path / "c")
    assert {k for k in a if a[k] != c[k]} == {"model.w"}
    # the digest is the stored header's CRC32C: no pass over the data
    assert {ix.fqn: d for ix, d in _header_digests(tmp_path / "c").items()} == c


def test_metadata_stays_a_stock_pickle(tmp_path: Path) -> None:
    """storage_data holds torch's own _StorageInfo records; the digest record is an extra
    attribute of plain values, so pickle.load, stock FileSystemReader and nvdcp's restricted
    unpickler all read the .metadata."""
    save(_state(), tmp_path)
    md = _metadata(tmp_path)
    assert type(md) is Metadata
    assert {type(info) for info in md.storage_data.values()} == {_StorageInfo}
    record = getattr(md, DIGEST_ATTR)
    assert record["version"] == 1 and record["count"] == len(md.storage_data)
    assert {type(v) for v in record.values()} <= {int, str, bytes}
    stock = FileSystemReader(tmp_path).read_metadata()
    assert stock.state_dict_metadata.keys() == md.state_dict_metadata.keys()
    assert getattr(stock, DIGEST_ATTR) == record
    strict = load_metadata(open_storage(tmp_path))
    assert read_digests(strict).by_index == read_digests(md).by_index


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_the_record_survives_every_pickle_protocol(tmp_path: Path, protocol: int) -> None:
    """Protocols 0-2 spell bytes as ``_codecs.encode(str, "latin1")``: the restricted unpickler
    admits exactly that (and nothing else of ``_codecs``)."""
    save(_state(), tmp_path)
    md = _metadata(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md, protocol=protocol))
    strict = load_metadata(open_storage(tmp_path))
    assert read_digests(strict).by_index == read_digests(md).by_index
    assert nvdcp.verify_checkpoint(tmp_path).digests == "checked"


class _Rot13:
    def __reduce__(self) -> Any:
        import codecs

        return (codecs.encode, ("payload", "rot13"))


def test_other_codecs_calls_are_refused(tmp_path: Path) -> None:
    save(_state(), tmp_path)
    md = _metadata(tmp_path)
    setattr(md, DIGEST_ATTR, _Rot13())
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md, protocol=2))
    with pytest.raises(nvdcp.CorruptCheckpointError, match="_codecs.encode"):
        load_metadata(open_storage(tmp_path))


def test_metadata_grows_by_about_four_bytes_per_item(tmp_path: Path) -> None:
    sd = {f"layer{i}.w": torch.full((4, 4), float(i)) for i in range(400)}
    writer = nvdcp.NvcompWriter(tmp_path / "off")
    writer._record_digests = False
    dcp.save(sd, storage_writer=writer)
    assert read_digests(_metadata(tmp_path / "off")).status == "absent"
    save(sd, tmp_path / "on")
    off, on = (os.path.getsize(tmp_path / p / ".metadata") for p in ("off", "on"))
    assert 4 * 400 <= on - off <= 4 * 400 + 200, (off, on)
    assert on / off < 1.05


def test_write_results_carry_the_digest_and_finish_splits_them() -> None:
    info = _StorageInfo("f", 0, 10, ("nvdcp.zstd/1",))
    rec = ItemRecord(info, 0xDEADBEEF)
    again = pickle.loads(pickle.dumps(rec))
    assert again == rec and again.info == info
    a, b = MetadataIndex("a"), MetadataIndex("b", [0])
    storage_md, digests = split_results([[WriteResult(a, 10, rec)], [WriteResult(b, 10, ItemRecord(info, 7))]])
    assert storage_md == {a: info, b: info} and all(type(v) is _StorageInfo for v in storage_md.values())
    assert digests is not None and list(unpack_digests(digests)) == [0xDEADBEEF, 7]
    # a rank without digests (older writer, or switched off): no digests, torch's records as ever
    storage_md, digests = split_results([[WriteResult(a, 10, rec)], [WriteResult(b, 10, info)]])
    assert digests is None and storage_md == {a: info, b: info}
    assert split_results([[WriteResult(a, 10, info)]]) == ({a: info}, None)
    # an index twice (the dict keeps the first position, the last record): digests follow
    storage_md, digests = split_results([[WriteResult(a, 10, ItemRecord(info, 1))],
                                         [WriteResult(a, 10, ItemRecord(info, 2)), WriteResult(b, 10, rec)]])
    assert list(storage_md) == [a, b] and digests is not None and list(unpack_digests(digests)) == [2, 0xDEADBEEF]


def test_same_items_ignores_order_but_not_content() -> None:
    x = pack_digests([1, 2, 3, 3])
    assert same_items(x, pack_digests([3, 1, 3, 2]))
    assert not same_items(x, pack_digests([1, 2, 3, 4]))
    assert not same_items(x, pack_digests([1, 2, 3]))
    assert not same_items(x, pack_digests([0, 3, 3, 3]))  # same sum, another multiset


# -- verify ----------------------------------------------------------------------------------------
def test_verify_checks_digests_and_golden_checkpoints_verify_without(tmp_path: Path) -> None:
    save(_state(), tmp_path)
    report = nvdcp.verify_checkpoint(tmp_path)
    assert report.ok and report.digests == "checked"
    for name in ("zstd", "none", "gdeflate"):
        old = nvdcp.verify_checkpoint(GOLDEN / name)
        assert old.ok and old.digests == "absent", name


def _rewrite_metadata(path: Path, edit: Any) -> None:
    md = _metadata(path)
    edit(md)
    (path / ".metadata").write_bytes(pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL))


def test_verify_reports_an_item_whose_recorded_digest_differs(tmp_path: Path) -> None:
    save(_state(), tmp_path)
    md = _metadata(tmp_path)
    victim = next(i for i, ix in enumerate(md.storage_data) if ix.fqn == "model.b16")

    def tamper(md: Any) -> None:
        values = list(unpack_digests(getattr(md, DIGEST_ATTR)["digests"]))
        values[victim] ^= 1
        setattr(md, DIGEST_ATTR, digest_record(pack_digests(values)))  # a self-consistent record

    _rewrite_metadata(tmp_path, tamper)
    report = nvdcp.verify_checkpoint(tmp_path, decode=False)
    assert [(d.item, d.kind) for d in report.damaged] == [("'model.b16' offset (0, 0)", "digest")]
    assert "not the one saved" in report.damaged[0].error


def test_verify_reports_a_damaged_digest_record(tmp_path: Path) -> None:
    save(_state(), tmp_path)

    def damage(md: Any) -> None:
        getattr(md, DIGEST_ATTR)["digests"] = bytes(len(getattr(md, DIGEST_ATTR)["digests"]))  # CRC no longer fits

    _rewrite_metadata(tmp_path, damage)
    report = nvdcp.verify_checkpoint(tmp_path)
    assert report.digests == "damaged"
    assert [(d.item, d.kind) for d in report.damaged] == [("(digest record)", "digest")]


def test_a_newer_digest_record_is_skipped_not_failed(tmp_path: Path) -> None:
    save(_state(), tmp_path)
    _rewrite_metadata(tmp_path, lambda md: getattr(md, DIGEST_ATTR).update(version=2))
    report = nvdcp.verify_checkpoint(tmp_path)
    assert report.ok and report.digests == "unsupported" and "newer" in report.digest_note


def test_verify_catches_a_record_rewritten_with_a_self_consistent_header(tmp_path: Path) -> None:
    """An item replaced after the save by another valid record (header CRC and chunk CRCs all
    consistent, same length): chunk checks and decode pass; only the save digest tells."""
    sd = _state()
    path = tmp_path / "ck"
    save(sd, path, codec="none")
    shutil.copytree(path, tmp_path / "orig")
    md = _metadata(path)
    ix, info = next((ix, info) for ix, info in md.storage_data.items() if ix.fqn == "model.w")
    with open(path / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        record = bytearray(f.read(info.length))
        header = parse_item_header_only(memoryview(record), "w")
        payload = record[header.header_bytes :]
        payload[100] ^= 0x40  # one value changes
        chunks, pos = [], 0
        for size, _ in header.chunks:
            chunks.append((size, checksum(bytes(payload[pos : pos + size]))))
            pos += size
        forged = ItemHeader(
            kind=header.kind, dtype_code=header.dtype_code, shape=header.shape, raw_nbytes=header.raw_nbytes,
            transform=header.transform, plane_codecs=header.plane_codecs, chunks=tuple(chunks),
            chunk_bytes=header.chunk_bytes,
        ).pack()
        assert len(forged) == header.header_bytes
        f.seek(info.offset)
        f.write(forged + bytes(payload))
    report = nvdcp.verify_checkpoint(path)
    assert [(d.item, d.kind) for d in report.damaged] == [("'model.w' offset (0, 0)", "digest")]
    # diff trusts what was recorded at save; reading the headers shows what is stored now
    assert diff_checkpoints(tmp_path / "orig", path).identical
    assert diff_checkpoints(tmp_path / "orig", path, use_recorded=False).changed == ["model.w"]
    # without the digest record the rewrite goes unnoticed by verify: what the digest adds
    _rewrite_metadata(path, lambda md: vars(md).pop(DIGEST_ATTR))
    assert nvdcp.verify_checkpoint(path).ok


# -- diff ------------------------------------------------------------------------------------------
def test_diff_lists_exactly_what_changed(tmp_path: Path) -> None:
    sd = _state()
    save(sd, tmp_path / "a")
    sd["model"]["b16"].add_(1)
    del sd["model"]["ids"]
    sd["model"]["new"] = torch.ones(5)
    sd["step"] = torch.tensor(12.0)
    save(sd, tmp_path / "b")
    d = diff_checkpoints(tmp_path / "a", tmp_path / "b")
    assert d.sources == {"a": "recorded", "b": "recorded"}
    assert (d.added, d.removed, d.changed) == (["model.new"], ["model.ids"], ["model.b16", "step"])
    assert d.unchanged == ["model.empty", "model.w", "note.lr"] and d.unknown == [] and not d.identical
    assert diff_checkpoints(tmp_path / "b", tmp_path / "b").identical


def test_diff_without_recorded_digests_reads_headers(tmp_path: Path) -> None:
    sd = _state()
    save(sd, tmp_path / "a")
    sd["model"]["w"].mul_(2)
    save(sd, tmp_path / "b")
    _rewrite_metadata(tmp_path / "a", lambda md: vars(md).pop(DIGEST_ATTR))  # as an older save
    d = diff_checkpoints(tmp_path / "a", tmp_path / "b")
    assert d.sources == {"a": "headers", "b": "recorded"}
    assert d.changed == ["model.w"] and len(d.unchanged) == 5 and not (d.added or d.removed or d.unknown)
    # golden v1 checkpoints (no digests): one against itself, and two codecs (not comparable)
    assert diff_checkpoints(GOLDEN / "zstd", GOLDEN / "zstd").identical
    other = diff_checkpoints(GOLDEN / "zstd", GOLDEN / "none")
    assert other.sources == {"a": "headers", "b": "headers"} and not other.changed
    assert other.unknown and all("another codec" in other.reasons[f] for f in other.unknown)


def test_diff_against_a_stock_checkpoint_marks_stock_items_not_comparable(tmp_path: Path) -> None:
    sd = _state()
    save(sd, tmp_path / "a")
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "stock"))
    d = diff_checkpoints(tmp_path / "a", tmp_path / "stock")
    assert d.sources["b"] == "headers" and not (d.changed or d.added or d.removed)
    assert set(d.unknown) | set(d.unchanged) == {"model.w", "model.b16", "model.ids", "model.empty", "step", "note.lr"}
    assert all("stock" in d.reasons[f] for f in d.unknown)


# -- convert drops a digest record that no longer fits ---------------------------------------------
def test_convert_does_not_carry_digests_it_did_not_compute(tmp_path: Path) -> None:
    from nvdcp.convert import ConvertOptions, convert_checkpoint

    save(_state(), tmp_path / "a")
    convert_checkpoint(tmp_path / "a", tmp_path / "b", ConvertOptions(to="nvdcp", codec="none"))
    convert_checkpoint(tmp_path / "a", tmp_path / "s", ConvertOptions(to="stock"))
    assert read_digests(_metadata(tmp_path / "b")).status == "absent"
    assert not hasattr(_metadata(tmp_path / "s"), DIGEST_ATTR)
    assert nvdcp.verify_checkpoint(tmp_path / "b").ok


# -- stale saves -----------------------------------------------------------------------------------
def test_an_identical_save_logs_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sd = _state()
    with caplog.at_level(logging.WARNING, logger="nvdcp"):
        save(sd, tmp_path / "step1")
        sd["model"]["w"].add_(0.5)  # a real update
        save(sd, tmp_path / "step2")
        assert "byte-identical" not in caplog.text
        save(sd, tmp_path / "step3")  # a fresh writer, another directory: still the same job
    warnings = [r for r in caplog.records if "byte-identical" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert f"save to {tmp_path / 'step3'}: all 6 items" in warnings[0].getMessage()
    assert str(tmp_path / "step2") in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nvdcp"):
        save(sd, tmp_path / "step4", on_identical_save="ignore")
    assert "byte-identical" not in caplog.text


def test_error_refuses_an_identical_save_before_metadata_changes(tmp_path: Path) -> None:
    sd = _state()
    save(sd, tmp_path / "elsewhere")
    sd["model"]["w"].add_(0.5)
    save(sd, tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    with pytest.raises(CheckpointException) as info:
        save(sd, tmp_path / "ckpt", on_identical_save="error")
    err = failure_of(info.value)
    assert isinstance(err, nvdcp.StaleSaveError) and isinstance(err, nvdcp.NvdcpError)
    assert ".metadata not written" in str(err)
    # the checkpoint there is the one before, file for file (the refused save's files are gone)
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    target = _state(seed=99)
    load(target, tmp_path / "ckpt")
    assert torch.equal(target["model"]["w"], sd["model"]["w"])
    # an updated save goes through
    sd["model"]["w"].add_(0.5)
    save(sd, tmp_path / "ckpt", on_identical_save="error")


def test_on_identical_save_is_validated() -> None:
    with pytest.raises(ValueError, match="on_identical_save"):
        nvdcp.NvcompWriter("/tmp/nvdcp-never", on_identical_save="raise")
    with pytest.raises(ValueError, match="on_identical_save"):
        nvdcp.NvcompStager(on_identical_save="loud")


def test_a_stager_policy_applies_to_saves_staged_through_it(tmp_path: Path) -> None:
    stager = nvdcp.NvcompStager(cpu_mode="compress", on_identical_save="error")
    assert pickle.loads(pickle.dumps(stager)).on_identical_save == "error"
    try:
        sd = _state()
        dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "1"), async_stager=stager).result()
        # a synchronous save of the same state: digests of the staged save and this one agree
        with pytest.raises(CheckpointException) as info:
            save(sd, tmp_path / "2", stager=stager)
        assert isinstance(failure_of(info.value), nvdcp.StaleSaveError)
        fut = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "3"), async_stager=stager)
        with pytest.raises(CheckpointException) as info:
            fut.result()
        assert isinstance(failure_of(info.value), nvdcp.StaleSaveError)
        assert not (tmp_path / "3" / ".metadata").exists()
    finally:
        stager.close()


# -- two ranks -------------------------------------------------------------------------------------
def _two_rank_saves(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(5)
    sd = {
        "rows": distribute_tensor(torch.randn(64, 48, generator=g), mesh, [Shard(0)]),
        "cols": distribute_tensor(torch.randn(10, 40, generator=g).bfloat16(), mesh, [Shard(1)]),
        f"own{rank}": torch.full((7,), float(rank)),
    }
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(os.path.join(root, "a"), thread_count=2))
    try:  # only the coordinator compares, and every rank learns the save failed
        dcp.save(sd, storage_writer=nvdcp.NvcompWriter(os.path.join(root, "b"), on_identical_save="error"))
    except CheckpointException as exc:
        assert isinstance(failure_of(exc), nvdcp.StaleSaveError), exc
    else:
        raise AssertionError(f"rank {rank}: the identical save was not refused")
    dist.barrier()


@pytest.mark.timeout(180)
def test_two_ranks_digests_cover_every_rank_and_the_stale_check_spans_them(tmp_path: Path) -> None:
    run_ranks(2, _two_rank_saves, str(tmp_path))
    md = _metadata(tmp_path / "a")
    recorded = read_digests(md)
    assert recorded.by_index == _header_digests(tmp_path / "a")
    assert {info.relative_path.split("_")[2] for info in md.storage_data.values()} == {"0", "1"}
    assert {ix.fqn for ix in md.storage_data} == {"rows", "cols", "own0", "own1"} and len(md.storage_data) == 6
    assert not (tmp_path / "b" / ".metadata").exists()
    assert not [n for n in os.listdir(tmp_path / "b") if n.endswith(".nvdcp")]


def test_copied_checkpoint_compares_equal(tmp_path: Path) -> None:
    save(_state(), tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    assert diff_checkpoints(tmp_path / "a", tmp_path / "copy").identical

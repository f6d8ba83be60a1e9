"""NvcompReader reads stock DCP checkpoints (torch's FileSystemWriter / FsspecWriter: ``torch.save``
blobs, possibly through torch's stream extensions) and checkpoints mixing stock and nvdcp items,
bit-exactly, with clear errors naming file, offset and item on a bad stock blob."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

import nvdcp
from nvdcp.dcp import stock_items
from nvdcp.dcp.stock_items import DIRECT_MIN_BYTES, WHOLE_RECORD_BYTES, is_nvdcp_record
from tests.conftest import ALL_DTYPES, bit_equal, random_tensor
from tests.dcp.helpers import empty_like_sd, failure_of

pytestmark = pytest.mark.timeout(120)


def stock_state() -> dict[str, Any]:
    """Tensors of every dtype (all bit patterns), large and small, nested, and byte items."""
    sd: dict[str, Any] = {
        "model": {
            "w": torch.randn(300, 257, generator=torch.Generator().manual_seed(1)),  # > WHOLE_RECORD_BYTES
            "big": torch.randn(520, 512, generator=torch.Generator().manual_seed(3)),  # > DIRECT_MIN_BYTES
            "wt": torch.randn(600, 512, generator=torch.Generator().manual_seed(4)).t(),  # saved non-contiguous
            "b16": torch.randn(64, 100, generator=torch.Generator().manual_seed(2)).bfloat16(),
            "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 4),
        },
        "dtypes": {str(d).removeprefix("torch."): random_tensor(d, (33, 5), seed=i) for i, d in enumerate(ALL_DTYPES)},
        "extra": {"step": 17, "lr": [0.1, 0.01], "note": "bytes item", "blob": b"\x00raw\xff"},
        "ids": torch.arange(5000, dtype=torch.int64),
    }
    assert sd["model"]["w"].numel() * 4 > WHOLE_RECORD_BYTES and sd["model"]["big"].numel() * 4 > DIRECT_MIN_BYTES
    return sd


def load_target(sd: dict[str, Any]) -> dict[str, Any]:
    return empty_like_sd(sd)


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, dict):
            assert_same(got[k], v)
        elif isinstance(v, torch.Tensor):
            assert bit_equal(got[k], v), k
        else:
            assert got[k] == v, k


def nv_load(path: str | os.PathLike[str], sd: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    target = load_target(sd)
    dcp.load(target, storage_reader=nvdcp.NvcompReader(path, **kwargs))
    return target


def load_failure(path: str | os.PathLike[str], sd: dict[str, Any], **kwargs: Any) -> BaseException:
    with pytest.raises((CheckpointException, nvdcp.NvdcpError)) as info:
        nv_load(path, sd, **kwargs)
    return failure_of(info.value)


def make_mixed(nv: Path, stock: Path, out: Path, stock_fqns: set[str]) -> None:
    """A checkpoint whose items in ``stock_fqns`` come from the stock checkpoint and the rest from
    the nvdcp one (both saved from the same state dict): both sets of data files, one .metadata."""
    out.mkdir()
    md_nv = pickle.loads((nv / ".metadata").read_bytes())
    md_st = pickle.loads((stock / ".metadata").read_bytes())
    records = {ix: info for ix, info in md_nv.storage_data.items() if ix.fqn not in stock_fqns}
    records.update({ix: info for ix, info in md_st.storage_data.items() if ix.fqn in stock_fqns})
    assert {ix.fqn for ix in records} == set(md_nv.state_dict_metadata)
    md_nv.storage_data = records
    for info in records.values():
        src = stock if not is_nvdcp_record(info) else nv
        if not (out / info.relative_path).exists():
            shutil.copy(src / info.relative_path, out / info.relative_path)
    (out / ".metadata").write_bytes(pickle.dumps(md_nv))


# -- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["plain", "zstd", "2 threads"])
def test_stock_checkpoint_loads_bit_exact(tmp_path: Path, variant: str) -> None:
    sd = stock_state()
    kwargs: dict[str, Any] = {"_extensions": [ZStandard()]} if variant == "zstd" else {}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path, thread_count=2 if variant == "2 threads" else 1, **kwargs))
    assert not nvdcp.is_nvdcp_checkpoint(tmp_path)
    reader = nvdcp.NvcompReader(tmp_path)
    target = load_target(sd)
    dcp.load(target, storage_reader=reader)
    assert_same(target, sd)
    # the same values stock FileSystemReader gives, and a report of what was read
    stock = load_target(sd)
    dcp.load(stock, storage_reader=FileSystemReader(tmp_path))
    assert_same(target, stock)
    records = pickle.loads((tmp_path / ".metadata").read_bytes()).storage_data
    # every item was read but "model.empty": DCP plans no read for a tensor without elements
    assert reader.last_report is not None and reader.last_report.items == len(records) - 1


@pytest.mark.parametrize("where", ["local", "memory", "local zstd"])
def test_large_items_are_read_straight_into_their_destination(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A whole, contiguous, large stock tensor is read into the destination tensor itself (no
    intermediate tensor); a non-contiguous one, a resharded one or a cast falls back to torch.load."""
    filled: list[int] = []
    real_fill = stock_items._fill

    def counting_fill(stream: Any, into: torch.Tensor, length: int, where_: str) -> bool:
        ok = real_fill(stream, into, length, where_)
        filled.append(into.numel() if ok else -into.numel())
        return ok

    monkeypatch.setattr(stock_items, "_fill", counting_fill)
    sd = stock_state()
    path = str(tmp_path) if "local" in where else f"memory://direct-{uuid.uuid4().hex[:8]}"
    ext = [ZStandard()] if "zstd" in where else None
    dcp.save(sd, storage_writer=FileSystemWriter(path, _extensions=ext) if "local" in where else FsspecWriter(path))
    target = load_target(sd)
    dest = target["model"]["big"]
    dcp.load(target, storage_reader=nvdcp.NvcompReader(path))
    assert_same(target, sd)
    assert target["model"]["big"] is dest
    assert sorted(filled) == [-sd["model"]["wt"].numel(), sd["model"]["big"].numel()]  # wt: not contiguous
    filled.clear()
    cast = {"model": {"big": torch.zeros(520, 512, dtype=torch.float64)}}  # another dtype: torch.load + copy_
    dcp.load(cast, storage_reader=nvdcp.NvcompReader(path))
    assert filled == [] and torch.equal(cast["model"]["big"], sd["model"]["big"].double())


def test_each_reader_thread_count_and_reading_twice(tmp_path: Path) -> None:
    sd = stock_state()
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path, thread_count=3))
    reader = nvdcp.NvcompReader(tmp_path, thread_count=1)
    for _ in range(2):  # a reader is reusable, as stock's is
        target = load_target(sd)
        dcp.load(target, storage_reader=reader)
        assert_same(target, sd)


def test_stock_extension_registry_is_honored(tmp_path: Path) -> None:
    """torch's own test extension (rot13 of the stream): the reader's ``_extension_registry``
    resolves it, as FileSystemReader's does; without it the item is named in the error."""
    from torch.testing._internal.distributed.checkpoint_utils import Rot13Example, get_test_extension_registry

    sd = {"t": torch.arange(100, dtype=torch.float32), "blob": {"k": "SomeBlobForTesting"}}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path, _extensions=[Rot13Example()]))
    assert_same(nv_load(tmp_path, sd, _extension_registry=get_test_extension_registry()), sd)
    assert_same(nv_load(tmp_path, sd, thread_count=1, _extension_registry=get_test_extension_registry()), sd)
    err = load_failure(tmp_path, sd)
    assert isinstance(err, nvdcp.CorruptCheckpointError) and "cannot undo transforms" in str(err)
    assert "__0_0.distcp" in str(err) and " @ " in str(err)


def test_fsspec_memory_stock_checkpoint(tmp_path: Path) -> None:
    sd = stock_state()
    url = f"memory://stock-{uuid.uuid4().hex[:8]}"
    dcp.save(sd, storage_writer=FsspecWriter(url, _extensions=[ZStandard()]))
    assert not nvdcp.is_nvdcp_checkpoint(url)
    assert_same(nv_load(url, sd), sd)
    assert_same(nv_load(url, sd, thread_count=1), sd)
    # stock FsspecReader agrees
    stock = load_target(sd)
    dcp.load(stock, storage_reader=FsspecReader(url))
    assert_same(stock, sd)


def test_mixed_checkpoint_loads_and_is_nvdcp(tmp_path: Path) -> None:
    sd = stock_state()
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "nv", codec="zstd", thread_count=2))
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "stock", thread_count=2))
    stock_fqns = {"model.w", "model.scalar", "ids", "extra.step", "extra.blob", "dtypes.bfloat16", "dtypes.bool"}
    make_mixed(tmp_path / "nv", tmp_path / "stock", tmp_path / "mixed", stock_fqns)
    assert nvdcp.is_nvdcp_checkpoint(tmp_path / "mixed")
    for threads in (1, 4):
        assert_same(nv_load(tmp_path / "mixed", sd, thread_count=threads), sd)
    kinds = {is_nvdcp_record(i) for i in pickle.loads((tmp_path / "mixed" / ".metadata").read_bytes()).storage_data.values()}
    assert kinds == {True, False}
    # stock FileSystemReader cannot read it: the nvdcp items have a descriptor it does not know
    with pytest.raises(CheckpointException, match="nvdcp"):
        dcp.load(load_target(sd), storage_reader=FileSystemReader(tmp_path / "mixed"))
    # an nvdcp item still has all its checks in a mixed checkpoint
    md = pickle.loads((tmp_path / "mixed" / ".metadata").read_bytes())
    ix, info = next((ix, i) for ix, i in md.storage_data.items() if ix.fqn == "model.b16")
    path = tmp_path / "mixed" / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + info.length - 3] ^= 0x40
    path.write_bytes(bytes(data))
    err = load_failure(tmp_path / "mixed", sd)
    assert isinstance(err, nvdcp.CorruptCheckpointError) and "model.b16" in str(err) and "checksum" in str(err)


def test_stock_bytes_items_with_weights_only_planner(tmp_path: Path) -> None:
    sd = {"t": torch.ones(3), "meta": {"step": 5, "names": ["a", "b"], "ratio": 0.5}}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path))
    target = load_target(sd)
    dcp.load(target, storage_reader=nvdcp.NvcompReader(tmp_path), planner=nvdcp.WeightsOnlyLoadPlanner())
    assert_same(target, sd)


def test_cast_on_load_as_stock(tmp_path: Path) -> None:
    """The destination's dtype wins, as with FileSystemReader (``copy_`` casts)."""
    w = torch.rand(4, 3)
    dcp.save({"w": w}, storage_writer=FileSystemWriter(tmp_path))
    ours, stock = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}, {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}
    dcp.load(ours, storage_reader=nvdcp.NvcompReader(tmp_path))
    dcp.load(stock, storage_reader=FileSystemReader(tmp_path))
    assert bit_equal(ours["w"], stock["w"]) and bit_equal(ours["w"], w.bfloat16())


# -- is_nvdcp_checkpoint -------------------------------------------------------------------------
def test_is_nvdcp_checkpoint(tmp_path: Path) -> None:
    dcp.save({"t": torch.ones(2)}, storage_writer=nvdcp.NvcompWriter(tmp_path / "nv"))
    dcp.save({"t": torch.ones(2)}, storage_writer=FileSystemWriter(tmp_path / "stock"))
    assert nvdcp.is_nvdcp_checkpoint(tmp_path / "nv") is True
    assert nvdcp.is_nvdcp_checkpoint(str(tmp_path / "nv")) is True
    assert nvdcp.is_nvdcp_checkpoint(f"file://{tmp_path / 'nv'}") is True
    assert nvdcp.is_nvdcp_checkpoint(tmp_path / "stock") is False
    with pytest.raises(nvdcp.IncompleteCheckpointError):
        nvdcp.is_nvdcp_checkpoint(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError):  # IncompleteCheckpointError is one
        nvdcp.is_nvdcp_checkpoint(tmp_path / "nothing")
    url = f"memory://isnv-{uuid.uuid4().hex[:8]}"
    dcp.save({"t": torch.ones(2)}, storage_writer=nvdcp.NvcompWriter(url))
    assert nvdcp.is_nvdcp_checkpoint(url, storage_options={}) is True
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(nvdcp.CorruptCheckpointError):
        nvdcp.is_nvdcp_checkpoint(tmp_path / "bad")


# -- integrity of stock items --------------------------------------------------------------------
def _stock(tmp_path: Path, sd: dict[str, Any] | None = None) -> tuple[Path, dict[str, Any]]:
    sd = sd if sd is not None else stock_state()
    path = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=FileSystemWriter(path))
    return path, sd


def _record(path: Path, fqn: str) -> _StorageInfo:
    md = pickle.loads((path / ".metadata").read_bytes())
    return next(info for ix, info in md.storage_data.items() if ix.fqn == fqn)


def _patch_bytes(path: Path, info: _StorageInfo, at: int, data: bytes) -> None:
    f = path / info.relative_path
    blob = bytearray(f.read_bytes())
    blob[info.offset + at : info.offset + at + len(data)] = data
    f.write_bytes(bytes(blob))


@pytest.mark.parametrize("fqn", ["model.big", "model.w", "model.b16"])  # straight into place / through the file / whole
def test_damaged_stock_blob_names_file_offset_and_item(tmp_path: Path, fqn: str) -> None:
    path, sd = _stock(tmp_path)
    info = _record(path, fqn)
    _patch_bytes(path, info, 0, b"\x00" * 64)  # the zip's first local header
    err = load_failure(path, sd)
    assert isinstance(err, nvdcp.CorruptCheckpointError), err
    msg = str(err)
    assert "not a torch.save'd tensor" in msg and str(path / info.relative_path) in msg
    assert f"@ {info.offset}" in msg and repr(fqn) in msg


def test_stock_blob_of_wrong_dtype_or_shape_is_refused(tmp_path: Path) -> None:
    path, sd = _stock(tmp_path)
    md = pickle.loads((path / ".metadata").read_bytes())
    by_fqn = {ix.fqn: ix for ix in md.storage_data}
    # point "model.b16" (bf16 [64, 100]) at the blob of "ids" (int64 [5000])
    md.storage_data[by_fqn["model.b16"]] = md.storage_data[by_fqn["ids"]]
    (path / ".metadata").write_bytes(pickle.dumps(md))
    err = load_failure(path, sd)
    assert isinstance(err, nvdcp.CorruptCheckpointError)
    assert "holds a torch.int64 [5000] tensor, .metadata says torch.bfloat16 [64, 100]" in str(err)
    assert "'model.b16'" in str(err)


def test_stock_record_too_short_for_its_tensor(tmp_path: Path) -> None:
    path, sd = _stock(tmp_path)
    md = pickle.loads((path / ".metadata").read_bytes())
    ix = next(ix for ix in md.storage_data if ix.fqn == "ids")
    old = md.storage_data[ix]
    md.storage_data[ix] = _StorageInfo(old.relative_path, old.offset, 1000)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    err = load_failure(path, sd)
    assert isinstance(err, nvdcp.CorruptCheckpointError) and "cannot hold a torch.int64 [5000] tensor" in str(err)


def test_truncated_stock_file_is_named(tmp_path: Path) -> None:
    path, sd = _stock(tmp_path)
    info = _record(path, "ids")
    f = path / info.relative_path
    with open(f, "r+b") as fh:
        fh.truncate(info.offset + info.length // 2)
    err = load_failure(path, sd)
    assert isinstance(err, nvdcp.TruncatedCheckpointError), err
    assert info.relative_path in str(err)


def test_stock_blob_that_is_not_a_tensor_or_runs_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
            return os.system, (f"touch {marker}",)

    path, sd = _stock(tmp_path, {"a": torch.zeros(2, 3), "b": torch.zeros(2, 3)})
    for payload, expect in (({"not": torch.zeros(2, 3)}, "holds dict"), (Evil(), "not a torch.save'd tensor")):
        buf = io.BytesIO()
        torch.save(payload, buf)
        blob = buf.getvalue()
        f = path / "__0_0.distcp"
        start = f.stat().st_size
        with open(f, "ab") as fh:
            fh.write(blob)
        md = pickle.loads((path / ".metadata").read_bytes())
        ix = next(ix for ix in md.storage_data if ix.fqn == "b")
        md.storage_data[ix] = _StorageInfo("__0_0.distcp", start, len(blob))
        (path / ".metadata").write_bytes(pickle.dumps(md))
        err = load_failure(path, sd)
        assert isinstance(err, nvdcp.CorruptCheckpointError) and expect in str(err), err
    assert not marker.exists(), "a stock blob ran code"


def test_unknown_stock_transform_is_named(tmp_path: Path) -> None:
    path, sd = _stock(tmp_path, {"a": torch.zeros(2, 3)})
    md = pickle.loads((path / ".metadata").read_bytes())
    ix = next(iter(md.storage_data))
    old = md.storage_data[ix]
    md.storage_data[ix] = _StorageInfo(old.relative_path, old.offset, old.length, ["stream.lz9/1"])
    (path / ".metadata").write_bytes(pickle.dumps(md))
    err = load_failure(path, sd)
    assert isinstance(err, nvdcp.CorruptCheckpointError) and "stream.lz9/1" in str(err) and "'a'" in str(err)


def test_stock_metadata_paths_are_allowed_but_gadgets_are_not(tmp_path: Path) -> None:
    """A stock .metadata pickles a PosixPath (allowed); a pathlib name never reaches anything else."""
    path, _ = _stock(tmp_path, {"a": torch.zeros(1)})
    md = nvdcp.NvcompReader(path).read_metadata()
    assert os.fspath(md.storage_meta.checkpoint_id) == str(path)
    # pathlib's module does not become a way to other callables
    blob = (b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x07pathlib\x8c\x02os\x93.")
    (path / ".metadata").write_bytes(blob)
    with pytest.raises(nvdcp.CorruptCheckpointError, match="refusing"):
        nvdcp.NvcompReader(path).read_metadata()


@pytest.mark.parametrize("module, name, expect", [
    ("pathlib._local", "PosixPath", "PurePosixPath"),  # how Python 3.13 pickles a PosixPath
    ("pathlib", "WindowsPath", "PureWindowsPath"),  # a checkpoint saved on Windows
])
def test_stock_metadata_paths_from_other_pythons_and_systems(tmp_path: Path, module: str, name: str, expect: str) -> None:
    import pathlib

    path, sd = _stock(tmp_path, {"a": torch.arange(4.0)})
    blob = pickle.dumps(pickle.loads((path / ".metadata").read_bytes()), protocol=2)  # GLOBAL opcodes, no frames
    assert blob.count(b"cpathlib\nPosixPath\n") == 1
    (path / ".metadata").write_bytes(blob.replace(b"cpathlib\nPosixPath\n", f"c{module}\n{name}\n".encode()))
    md = nvdcp.NvcompReader(path).read_metadata()
    assert isinstance(md.storage_meta.checkpoint_id, getattr(pathlib, expect))
    assert_same(nv_load(path, sd), sd)


@pytest.mark.parametrize("kind", ["range", "buffer"])
def test_record_streams_seek_and_read_as_bytesio_does(tmp_path: Path, kind: str) -> None:
    """The streams stock records are read through (a range of an open file, a fetched buffer)
    behave as ``io.BytesIO`` over the same bytes for every seek and read ``torch.load`` makes."""
    from nvdcp.dcp.stock_items import _BufferFile, _RangeFile

    record = bytes(range(256)) * 300  # 76,800 bytes: small reads hit the cached blocks, large ones preadv
    path = tmp_path / "f"
    path.write_bytes(b"x" * 1000 + record + b"y" * 1000)
    fd = os.open(path, os.O_RDONLY)
    try:
        stream = _RangeFile(fd, 1000, len(record)) if kind == "range" else _BufferFile(memoryview(record))
        twin = io.BytesIO(record)
        for pos, whence, n in [(0, io.SEEK_SET, 10), (-22, io.SEEK_END, 22), (5, io.SEEK_CUR, 40_000),
                               (100, io.SEEK_SET, -1), (-1, io.SEEK_END, 50), (len(record) + 5, io.SEEK_SET, 3)]:
            assert stream.seek(pos, whence) == twin.seek(pos, whence)
            assert stream.read(n) == twin.read(n)
            assert stream.tell() == twin.tell()
        with pytest.raises(ValueError, match="negative seek position -1"):
            stream.seek(-1, io.SEEK_SET)
        assert stream.readable() and stream.seekable()
    finally:
        os.close(fd)

"""Item and file headers: struct-only, validated before allocation, version-gated."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from nvdcp.format.header import (
    FILE_FIXED_SIZE,
    ItemHeader,
    file_header_size,
    parse_file_header,
    parse_item_header,
)
from tests.conftest import weights_like


def _header(**kw: object) -> ItemHeader:
    base = dict(kind=0, dtype_code=9, shape=(3, 5), raw_nbytes=60, transform=1,
                plane_codecs=(0, 0, 0, 1), chunks=((15, 1), (15, 2), (15, 3), (9, 4)), chunk_bytes=1024)
    base.update(kw)
    return ItemHeader(**base)  # type: ignore[arg-type]


def test_pack_parse_round_trip() -> None:
    h = _header()
    packed = h.pack()
    record = memoryview(packed + bytes(h.stored_nbytes))
    parsed = parse_item_header(record, "x")
    assert parsed == h and parsed.header_bytes == len(packed)


def test_huge_claimed_size_fails_fast_without_allocating() -> None:
    h = _header()
    packed = bytearray(h.pack())
    struct.pack_into("<Q", packed, 16, 1 << 60)  # raw_nbytes
    with pytest.raises(nvdcp.CorruptCheckpointError):
        parse_item_header(memoryview(bytes(packed) + bytes(54)), "hostile")


def test_truncated_header() -> None:
    packed = _header().pack()
    with pytest.raises(nvdcp.TruncatedCheckpointError):
        parse_item_header(memoryview(packed[:20]), "x")


def test_payload_shorter_than_chunks() -> None:
    h = _header()
    with pytest.raises(nvdcp.TruncatedCheckpointError):
        parse_item_header(memoryview(h.pack() + bytes(h.stored_nbytes - 1)), "x")


def test_data_files_are_struct_records_end_to_end(tmp_path: Path) -> None:
    """Walk a real data file with the struct parsers alone: no byte is left to pickle."""
    sd = {"a": weights_like((300, 301)), "b": torch.arange(1000), "c": torch.tensor(1.5)}
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path))
    (data_file,) = [p for p in tmp_path.iterdir() if p.suffix == ".nvdcp"]
    blob = memoryview(data_file.read_bytes())
    pos = file_header_size(blob[:FILE_FIXED_SIZE], "f")
    info = parse_file_header(blob[:pos], "f")
    assert info["torch"] == torch.__version__ and info["nvdcp"] == nvdcp.__version__
    items = 0
    md = nvdcp.NvcompReader(tmp_path).read_metadata()
    for rec in sorted(md.storage_data.values(), key=lambda r: r.offset):
        assert rec.offset == pos
        parse_item_header(blob[pos : pos + rec.length], "f")
        pos += rec.length
        items += 1
    assert pos == len(blob) and items == 3
    assert b"\x80\x04\x95" not in bytes(blob) and b"\x80\x05\x95" not in bytes(blob)


def test_metadata_size_within_ten_percent_of_stock(tmp_path: Path) -> None:
    sd = {f"layers.{i}.{n}": weights_like((64, 64), seed=i) for i in range(40) for n in ("w", "b", "g")}
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "ours"))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "stock"))
    ours = (tmp_path / "ours" / ".metadata").stat().st_size
    stock = (tmp_path / "stock" / ".metadata").stat().st_size
    assert ours <= 1.1 * stock, (ours, stock)


def test_stock_torch_unpickles_our_metadata(tmp_path: Path) -> None:
    import pickle

    dcp.save({"w": torch.ones(3)}, storage_writer=nvdcp.NvcompWriter(tmp_path))
    md = pickle.loads((tmp_path / ".metadata").read_bytes())
    (info,) = md.storage_data.values()
    assert type(info).__module__ == "torch.distributed.checkpoint.filesystem"
    assert info.transform_descriptors[0].startswith("nvdcp.")

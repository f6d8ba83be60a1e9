"""Committed checkpoints with version 2 (delta) item records decode bit-exactly on every run, and
today's writer still produces their delta records byte for byte (tests/golden/make_golden.py --v2)."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import nvdcp
from nvdcp.dcp import descriptor
from nvdcp.format.digest import digest_of_header
from nvdcp.format.dtypes import code_dtype
from nvdcp.format.header import parse_item_header
from tests.dcp.helpers import failure_of
from tests.golden.make_golden import (
    GOLDEN_CHUNK_BYTES,
    V2_DELTA_ITEMS,
    digest,
    golden_state,
    golden_state_v2,
    golden_target,
    record_bytes,
)

GOLDEN = Path(__file__).parents[1] / "golden" / "v2"


def _expected() -> dict:
    return json.loads((GOLDEN / "expected.json").read_text())


def _check(sd: dict[str, object], expected: dict[str, str], step: int) -> None:
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert digest(v) == expected[k], k
    sd["extra"].seek(0)  # type: ignore[union-attr]
    assert hashlib.sha256(sd["extra"].read()).hexdigest() == expected["extra"]  # type: ignore[union-attr]
    assert sd["step"] == step


@pytest.mark.parametrize(("name", "step"), [("base", 42), ("delta", 43)])
def test_golden_v2_checkpoints_decode(name: str, step: int) -> None:
    sd = golden_target()
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(GOLDEN / name))
    _check(sd, _expected()[name], step)


def test_golden_v2_states_are_still_what_was_committed() -> None:
    expected = _expected()
    for name, state in (("base", golden_state()), ("delta", golden_state_v2())):
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                assert digest(v) == expected[name][k], (name, k)


def test_golden_v2_delta_records_are_as_committed() -> None:
    """The committed bytes of every record, the delta record of .metadata and the v2 header layout."""
    expected = _expected()
    records = record_bytes(GOLDEN / "delta")
    assert {k: hashlib.sha256(v).hexdigest() for k, v in records.items()} == expected["delta_records"]
    md = pickle.loads((GOLDEN / "delta" / ".metadata").read_bytes())
    base_md = pickle.loads((GOLDEN / "base" / ".metadata").read_bytes())
    assert md.nvdcp_delta == {
        "version": 1, "base": "base", "relative": "../base", "save_id": base_md.storage_meta.save_id,
        "digests_crc": base_md.nvdcp_digests["crc"], "depth": 1,
    }
    deltas = {ix.fqn for ix, info in md.storage_data.items() if descriptor.is_delta(info)}
    assert deltas == set(V2_DELTA_ITEMS) == set(expected["delta_items"])
    base_records = record_bytes(GOLDEN / "base")
    for fqn, rec in records.items():
        header = parse_item_header(memoryview(rec), fqn)
        magic, version, flags = rec[:4], struct.unpack_from("<H", rec, 4)[0], rec[11]
        assert magic == b"NVDI"
        if fqn in deltas:
            # v2 layout: the fixed fields (flags byte = 1: a delta against the base), then the
            # base item's digest (u32) and the delta kind (u32: 1 zigzag difference for floats,
            # 0 XOR otherwise) before the shape
            assert (version, flags) == (2, 1) and header.is_delta, fqn
            base_digest, kind = struct.unpack_from("<II", rec, 28)
            floats = code_dtype(header.dtype_code, fqn).is_floating_point
            assert kind == header.delta_kind == (1 if floats else 0), fqn
            base_header = parse_item_header(memoryview(base_records[fqn]), fqn)
            assert base_digest == header.base_digest == digest_of_header(base_header), fqn
            assert header.shape == base_header.shape and header.dtype_code == base_header.dtype_code
            assert md.storage_data[next(ix for ix in md.storage_data if ix.fqn == fqn)].transform_descriptors == (
                "nvdcp.zstd/2",)
        else:
            assert (version, flags) == (1, 0) and not header.is_delta, fqn


def test_todays_writer_reproduces_the_golden_delta_records(tmp_path: Path) -> None:
    """Saving the same state against the committed base gives the committed records, byte for
    byte: a change to how deltas are laid out or encoded fails here, not in users' chains. The
    golden delta has 64 KiB chunks (written before delta writers defaulted to 32 KiB)."""
    writer = nvdcp.NvcompWriter(tmp_path / "again", codec="zstd", base=GOLDEN / "base", chunk_bytes=GOLDEN_CHUNK_BYTES)
    dcp.save(golden_state_v2(), storage_writer=writer)
    got = record_bytes(tmp_path / "again")
    want = record_bytes(GOLDEN / "delta")
    assert set(got) == set(want)
    for fqn in want:
        assert got[fqn] == want[fqn], fqn


def test_golden_v2_files_pass_verification() -> None:
    for name in ("base", "delta"):
        report = nvdcp.verify_checkpoint(GOLDEN / name)
        assert report.ok, (name, report.damaged)


def test_golden_v2_delta_without_its_base_names_it(tmp_path: Path) -> None:
    shutil.copytree(GOLDEN / "delta", tmp_path / "delta")
    with pytest.raises(CheckpointException) as info:
        dcp.load(golden_target(), storage_reader=nvdcp.NvcompReader(tmp_path / "delta"))
    err = failure_of(info.value)
    assert isinstance(err, nvdcp.MissingBaseError) and "base" in str(err)
    shutil.copytree(GOLDEN / "base", tmp_path / "base")  # next to it again: found by its relative location
    sd = golden_target()
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(tmp_path / "delta"))
    _check(sd, _expected()["delta"], 43)

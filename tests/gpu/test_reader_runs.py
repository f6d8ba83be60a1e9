"""The GPU load path's host side, checked on the CPU: small records read in runs give the same
records and headers as reading them one by one; a failed run read falls back to single reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from nvdcp.dcp import reader as reader_mod


def _reader(tmp_path: Path) -> tuple[nvdcp.NvcompReader, list]:
    rng = np.random.default_rng(0)
    sd = {f"p{i}": torch.from_numpy(rng.standard_normal(int(n)).astype(np.float32))
          for i, n in enumerate(rng.integers(1, 300_000, 60))}
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path, on_identical_save="ignore"))
    r = nvdcp.NvcompReader(tmp_path)
    md = r.read_metadata()
    r.set_up_storage_reader(md, True)
    return r, list(md.storage_data)


def test_runs_match_single_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader_mod, "RUN_BYTES", 2 << 20)  # several runs
    r, indexes = _reader(tmp_path)
    places = [r.record_of(ix) for ix in indexes]
    got = r._read_record_runs(places)
    assert sum(v is not None for v in got) > len(places) // 2
    for ix, (name, off, length), rec in zip(indexes, places, got):
        if length > reader_mod.RUN_RECORD_BYTES:
            assert rec is None
            continue
        if rec is None:
            continue
        assert bytes(rec) == bytes(r.storage.read_range(name, off, length))
        where = r.where(ix)
        assert reader_mod._header_in(rec, where) == r.read_header(name, off, length, where)


def test_failed_run_read_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r, indexes = _reader(tmp_path)
    places = [r.record_of(ix) for ix in indexes]

    def broken(*args: object) -> bytes:
        raise OSError(5, "I/O error")

    monkeypatch.setattr(r.storage, "read_range", broken)
    assert r._read_record_runs(places) == [None] * len(places)


def test_header_in_refuses_a_short_record(tmp_path: Path) -> None:
    r, indexes = _reader(tmp_path)
    name, off, length = r.record_of(indexes[0])
    rec = memoryview(bytes(r.storage.read_range(name, off, length)))
    with pytest.raises(nvdcp.CorruptCheckpointError):
        reader_mod._header_in(rec[:-1], "x")

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
from nvdcp.dcp.reader import describe_index


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
    """Records read in runs are the bytes single reads give; parsed together, the headers,
    chunk tables and chunk bytes single reads give."""
    monkeypatch.setattr(reader_mod, "RUN_BYTES", 2 << 20)  # several runs
    r, indexes = _reader(tmp_path)
    places = [r.record_of(ix) for ix in indexes]
    runs = r._record_runs(places)
    assert len(runs) > 1
    in_runs = {i: (run, j) for run in runs for j, i in enumerate(run.members)}
    assert len(in_runs) > len(places) // 2
    parsed = r._records_in_memory(indexes, places)
    for i, (ix, (name, off, length)) in enumerate(zip(indexes, places)):
        if length > reader_mod.RUN_RECORD_BYTES or i not in in_runs:
            assert i not in in_runs and parsed[i] is None
            continue
        run, j = in_runs[i]
        single = bytes(r.storage.read_range(name, off, length))
        at = int(run.starts[j])
        assert bytes(run.buffer[at : at + length]) == single
        where = r.where(ix)
        header, (sizes, crcs), payload = parsed[i]
        assert header == r.read_header(name, off, length, where)
        assert sizes.tolist() == header.chunks.sizes.tolist() and crcs.tolist() == header.chunks.crcs.tolist()
        assert bytes(payload) == single[header.header_bytes :]


def test_a_damaged_record_in_a_run_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose records cannot all be parsed together is parsed one by one: the damaged
    record's error names it."""
    r, indexes = _reader(tmp_path)
    places = [r.record_of(ix) for ix in indexes]
    victim = next(i for i, p in enumerate(places) if p[2] <= reader_mod.RUN_RECORD_BYTES)
    read_range = r.storage.read_range

    def damaged(name: str, offset: int, length: int) -> bytes:
        data = bytearray(read_range(name, offset, length))
        at = places[victim][1] - offset
        if name == places[victim][0] and 0 <= at < len(data):
            data[at + 5] ^= 0xFF  # the version field of the victim's header
        return bytes(data)

    monkeypatch.setattr(r.storage, "read_range", damaged)
    with pytest.raises((nvdcp.CorruptCheckpointError, nvdcp.NvdcpError)) as info:
        r._records_in_memory(indexes, places)
    assert describe_index(indexes[victim]) in str(info.value)


def test_failed_run_read_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r, indexes = _reader(tmp_path)
    places = [r.record_of(ix) for ix in indexes]

    def broken(*args: object) -> bytes:
        raise OSError(5, "I/O error")

    monkeypatch.setattr(r.storage, "read_range", broken)
    assert r._record_runs(places) == []
    assert r._records_in_memory(indexes, places) == [None] * len(places)


def test_header_and_table_refuses_a_short_record(tmp_path: Path) -> None:
    r, indexes = _reader(tmp_path)
    name, off, length = r.record_of(indexes[0])
    rec = memoryview(bytes(r.storage.read_range(name, off, length)))
    with pytest.raises(nvdcp.CorruptCheckpointError):
        reader_mod._header_and_table(rec[:-1], "x")

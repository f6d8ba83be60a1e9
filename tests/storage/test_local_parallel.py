"""Large local reads and writes go out as slices from several threads: same bytes, same offsets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nvdcp.errors import TruncatedCheckpointError
from nvdcp.storage import local
from nvdcp.storage.local import LocalStorage


@pytest.fixture
def small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "PARALLEL_MIN_BYTES", 1 << 16)
    monkeypatch.setattr(local, "PARALLEL_SLICE_BYTES", 1 << 12)
    monkeypatch.setattr(local, "IO_THREADS", 4)


@pytest.mark.usefixtures("small_slices")
def test_split_covers_every_byte_in_order() -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 50_000_000 // 7, dtype=np.uint8)
    sizes = rng.integers(0, 3 << 20, 20)
    views, pos = [], 0
    mv = memoryview(data)
    for n in sizes:
        views.append(mv[pos : pos + int(n)])
        pos = min(len(data), pos + int(n))
    total = sum(len(v) for v in views)
    runs = local._split(views, total)
    assert 1 < len(runs) <= local.IO_THREADS
    assert runs[0][0] == 0
    joined = b"".join(bytes(v) for _, run in runs for v in run)
    assert joined == b"".join(bytes(v) for v in views)
    for (at, run), (nxt, _) in zip(runs, runs[1:]):
        assert at + sum(len(v) for v in run) == nxt


@pytest.mark.usefixtures("small_slices")
def test_parallel_write_and_read_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    storage = LocalStorage(tmp_path)
    stream = storage.create("f")
    expected = bytearray()
    for n in (10, 300_000, 7, 1 << 20):
        parts = [rng.integers(0, 256, int(k), dtype=np.uint8).tobytes() for k in rng.integers(1, 40_000, n // 20_000 + 1)]
        stream.writelines(parts)
        expected += b"".join(parts)
        assert stream.tell() == len(expected)
    big = rng.integers(0, 256, 500_000, dtype=np.uint8)
    stream.write(big)
    expected += big.tobytes()
    stream.commit()
    assert (tmp_path / "f").read_bytes() == bytes(expected)
    assert bytes(storage.read_range("f", 5, len(expected) - 5)) == bytes(expected[5:])
    bufs = [bytearray(k) for k in (3, 200_000, 0, 90_001, 123_456)]
    storage.read_into("f", 11, [memoryview(b) for b in bufs])
    assert b"".join(bufs) == bytes(expected[11 : 11 + sum(len(b) for b in bufs)])


@pytest.mark.usefixtures("small_slices")
def test_parallel_read_past_the_end_is_truncation(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 200_000)
    storage = LocalStorage(tmp_path)
    with pytest.raises(TruncatedCheckpointError):
        storage.read_into("f", 0, [memoryview(bytearray(150_000)), memoryview(bytearray(100_000))])


@pytest.mark.parametrize("sync", [True, False])
def test_synced_files_start_their_writeback_as_they_grow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         sync: bool) -> None:
    """A data file written with ``sync`` hands each WRITEBACK_BYTES of new bytes to the kernel's
    writeback as it goes (the fsync at commit then finds less to write); without ``sync``
    nothing is started. Either way the bytes are what was written."""
    monkeypatch.setattr(local, "WRITEBACK_BYTES", 1 << 20)
    storage = LocalStorage(tmp_path, sync=sync)
    data = np.random.default_rng(0).integers(0, 256, 5 << 20, dtype=np.uint8)
    stream = storage.create("f.distcp")
    for at in range(0, data.size, 700_000):  # pieces that do not line up with WRITEBACK_BYTES
        stream.write(data[at : at + 700_000])
    started = stream._written_back  # type: ignore[attr-defined]
    stream.commit()
    if sync and local._SYNC_FILE_RANGE is not None:
        assert data.size - (1 << 20) <= started < data.size
    else:
        assert started == 0
    assert (tmp_path / "f.distcp").read_bytes() == data.tobytes()


@pytest.mark.parametrize("length", [0, 100, (1 << 20) - 1, 1 << 20, (3 << 20) + 5])
def test_read_range_returns_the_bytes_below_and_above_the_unfilled_threshold(tmp_path: Path, length: int) -> None:
    """Reads of 1 MiB and more land in memory that was never zero-filled (read_buffer): what
    comes back must still be exactly the file's bytes, compare equal to them and slice as bytes."""
    from nvdcp.storage.base import UNFILLED_MIN_BYTES, read_buffer

    data = np.random.default_rng(length).integers(0, 256, length + 7, dtype=np.uint8).tobytes()
    (tmp_path / "f").write_bytes(data)
    got = LocalStorage(str(tmp_path)).read_range("f", 7, length)
    assert len(got) == length
    assert got == data[7:]
    assert bytes(got[: min(length, 10)]) == data[7 : 7 + min(length, 10)]
    assert isinstance(read_buffer(length), bytearray) == (length < UNFILLED_MIN_BYTES)
    with pytest.raises(TruncatedCheckpointError):
        LocalStorage(str(tmp_path)).read_range("f", 8, length)

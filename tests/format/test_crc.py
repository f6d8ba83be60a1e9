"""Batched chunk checksums (nvdcp.format.crc): equal to the crc32c package, native or not."""

from __future__ import annotations

import crc32c
import numpy as np
import pytest

from nvdcp.format import crc


def _ranges(rng: np.random.Generator, size: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = rng.integers(0, 70_000, size=n)
    lengths[:4] = [0, 1, 7, 65536]
    offsets = rng.integers(0, size - lengths.max(), size=n)
    return offsets.astype(np.int64), lengths.astype(np.int64)


@pytest.fixture(params=["native", "fallback"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native":
        if not crc.native_available():
            pytest.skip("nvdcp.format._crc32c_batch is not built here")
    else:
        monkeypatch.setattr(crc, "_native", lambda: None)
    return request.param


@pytest.mark.parametrize("threads", [1, 3, 16])
def test_equal_to_the_crc32c_package(mode: str, threads: int) -> None:
    rng = np.random.default_rng(threads)
    buf = rng.integers(0, 256, size=8 << 20, dtype=np.uint8)
    offsets, lengths = _ranges(rng, buf.size, 300)
    got = crc.checksum_ranges(buf, offsets, lengths, threads=threads)
    view = memoryview(buf)
    want = [crc32c.crc32c(view[o : o + n]) for o, n in zip(offsets.tolist(), lengths.tolist())]
    assert got.dtype == np.uint32 and got.tolist() == want


def test_no_ranges(mode: str) -> None:
    out = crc.checksum_ranges(np.zeros(10, dtype=np.uint8), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    assert out.shape == (0,)


@pytest.mark.parametrize(("offsets", "lengths"), [([5], [6]), ([-1], [2]), ([0], [-1]), ([0, 1], [1])])
def test_ranges_outside_the_buffer_are_refused(offsets: list[int], lengths: list[int]) -> None:
    with pytest.raises(ValueError):
        crc.checksum_ranges(np.zeros(10, dtype=np.uint8), np.asarray(offsets), np.asarray(lengths))


def test_buffer_must_be_flat_bytes() -> None:
    with pytest.raises(ValueError, match="uint8"):
        crc.checksum_ranges(np.zeros((2, 5), dtype=np.uint8), np.zeros(1), np.zeros(1))

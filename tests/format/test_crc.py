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


# -- every length and alignment the lane split can meet --------------------------------------------
_LENGTHS = sorted(
    set(range(0, 80))
    | {255, 256, 257, 767, 768, 769, 1535, 1536, 1537}  # the short lanes: 3 x 256 bytes a round
    | {24575, 24576, 24577, 24576 + 768, 24576 + 767, 49152, 49153}  # the long lanes: 3 x 8 KiB
    | {65535, 65536, 65537, 100_003, 1 << 20, (1 << 20) + 13}
)


@pytest.mark.parametrize("align", [0, 1, 3, 7, 8, 13])
def test_every_length_and_alignment(mode: str, align: int) -> None:
    rng = np.random.default_rng(align)
    buf = rng.integers(0, 256, size=(1 << 20) + 64, dtype=np.uint8)
    lengths = np.asarray(_LENGTHS, dtype=np.int64)
    offsets = np.full(len(lengths), align, dtype=np.int64)
    got = crc.checksum_ranges(buf, offsets, lengths, threads=1)
    view = memoryview(buf)
    want = [crc32c.crc32c(view[align : align + n]) for n in _LENGTHS]
    assert got.tolist() == want


def test_constant_and_patterned_data(mode: str) -> None:
    # zeros and all-ones exercise the lane join (the zero-shift tables) with degenerate states
    for fill in (0, 0xFF, 0x5A):
        buf = np.full(200_000, fill, dtype=np.uint8)
        lengths = np.asarray([24576, 49152, 100_000, 199_999], dtype=np.int64)
        got = crc.checksum_ranges(buf, np.ones(4, dtype=np.int64), lengths, threads=2)
        view = memoryview(buf)
        assert got.tolist() == [crc32c.crc32c(view[1 : 1 + n]) for n in lengths.tolist()]


@pytest.mark.parametrize("n", [1, 2, crc.FEW_RANGES, crc.FEW_RANGES + 1])
@pytest.mark.parametrize("size", [0, 4096, crc.FEW_RANGES_BYTES // crc.FEW_RANGES, 70_000])
def test_few_ranges_on_this_thread_equal_the_batched_call(mode: str, n: int, size: int) -> None:
    """A small record's few chunks are summed by the crc32c package on this thread (no native
    call): the same values as the batched path, whichever path a count and size take."""
    rng = np.random.default_rng(n * 7 + size)
    buf = rng.integers(0, 256, size=n * size + 17, dtype=np.uint8)
    offsets = np.arange(n, dtype=np.int64) * size + 17
    lengths = np.full(n, size, dtype=np.int64)
    view = memoryview(buf)
    want = [crc32c.crc32c(view[o : o + size]) for o in offsets.tolist()]
    assert crc.checksum_ranges(buf, offsets, lengths).tolist() == want
    with pytest.raises(ValueError, match="outside"):
        crc.checksum_ranges(buf, offsets + 18, lengths) if size else crc.checksum_ranges(buf, offsets - 18, lengths)

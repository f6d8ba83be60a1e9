"""nvdcp.codecs.zstd_blocks: zstd frames decoded block by block into place give what decoding the
frames and then merging (or applying) the planes gives, and a chunk of the wrong size is refused."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard

from nvdcp.codecs import zstd_blocks
from nvdcp.transform import delta as delta_transform
from nvdcp.transform.byteplanes import merge


@pytest.fixture
def decoder() -> zstd_blocks.BlockDecoder:
    found = zstd_blocks.block_decoder()
    if found is None:
        pytest.skip("nvdcp.codecs._zstd_batch, nvdcp.format._crc32c_batch or zstandard's cffi backend not available")
    return found


def _blocks(width: int, sizes: list[int], seed: int = 0) -> tuple[list[np.ndarray], list[bytes], list[bool]]:
    """Each block's planes (``sizes[i]`` bytes each, one row per plane), the stored chunks block-major
    (a zstd frame for every other plane, that plane's raw bytes for the rest) and which are frames."""
    rng = np.random.default_rng(seed)
    compressor = zstandard.ZstdCompressor(level=1)
    planes, stored, coded = [], [], []
    for i, n in enumerate(sizes):
        block = rng.integers(0, 4, (width, n), dtype=np.uint8) * np.uint8(60)  # compressible
        planes.append(block)
        for p in range(width):
            frame = (i + p) % 2 == 0
            stored.append(compressor.compress(block[p].tobytes()) if frame else block[p].tobytes())
            coded.append(frame)
    return planes, stored, coded


def _addresses(stored: list[bytes]) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    arrays = [np.frombuffer(s, dtype=np.uint8) for s in stored]
    return (np.array([a.ctypes.data for a in arrays], dtype=np.int64),
            np.array([len(s) for s in stored], dtype=np.int64), arrays)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("threads", [1, 3])
def test_blocks_decode_to_their_elements(decoder: zstd_blocks.BlockDecoder, width: int, threads: int) -> None:
    sizes = [65536, 1, 4096, 70_001, 513, 65536, 7, 300_000]
    planes, stored, coded = _blocks(width, sizes)
    chunks, lengths, keep = _addresses(stored)
    outs = [np.full(n * width, 0xAB, dtype=np.uint8) for n in sizes]
    decoder.decode(chunks, lengths, np.array(coded), np.array(sizes), np.array([o.ctypes.data for o in outs]),
                   width, threads=threads)
    for block, out in zip(planes, outs):
        expected = np.empty(block.size, dtype=np.uint8)
        merge(block, width, expected)
        assert np.array_equal(out, expected)
    del keep


@pytest.mark.parametrize(("kind", "element_size"), [(delta_transform.XOR, 4), (delta_transform.ZIGZAG_DIFF, 2),
                                                    (delta_transform.ZIGZAG_DIFF, 4), (delta_transform.ZIGZAG_DIFF, 8)])
def test_blocks_applied_as_deltas(decoder: zstd_blocks.BlockDecoder, kind: int, element_size: int) -> None:
    """With a delta kind, each block's elements are applied to the bytes already at its
    destination (delta_transform.apply_np's result), not written over them."""
    sizes = [4096, 65536, 24]
    planes, stored, coded = _blocks(element_size, sizes, seed=1)
    chunks, lengths, keep = _addresses(stored)
    rng = np.random.default_rng(2)
    bases = [rng.integers(0, 256, n * element_size, dtype=np.uint8) for n in sizes]
    outs = [b.copy() for b in bases]
    apply_width = element_size if kind == delta_transform.ZIGZAG_DIFF else 1
    decoder.decode(chunks, lengths, np.array(coded), np.array(sizes), np.array([o.ctypes.data for o in outs]),
                   element_size, kind, apply_width, threads=2)
    for block, base, out in zip(planes, bases, outs):
        delta = np.empty(block.size, dtype=np.uint8)
        merge(block, element_size, delta)
        expected = base.copy()
        delta_transform.apply_np(expected, delta, kind, element_size)
        assert np.array_equal(out, expected)
    del keep


@pytest.mark.parametrize("damage", ["short raw chunk", "frame of another size", "not a frame"])
def test_a_chunk_not_of_its_planes_size_names_its_block(decoder: zstd_blocks.BlockDecoder, damage: str) -> None:
    sizes = [4096, 4096, 4096]
    planes, stored, coded = _blocks(2, sizes)
    # block 1's planes are chunks 2 (raw: (1 + 0) % 2) and 3 (a frame)
    if damage == "short raw chunk":
        stored[2] = stored[2][:-1]
    elif damage == "frame of another size":
        stored[3] = zstandard.ZstdCompressor(level=1).compress(planes[1][1].tobytes() + b"x")
    else:
        stored[3] = b"\xff" * len(stored[3])
    chunks, lengths, keep = _addresses(stored)
    outs = [np.empty(n * 2, dtype=np.uint8) for n in sizes]
    with pytest.raises(ValueError, match="block 1 of 3"):
        decoder.decode(chunks, lengths, np.array(coded), np.array(sizes), np.array([o.ctypes.data for o in outs]), 2)
    del keep


def test_bad_arguments_are_value_errors(decoder: zstd_blocks.BlockDecoder) -> None:
    planes, stored, coded = _blocks(2, [64])
    chunks, lengths, keep = _addresses(stored)
    out = np.empty(128, dtype=np.uint8)
    with pytest.raises(ValueError, match="delta kind 7"):
        decoder.decode(chunks, lengths, np.array(coded), np.array([64]), np.array([out.ctypes.data]), 2, kind=7)
    with pytest.raises(ValueError, match="need 2 chunks"):
        decoder.decode(chunks[:1], lengths[:1], np.array(coded[:1]), np.array([64]), np.array([out.ctypes.data]), 2)
    del keep


def test_the_environment_variable_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(zstd_blocks.ENV_VAR, "0")
    zstd_blocks.block_decoder.cache_clear()
    try:
        assert zstd_blocks.block_decoder() is None
    finally:
        monkeypatch.delenv(zstd_blocks.ENV_VAR)
        zstd_blocks.block_decoder.cache_clear()


def _odd_chunks(plane: np.ndarray) -> dict[str, bytes]:
    """One plane's chunk in forms a crafted checkpoint could hold (its CRC would still match)."""
    raw = plane.tobytes()
    level1 = zstandard.ZstdCompressor(level=1)
    half = len(raw) // 2
    return {
        "plain frame": level1.compress(raw),
        "bytes after the frame": level1.compress(raw) + b"\x00\x07",
        "skippable frame first": b"\x50\x2a\x4d\x18" + (4).to_bytes(4, "little") + b"abcd" + level1.compress(raw),
        "no content size": zstandard.ZstdCompressor(level=1, write_content_size=False).compress(raw),
        "two frames of half each": level1.compress(raw[:half]) + level1.compress(raw[half:]),
        "frame of another size": level1.compress(raw + b"x"),
        "not a frame": b"\xff" * 40,
        "three bytes": b"\x28\xb5\x2f",
    }


@pytest.mark.parametrize("form", list(_odd_chunks(np.zeros(8, dtype=np.uint8))))
def test_odd_chunks_decode_as_the_batch_api_takes_them(decoder: zstd_blocks.BlockDecoder, form: str) -> None:
    """The block decoder accepts exactly the chunks the codec's batch path (decode_ranges)
    accepts, with the same bytes: whichever path a load takes, a crafted chunk loads or fails
    alike, and never takes the process down."""
    from nvdcp.codecs import cpu_codec

    plane = np.random.default_rng(5).integers(0, 4, 4096, dtype=np.uint8) * np.uint8(60)
    chunk = np.frombuffer(_odd_chunks(plane)[form], dtype=np.uint8).copy()
    offsets, lengths, raw = np.array([0]), np.array([chunk.size]), np.array([plane.size])
    try:
        decoded = cpu_codec("zstd").decode_ranges(chunk, offsets, lengths, raw)
        ranges = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * plane.size).from_address(int(decoded.addresses[0])))
        expected: np.ndarray | None = ranges.copy()
    except ValueError:
        expected = None
    out = np.full(plane.size, 0xAB, dtype=np.uint8)
    try:
        decoder.decode(np.array([chunk.ctypes.data]), lengths, np.array([1]), raw, np.array([out.ctypes.data]), 1)
        got: np.ndarray | None = out
    except ValueError:
        got = None
    assert (got is None) == (expected is None), form
    if got is not None and expected is not None:
        assert np.array_equal(got, expected) and np.array_equal(got, plane)


def test_damaged_frames_never_write_outside_their_blocks(decoder: zstd_blocks.BlockDecoder) -> None:
    """Each block's elements land in its own slice of one larger array: with frames damaged at
    random and three threads, the bytes between the slices keep their sentinel."""
    rng = np.random.default_rng(11)
    sizes = [4096, 777, 65536, 1, 30_000] * 4
    planes, stored, coded = _blocks(4, sizes, seed=3)
    for c in rng.choice(len(stored), 12, replace=False).tolist():
        if coded[c]:
            damaged = bytearray(stored[c])
            damaged[rng.integers(4, len(damaged))] ^= 0x5A
            stored[c] = bytes(damaged)
    chunks, lengths, keep = _addresses(stored)
    guard = 4096
    arena = np.full(sum(n * 4 + guard for n in sizes) + guard, 0xEE, dtype=np.uint8)
    starts = np.cumsum([guard] + [n * 4 + guard for n in sizes[:-1]])
    with pytest.raises(ValueError):
        decoder.decode(chunks, lengths, np.array(coded), np.array(sizes), arena.ctypes.data + starts, 4, threads=3)
    inside = np.zeros(arena.size, dtype=bool)
    for at, n in zip(starts.tolist(), sizes):
        inside[at : at + n * 4] = True
    assert (arena[~inside] == 0xEE).all()
    del keep


def test_edge_counts_and_sizes(decoder: zstd_blocks.BlockDecoder) -> None:
    empty = np.empty(0, dtype=np.int64)
    decoder.decode(empty, empty, np.empty(0, dtype=bool), empty, empty, 2)  # no blocks: nothing to do
    planes, stored, coded = _blocks(3, [100, 5])
    chunks, lengths, keep = _addresses(stored)
    outs = [np.empty(n * 3, dtype=np.uint8) for n in (100, 5)]
    decoder.decode(chunks, lengths, np.array(coded), np.array([100, 5]), np.array([o.ctypes.data for o in outs]), 3,
                   threads=16)  # more threads than blocks
    for block, out in zip(planes, outs):
        expected = np.empty(block.size, dtype=np.uint8)
        merge(block, 3, expected)
        assert np.array_equal(out, expected)
    with pytest.raises(ValueError, match="negative"):
        decoder.decode(chunks, lengths, np.array(coded), np.array([100, -5]), np.array([o.ctypes.data for o in outs]), 3)
    wide = np.zeros(17, dtype=np.int64)
    with pytest.raises(ValueError, match="17-plane"):
        decoder.decode(wide, wide, np.zeros(17, dtype=bool), np.array([1]), np.array([outs[0].ctypes.data]), 17)
    del keep

"""zstd frames without the match search (nvdcp.codecs.zstd_literals): plain frames every zstd
decoder reads, no larger than the search-based ones on float planes, the same bytes from the
batch call on any number of threads and from one call per range."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard

from nvdcp.codecs import zstd_literals
from nvdcp.codecs.base import PackedStreams
from nvdcp.codecs.zstd import DEFAULT_LEVEL, SPARSE_PLANE_HASH_LOG, ZstdCodec

compressor = zstd_literals.literals_compressor()
pytestmark = pytest.mark.skipif(compressor is None, reason="zstandard's cffi backend is not installed")


def _planes() -> np.ndarray:
    """Sign+exponent planes of fp32 weights, bf16 weights and AdamW's exp_avg_sq, back to back."""
    g = torch.Generator().manual_seed(0)
    fp32 = (torch.randn(1 << 17, generator=g) * 0.02).numpy().view(np.uint8).reshape(-1, 4)[:, 3]
    bf16 = (torch.randn(1 << 17, generator=g) * 0.02).bfloat16().view(torch.uint8).numpy().reshape(-1, 2)[:, 1]
    sq = ((torch.randn(1 << 16, generator=g) * 1e-3) ** 2).numpy().view(np.uint8).reshape(-1, 4)[:, 3]
    return np.ascontiguousarray(np.concatenate([fp32, bf16, sq]))


def _ranges(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ranges of uneven sizes (64 KiB chunks, small items' planes, one empty range)."""
    sizes = [65536, 1024, 2048, 0, 4096, 65536, 300, 65536]
    lengths = []
    total = 0
    while total < buf.size:
        n = min(sizes[len(lengths) % len(sizes)], buf.size - total)
        lengths.append(n)
        total += n
    lengths_a = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(len(lengths_a), dtype=np.int64)
    np.cumsum(lengths_a[:-1], out=offsets[1:])
    return offsets, lengths_a


def test_batch_frames_decode_with_a_plain_decoder() -> None:
    assert compressor is not None
    buf = _planes()
    offsets, lengths = _ranges(buf)
    packed = compressor.compress_ranges(buf, offsets, lengths, threads=3)
    assert isinstance(packed, PackedStreams) and len(packed) == len(lengths)
    assert packed.data.size == int(packed.lengths.sum())
    decoder = zstandard.ZstdDecompressor()
    for frame, o, n in zip(packed, offsets.tolist(), lengths.tolist()):
        assert decoder.decompress(bytes(frame)) == buf[o : o + n].tobytes()


def test_batch_is_deterministic_and_equals_one_call_per_range() -> None:
    assert compressor is not None
    buf = _planes()
    offsets, lengths = _ranges(buf)
    one = compressor.compress_ranges(buf, offsets, lengths, threads=1)
    many = compressor.compress_ranges(buf, offsets, lengths, threads=4)
    assert np.array_equal(one.lengths, many.lengths) and np.array_equal(one.data, many.data)
    singles = [compressor.compress(buf[o : o + n].data) for o, n in zip(offsets.tolist(), lengths.tolist())]
    assert b"".join(singles) == one.data.tobytes()
    if compressor._batch is not None:  # the Python route (no native library) writes the same frames
        python_route = zstd_literals.LiteralsCompressor(compressor._ffi, compressor._lib, None)
        fallback = python_route.compress_ranges(buf, offsets, lengths, threads=2)
        assert np.array_equal(fallback.lengths, one.lengths) and np.array_equal(fallback.data, one.data)


def test_no_larger_than_the_search_based_frames_on_float_planes() -> None:
    assert compressor is not None
    buf = _planes()
    offsets, lengths = _ranges(buf)
    searched = ZstdCodec(DEFAULT_LEVEL, SPARSE_PLANE_HASH_LOG)
    searched._literals = None  # the C binding's frames, as without the cffi backend
    old = sum(len(f) for f in searched.encode_ranges(buf, offsets, lengths))
    new = int(compressor.compress_ranges(buf, offsets, lengths, threads=2).lengths.sum())
    assert new <= old * 1.005, (new, old)
    assert new < buf.size / 2  # and they do compress


def test_only_float_planes_at_the_default_level_use_it() -> None:
    codec = ZstdCodec()
    assert codec.for_float_planes()._literals is compressor
    assert codec.for_float_planes() is codec.for_float_planes()
    assert codec._literals is None  # byte blobs: the search pays there
    assert codec.for_sparse_planes()._literals is None  # a delta's zero runs are matches worth keeping
    assert ZstdCodec(3).for_float_planes()._literals is None  # a chosen level is honoured


def test_float_items_are_stored_with_it_and_deltas_without_it() -> None:
    """Through the CPU encoders: a float item's sign+exponent planes get the literal frames, a
    delta's planes the search (its sparse planes store many times smaller with it)."""
    from nvdcp.pipeline import cpu

    float_codec = cpu.plane_encoders(("none", "zstd"), 2, "float")[1]
    delta_codec = cpu.plane_encoders(("zstd", "zstd"), 2, "delta")[1]
    assert isinstance(float_codec, ZstdCodec) and float_codec._literals is compressor
    assert isinstance(delta_codec, ZstdCodec) and delta_codec._literals is None
    sparse = np.zeros(1 << 16, dtype=np.uint8)
    sparse[::97] = 1  # a difference plane: few changed bytes
    assert len(delta_codec.encode(sparse.data)) * 2 < len(float_codec.encode(sparse.data))


def test_ranges_outside_the_buffer_are_refused() -> None:
    assert compressor is not None
    buf = np.zeros(1000, dtype=np.uint8)
    with pytest.raises(ValueError, match="outside"):
        compressor.compress_ranges(buf, np.array([0, 900]), np.array([100, 101]), threads=1)
    with pytest.raises(ValueError, match="contiguous"):
        compressor.compress_ranges(buf[::2], np.array([0]), np.array([10]), threads=1)

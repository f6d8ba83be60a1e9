"""zstd's tuned variants (a delta's sparse planes; float sign+exponent planes, see also
test_zstd_literals.py): ordinary zstd frames (any decoder reads them), smaller, the same
bitstream id; used only for those planes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard

from nvdcp.codecs import cpu_codec
from nvdcp.codecs.base import THREAD_MIN_BYTES, useful_threads
from nvdcp.codecs.zstd import SPARSE_PLANE_HASH_LOG, ZstdCodec
from nvdcp.format.dtypes import dtype_code
from nvdcp.format.header import KIND_BYTES, KIND_TENSOR, TRANSFORM_BYTEPLANES, TRANSFORM_NONE
from nvdcp.pipeline import cpu


def _top_plane(n: int = 1 << 18) -> bytes:
    t = torch.randn(n, generator=torch.Generator().manual_seed(0))
    return np.ascontiguousarray(t.numpy().view(np.uint8).reshape(-1, 4)[:, 3]).tobytes()


def test_sparse_variant_writes_plain_zstd_frames() -> None:
    codec = cpu_codec("zstd")
    sparse = codec.for_sparse_planes()
    assert isinstance(sparse, ZstdCodec) and sparse.hash_log == SPARSE_PLANE_HASH_LOG
    assert sparse.codec_id == codec.codec_id and sparse.for_sparse_planes() is sparse
    assert codec.for_sparse_planes() is sparse  # one instance (and its per-thread compressors)
    plane = _top_plane()
    for at in range(0, len(plane), 65536):
        chunk = plane[at : at + 65536]
        frame = sparse.encode(chunk)
        # what an old reader does: a fresh decompressor, no knowledge of the encoder's settings
        assert zstandard.ZstdDecompressor().decompress(frame) == chunk
        out = bytearray(len(chunk))
        codec.decode(frame, memoryview(out))
        assert out == chunk
        assert len(frame) <= len(codec.encode(chunk))


def test_codecs_without_a_variant_return_themselves() -> None:
    for name in ("none", "zstd"):
        codec = cpu_codec(name)
        assert type(codec.for_sparse_planes()) is type(codec)
        assert type(codec.for_float_planes()) is type(codec)
    none = cpu_codec("none")
    assert none.for_float_planes() is none.for_sparse_planes() is none


@pytest.mark.parametrize(
    ("kind", "dtype", "transform", "sparse"),
    [
        (KIND_TENSOR, torch.float32, TRANSFORM_BYTEPLANES, True),
        (KIND_TENSOR, torch.bfloat16, TRANSFORM_BYTEPLANES, True),
        (KIND_TENSOR, torch.complex64, TRANSFORM_BYTEPLANES, True),
        (KIND_TENSOR, torch.int32, TRANSFORM_BYTEPLANES, False),
        (KIND_TENSOR, torch.float32, TRANSFORM_NONE, False),
        (KIND_BYTES, None, TRANSFORM_NONE, False),
    ],
)
def test_only_float_planes_get_the_variant(kind: int, dtype: torch.dtype | None, transform: int, sparse: bool) -> None:
    code = dtype_code(dtype) if dtype is not None else 0
    assert cpu.float_planes(kind, code, transform) is sparse
    assert cpu.float_planes(KIND_TENSOR, 250, TRANSFORM_BYTEPLANES) is False  # unknown code: plain settings


@pytest.mark.parametrize("threads", [1, 3])
def test_decode_ranges_finds_every_frame_where_zstd_left_it(threads: int) -> None:
    """The batch decode hands back each frame's address in zstd's own buffers (one per thread);
    every stream there equals that frame decoded alone, and a size mismatch is refused."""
    rng = np.random.default_rng(threads)
    codec = ZstdCodec()
    # 3.9 MB in all: enough for three threads (useful_threads)
    raws = [rng.integers(0, 4 + 60 * (i % 3), 1000 + 4999 * i, dtype=np.uint8) for i in range(40)]
    frames = [codec.encode(r.data) for r in raws]
    buf = np.frombuffer(b"".join(frames), dtype=np.uint8)
    lengths = np.array([len(f) for f in frames], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    raw_lengths = np.array([r.size for r in raws], dtype=np.int64)
    decoded = codec.decode_ranges(buf, offsets, lengths, raw_lengths, threads=threads)
    for i, raw in enumerate(raws):
        assert np.array_equal(decoded.stream(i, raw.size), raw), i
    with pytest.raises(ValueError):
        codec.decode_ranges(buf, offsets, lengths, raw_lengths + np.eye(40, dtype=np.int64)[7], threads=threads)


def test_a_batch_gets_one_thread_per_mib_of_work() -> None:
    assert useful_threads(2, 80 * 4096) == 1  # a delta's plane probes: no thread started
    assert useful_threads(4, 3 * THREAD_MIN_BYTES + 5) == 3
    assert useful_threads(2, 100 * THREAD_MIN_BYTES) == 2
    assert useful_threads(0, 100 * THREAD_MIN_BYTES) == 1
    assert useful_threads(8, 0) == 1

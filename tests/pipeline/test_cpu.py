"""CPU item encoding: encode_item/decode_item round trips, raw fallback, chunk checksums."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from nvdcp.codecs import codec_id
from nvdcp.errors import CodecUnavailableError, CorruptCheckpointError
from nvdcp.format.dtypes import dtype_code
from nvdcp.format.header import (
    KIND_BYTES,
    KIND_TENSOR,
    TRANSFORM_BYTEPLANES,
    TRANSFORM_NONE,
    checksum,
    parse_item_header,
)
from nvdcp.pipeline import cpu
from nvdcp.pipeline.cpu import EncodedItem, block_chunks, decode_item, encode_item, verify_chunks
from nvdcp.pipeline.policy import Layout, choose_layout
from nvdcp.pipeline.tensors import tensor_to_host_bytes
from tests.conftest import bit_equal, random_tensor, weights_like

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as p:
        yield p


def _record(item: EncodedItem) -> memoryview:
    return memoryview(item.header_bytes + b"".join(bytes(c) for c in item.chunks))


def _encode_tensor(t: torch.Tensor, codec: str, chunk_bytes: int, pool: ThreadPoolExecutor | None) -> EncodedItem:
    return encode_item(
        tensor_to_host_bytes(t), kind=KIND_TENSOR, dtype_code=dtype_code(t.dtype), shape=tuple(t.shape),
        element_size=t.element_size(), layout=choose_layout(t.dtype, codec), pool=pool, chunk_bytes=chunk_bytes,
    )


def _decode_tensor(item: EncodedItem, dtype: torch.dtype, pool: ThreadPoolExecutor | None) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    header, raw = decode_item(_record(item), "item 'x'", pool, size)
    assert raw.dtype == np.uint8 and raw.shape == (header.raw_nbytes,)
    if raw.size == 0:
        return torch.empty(header.shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(header.shape)


# -- block_chunks ------------------------------------------------------------------------------
def test_block_chunks_are_block_major() -> None:
    planes = np.arange(2 * 5, dtype=np.uint8).reshape(2, 5)
    chunks = block_chunks(planes, 2)
    assert [bytes(c) for c in chunks] == [
        bytes([0, 1]), bytes([5, 6]),  # block 0: plane 0, plane 1
        bytes([2, 3]), bytes([7, 8]),  # block 1
        bytes([4]), bytes([9]),  # block 2 (short)
    ]


def test_block_chunks_of_nothing() -> None:
    assert block_chunks(np.zeros((4, 0), dtype=np.uint8), 1024) == []


def test_block_chunks_view_the_planes() -> None:
    planes = np.zeros((1, 3000), dtype=np.uint8)
    chunks = block_chunks(planes, 1024)
    assert [len(c) for c in chunks] == [1024, 1024, 952]
    planes[0, 1500] = 7
    assert chunks[1][1500 - 1024] == 7


# -- round trips -------------------------------------------------------------------------------
CASES = [
    (torch.float32, (1000,)),
    (torch.float32, (33, 65)),
    (torch.bfloat16, (4097,)),
    (torch.float16, (3, 5, 7)),
    (torch.float64, (513,)),
    (torch.int64, (2000,)),
    (torch.int32, (1,)),
    (torch.int8, (5000,)),
    (torch.uint8, (1025,)),
    (torch.bool, (999,)),
    (torch.complex64, (300,)),
    (torch.complex32, (77,)),
    (torch.float8_e4m3fn, (2049,)),
    (torch.float32, ()),
    (torch.float32, (0, 4)),
]


@pytest.mark.parametrize(("dtype", "shape"), CASES, ids=[f"{d}-{s}".replace("torch.", "") for d, s in CASES])
@pytest.mark.parametrize("codec", ["auto", "zstd", "gdeflate", "none"])
@pytest.mark.parametrize("chunk_bytes", [1024, 3000, 65536])
def test_round_trip_random_bits(
    dtype: torch.dtype, shape: tuple[int, ...], codec: str, chunk_bytes: int, pool: ThreadPoolExecutor
) -> None:
    t = random_tensor(dtype, shape, seed=len(shape) + chunk_bytes)
    item = _encode_tensor(t, codec, chunk_bytes, pool)
    assert item.header.raw_nbytes == t.numel() * t.element_size()
    assert item.nbytes == len(item.header_bytes) + sum(len(c) for c in item.chunks)
    layout = choose_layout(dtype, codec)
    n_planes = len(layout.plane_codecs)
    assert item.header.plane_codecs == tuple(codec_id(n) for n in layout.plane_codecs)
    assert len(item.chunks) == n_planes * -(-(item.header.raw_nbytes // n_planes) // chunk_bytes)
    out = _decode_tensor(item, dtype, pool)
    assert bit_equal(out, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_bytes", [1024, 4096])
def test_round_trip_weights_compress_the_exponent_plane(dtype: torch.dtype, chunk_bytes: int) -> None:
    t = weights_like((64, 100), dtype, seed=1)
    item = _encode_tensor(t, "zstd", chunk_bytes, None)
    h = item.header
    assert h.transform == TRANSFORM_BYTEPLANES and h.n_planes == t.element_size()
    last = h.n_planes - 1
    raw_sizes = [h.block_elements(i // h.n_planes) for i in range(len(h.chunks))]
    top = [size for i, (size, _) in enumerate(h.chunks) if i % h.n_planes == last]
    top_raw = [raw_sizes[i] for i in range(len(h.chunks)) if i % h.n_planes == last]
    assert sum(top) < sum(top_raw)  # sign+exponent bytes of small weights compress
    for i, (size, _) in enumerate(h.chunks):
        if i % h.n_planes != last:
            assert size == raw_sizes[i]  # mantissa planes: codec "none", stored raw
    assert bit_equal(_decode_tensor(item, dtype, None), t)


def test_round_trip_non_contiguous_view(pool: ThreadPoolExecutor) -> None:
    base = weights_like((200, 300), seed=2)
    view = base[10:190:3, ::7]
    item = _encode_tensor(view, "zstd", 1024, pool)
    assert item.header.shape == tuple(view.shape)
    assert bit_equal(_decode_tensor(item, torch.float32, pool), view.contiguous())


def test_pool_and_no_pool_give_identical_records(pool: ThreadPoolExecutor) -> None:
    t = weights_like((1 << 17,), seed=3)  # 512 KiB at 1 KiB chunks: several groups of chunks
    a = _encode_tensor(t, "zstd", 1024, pool)
    b = _encode_tensor(t, "zstd", 1024, None)
    assert a.header_bytes == b.header_bytes
    assert [bytes(c) for c in a.chunks] == [bytes(c) for c in b.chunks]


def test_decode_with_a_pool_spans_several_groups(monkeypatch: pytest.MonkeyPatch, pool: ThreadPoolExecutor) -> None:
    monkeypatch.setattr(cpu, "_GROUP_BYTES", 4096)  # 4 chunks of 1 KiB per group: many groups
    t = random_tensor(torch.int16, (20_000,), seed=4)
    item = _encode_tensor(t, "zstd", 1024, pool)
    assert bit_equal(_decode_tensor(item, torch.int16, pool), t)


def test_bytes_item_round_trip(pool: ThreadPoolExecutor) -> None:
    blob = b"hello world, " * 700 + bytes(range(256))
    raw = np.frombuffer(blob, dtype=np.uint8)
    item = encode_item(raw, kind=KIND_BYTES, dtype_code=0, shape=(), element_size=1,
                       layout=choose_layout(None, "auto"), pool=pool, chunk_bytes=2048)
    assert item.header.kind == KIND_BYTES and item.header.transform == TRANSFORM_NONE
    assert item.header.stored_nbytes < len(blob)
    header, out = decode_item(_record(item), "bytes", pool)
    assert header.kind == KIND_BYTES and out.tobytes() == blob


# -- raw when compression does not pay ---------------------------------------------------------
@pytest.mark.parametrize("codec", ["zstd", "gdeflate"])
def test_random_bytes_are_stored_raw(codec: str) -> None:
    raw = np.random.default_rng(5).integers(0, 256, size=10_000, dtype=np.uint8)
    item = encode_item(raw, kind=KIND_BYTES, dtype_code=0, shape=(), element_size=1,
                       layout=Layout(TRANSFORM_NONE, (codec,)), pool=None, chunk_bytes=4096)
    assert [size for size, _ in item.header.chunks] == [4096, 4096, 1808]
    assert b"".join(bytes(c) for c in item.chunks) == raw.tobytes()
    assert item.header.plane_codecs == (codec_id(codec),)  # the codec is named even if unused
    _, out = decode_item(_record(item), "x", None)
    assert np.array_equal(out, raw)


@pytest.mark.parametrize("codec", ["zstd", "gdeflate"])
def test_zeros_are_compressed(codec: str) -> None:
    raw = np.zeros(10_000, dtype=np.uint8)
    item = encode_item(raw, kind=KIND_BYTES, dtype_code=0, shape=(), element_size=1,
                       layout=Layout(TRANSFORM_NONE, (codec,)), pool=None, chunk_bytes=4096)
    sizes = [size for size, _ in item.header.chunks]
    assert len(sizes) == 3 and all(s < 4096 // 4 for s in sizes)
    _, out = decode_item(_record(item), "x", None)
    assert np.array_equal(out, raw)


def test_chunk_checksums_are_crc32c_of_the_stored_bytes() -> None:
    raw = np.concatenate([np.zeros(3000, np.uint8), np.random.default_rng(6).integers(0, 256, 3000, np.uint8)])
    item = encode_item(raw, kind=KIND_BYTES, dtype_code=0, shape=(), element_size=1,
                       layout=Layout(TRANSFORM_NONE, ("zstd",)), pool=None, chunk_bytes=3000)
    assert [(len(c), checksum(c)) for c in item.chunks] == list(item.header.chunks)
    assert item.header.chunks[0][0] < 3000 and item.header.chunks[1][0] == 3000


def test_gpu_only_codec_is_refused_on_the_cpu() -> None:
    raw = np.zeros(16, dtype=np.uint8)
    for name in ("ans", "bitcomp"):
        with pytest.raises(CodecUnavailableError, match=name):
            encode_item(raw, kind=KIND_TENSOR, dtype_code=dtype_code(torch.float32), shape=(4,),
                        element_size=4, layout=Layout(TRANSFORM_NONE, (name,)), pool=None)


def test_header_round_trips_through_parse() -> None:
    t = weights_like((10, 20), seed=7)
    item = _encode_tensor(t, "zstd", 1024, None)
    parsed = parse_item_header(_record(item), "x")
    assert parsed == item.header
    assert parsed.header_bytes == len(item.header_bytes)
    assert parsed.shape == (10, 20) and parsed.dtype_code == dtype_code(torch.float32)


# -- corruption --------------------------------------------------------------------------------
def _corrupted(item: EncodedItem, chunk: int, at: int = 0) -> memoryview:
    data = bytearray(_record(item))
    offset = len(item.header_bytes) + sum(len(c) for c in item.chunks[:chunk]) + at
    data[offset] ^= 0x40
    return memoryview(bytes(data))


@pytest.fixture(scope="module")
def multi_chunk_item() -> EncodedItem:
    t = weights_like((4096,), seed=8)  # 4 planes x 4 blocks of 1 KiB
    item = _encode_tensor(t, "zstd", 1024, None)
    assert len(item.chunks) == 16
    return item


@pytest.mark.parametrize("chunk", [0, 3, 7, 15])
def test_flipped_payload_byte_names_the_chunk(multi_chunk_item: EncodedItem, chunk: int) -> None:
    record = _corrupted(multi_chunk_item, chunk, at=len(multi_chunk_item.chunks[chunk]) // 2)
    block, plane = divmod(chunk, 4)
    expected = f"item 'w': chunk {chunk} \\(block {block}, plane {plane}\\) checksum mismatch"
    with pytest.raises(CorruptCheckpointError, match=expected):
        decode_item(record, "item 'w'", None, 4)
    with pytest.raises(CorruptCheckpointError, match=expected):
        verify_chunks(record, "item 'w'")


def test_flipped_payload_byte_with_a_pool(multi_chunk_item: EncodedItem, pool: ThreadPoolExecutor,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "_GROUP_BYTES", 2048)  # several groups decoded on the pool
    record = _corrupted(multi_chunk_item, 9)
    with pytest.raises(CorruptCheckpointError, match="chunk 9 "):
        decode_item(record, "w", pool, 4)


def test_verify_chunks_passes_a_good_record(multi_chunk_item: EncodedItem) -> None:
    header = verify_chunks(_record(multi_chunk_item), "w")
    assert header == multi_chunk_item.header


def test_verify_chunks_of_an_empty_item() -> None:
    item = _encode_tensor(torch.empty(0), "zstd", 1024, None)
    assert item.chunks == [] and verify_chunks(_record(item), "e").raw_nbytes == 0
    _, out = decode_item(_record(item), "e", None, 4)
    assert out.size == 0


def test_flipped_header_byte_is_caught(multi_chunk_item: EncodedItem) -> None:
    data = bytearray(_record(multi_chunk_item))
    data[len(multi_chunk_item.header_bytes) - 6] ^= 1  # inside the chunk table
    with pytest.raises(CorruptCheckpointError, match="w"):
        decode_item(memoryview(bytes(data)), "w", None, 4)


def test_wrong_element_size_is_corrupt(multi_chunk_item: EncodedItem) -> None:
    with pytest.raises(CorruptCheckpointError, match="4 byte planes for 2-byte elements"):
        decode_item(_record(multi_chunk_item), "w", None, 2)


def test_gpu_only_codec_record_does_not_decode_on_the_cpu() -> None:
    """A record naming ANS (written on a GPU) fails with a clear message, not garbage."""
    t = torch.zeros(256)
    raw = tensor_to_host_bytes(t)
    item = encode_item(raw, kind=KIND_TENSOR, dtype_code=dtype_code(t.dtype), shape=(256,), element_size=4,
                       layout=Layout(TRANSFORM_NONE, ("none",)), pool=None)
    header = item.header.__class__(**{**item.header.__dict__, "plane_codecs": (codec_id("ans"),)})
    record = memoryview(header.pack() + b"".join(bytes(c) for c in item.chunks))
    with pytest.raises(CodecUnavailableError, match="where-it-is.*'ans'"):
        decode_item(record, "where-it-is", None, 4)


def _with_chunk(item: EncodedItem, index: int, stored: bytes) -> memoryview:
    """``item``'s record with chunk ``index`` replaced and its checksum made right again."""
    chunks = [bytes(c) for c in item.chunks]
    chunks[index] = stored
    table = tuple((len(c), checksum(c)) for c in chunks)
    header = item.header.__class__(**{**item.header.__dict__, "chunks": table})
    return memoryview(header.pack() + b"".join(chunks))


def _zero_bytes_item() -> EncodedItem:
    item = encode_item(np.zeros(2048, dtype=np.uint8), kind=KIND_BYTES, dtype_code=0, shape=(), element_size=1,
                       layout=Layout(TRANSFORM_NONE, ("zstd",)), pool=None, chunk_bytes=1024)
    assert all(size < 1024 for size, _ in item.header.chunks)
    return item


def test_chunk_decoding_to_the_wrong_size_is_corrupt() -> None:
    """A well-formed zstd frame with a valid checksum but too few bytes is not silently accepted."""
    from nvdcp.codecs import cpu_codec

    short = cpu_codec("zstd").encode(bytes(512))
    record = _with_chunk(_zero_bytes_item(), 1, short)
    with pytest.raises(CorruptCheckpointError, match=r"short: chunk 1 \(block 1, plane 0, codec zstd\)"):
        decode_item(record, "short", None)


def test_chunk_larger_than_its_raw_size_is_corrupt() -> None:
    record = _with_chunk(_zero_bytes_item(), 0, bytes(1500))
    with pytest.raises(CorruptCheckpointError, match="big: chunk 0 .* stores 1500 bytes for 1024 raw"):
        decode_item(record, "big", None)


def test_garbage_zstd_chunk_with_a_valid_checksum_is_corrupt() -> None:
    record = _with_chunk(_zero_bytes_item(), 1, b"\x00" * 20)
    with pytest.raises(CorruptCheckpointError, match="bad: chunk 1 .*codec zstd.*does not decode"):
        decode_item(record, "bad", None)


@pytest.mark.parametrize("keep", ["none", "fresh", "base"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_delta_item_keeps_its_bytes_in_the_same_pass(keep: str, dtype: torch.dtype, pool: ThreadPoolExecutor,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """encode_item with a base and ``keep``: the record is the same whether the bytes are kept
    or not, in fresh memory or over the base itself, with several groups on a pool; the kept
    bytes are the item's; applied to the base the record gives the item."""
    from nvdcp.pipeline.policy import choose_delta_layout
    from nvdcp.transform import delta as delta_transform

    monkeypatch.setattr(cpu, "_GROUP_BYTES", 3 * 4096 * 4)  # several groups of 4 KiB blocks
    t = weights_like((96, 257), dtype, seed=5) if dtype.is_floating_point else random_tensor(dtype, (96, 257), seed=5)
    raw = tensor_to_host_bytes(t)
    base = raw.copy()
    base[::7] ^= 3  # about every seventh byte moved
    kind, size = delta_transform.kind_for(dtype), t.element_size()

    def encode(base_bytes: np.ndarray, keep_bytes: np.ndarray | None) -> EncodedItem:
        return encode_item(raw, kind=KIND_TENSOR, dtype_code=dtype_code(dtype), shape=tuple(t.shape), element_size=size,
                           layout=choose_delta_layout(dtype, "zstd"), pool=pool, chunk_bytes=4096, base=base_bytes,
                           base_digest=42, delta_kind=kind, keep=keep_bytes)

    reference = encode(base.copy(), None)
    given = base.copy()
    kept = {"none": None, "fresh": np.zeros_like(raw), "base": given}[keep]
    record = encode(given, kept)
    assert _record(record).tobytes() == _record(reference).tobytes()
    assert kept is None or np.array_equal(kept, raw)
    _, diff = decode_item(_record(record), "x", None, size)
    value = base.copy()
    delta_transform.apply_np(value, diff, kind, size)
    assert np.array_equal(value, raw)


def test_delta_item_refuses_a_keep_of_the_wrong_size() -> None:
    raw = np.arange(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="kept for the next save need 64 bytes, got 63"):
        encode_item(raw, kind=KIND_TENSOR, dtype_code=dtype_code(torch.uint8), shape=(64,), element_size=1,
                    layout=Layout(TRANSFORM_NONE, ("zstd",)), pool=None, base=raw.copy(), base_digest=1,
                    keep=np.zeros(63, dtype=np.uint8))

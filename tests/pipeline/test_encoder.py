"""ItemEncoder on a machine without a usable GPU: the CPU path, routing, sharing, pickling."""

from __future__ import annotations

import collections
import io
import itertools
import pickle
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from nvdcp.codecs import codec_id
from nvdcp.errors import CodecUnavailableError
from nvdcp.format.dtypes import DTYPE_TO_CODE, dtype_code
from nvdcp.format.header import KIND_BYTES, KIND_TENSOR, TRANSFORM_BYTEPLANES, TRANSFORM_NONE
from nvdcp.gpu import gpu_available
from nvdcp.gpu.config import GpuConfig
from nvdcp.pipeline import encoder as encoder_module
from nvdcp.pipeline.config import EncodeConfig
from nvdcp.pipeline.cpu import EncodedItem, decode_item
from nvdcp.pipeline.encoder import (
    SMALL_BATCH_ITEMS,
    SMALL_ITEM_BYTES,
    ItemEncoder,
    close_shared_encoders,
    descriptor_codec,
    shared_encoder,
)
from nvdcp.pipeline.policy import choose_layout
from tests.conftest import bit_equal, random_tensor, weights_like

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
#: Behaviour that holds only where no GPU path is usable (tests/gpu/test_item_encoder.py has the GPU side).
no_gpu = pytest.mark.skipif(gpu_available(), reason="checks the behaviour without a usable GPU")

UNSUPPORTED = torch.bits16
assert UNSUPPORTED not in DTYPE_TO_CODE


@pytest.fixture
def enc() -> Iterator[ItemEncoder]:
    e = ItemEncoder(EncodeConfig(codec="zstd", chunk_bytes=4096, codec_threads=2))
    yield e
    e.close()


def _record(item: EncodedItem) -> memoryview:
    return memoryview(item.header_bytes + b"".join(bytes(c) for c in item.chunks))


def _decoded_tensor(item: EncodedItem, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    header, raw = decode_item(_record(item), "t", None, size)
    assert header.kind == KIND_TENSOR and header.dtype_code == dtype_code(dtype)
    if raw.size == 0:
        return torch.empty(header.shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(header.shape)


def _decoded_bytes(item: EncodedItem) -> bytes:
    header, raw = decode_item(_record(item), "b", None)
    assert header.kind == KIND_BYTES and header.shape == () and header.dtype_code == 0
    return raw.tobytes()


# -- construction ------------------------------------------------------------------------------
def test_defaults() -> None:
    e = ItemEncoder()
    assert e.config == EncodeConfig() and e.gpu == GpuConfig()
    e.close()


def test_construction_touches_no_resources() -> None:
    e = ItemEncoder()
    assert e._pool is None and e._pinned is None and e._idle == {}


# -- encode_bytes ------------------------------------------------------------------------------
BLOB = b"optimizer state " * 2000 + bytes(range(256)) * 3


@pytest.mark.parametrize(
    "wrap",
    [bytes, bytearray, memoryview, io.BytesIO, lambda b: np.frombuffer(b, dtype=np.uint8)],
    ids=["bytes", "bytearray", "memoryview", "BytesIO", "ndarray"],
)
def test_encode_bytes_round_trip(enc: ItemEncoder, wrap: object) -> None:
    item = enc.encode_bytes(wrap(BLOB))  # type: ignore[operator]
    assert item.header.kind == KIND_BYTES and item.header.transform == TRANSFORM_NONE
    assert item.header.plane_codecs == (codec_id("zstd"),)
    assert item.header.chunk_bytes == 4096
    assert item.header.stored_nbytes < len(BLOB)  # repetitive: compressed
    assert _decoded_bytes(item) == BLOB


def test_encode_bytes_of_nothing(enc: ItemEncoder) -> None:
    item = enc.encode_bytes(b"")
    assert item.chunks == [] and _decoded_bytes(item) == b""


@pytest.mark.parametrize(
    "array", [np.arange(10, dtype=np.float32), np.arange(40, dtype=np.uint8)[::2], np.ones((3, 4), dtype=np.int16)],
    ids=["float32", "strided", "2d"],
)
def test_encode_bytes_stores_every_byte_of_a_numpy_array(enc: ItemEncoder, array: np.ndarray) -> None:
    item = enc.encode_bytes(array)
    assert item.header.raw_nbytes == array.nbytes
    assert _decoded_bytes(item) == np.ascontiguousarray(array).tobytes()


@pytest.mark.parametrize("codec", ["ans", "bitcomp"])
def test_encode_bytes_never_uses_a_gpu_only_codec(codec: str) -> None:
    e = ItemEncoder(EncodeConfig(codec=codec, chunk_bytes=4096, codec_threads=1))
    try:
        item = e.encode_bytes(BLOB)
        assert item.header.plane_codecs == (codec_id("zstd"),)
        assert _decoded_bytes(item) == BLOB
    finally:
        e.close()


# -- encode_tensor -----------------------------------------------------------------------------
TENSORS = [
    (torch.float32, (100, 37)),
    (torch.bfloat16, (5000,)),
    (torch.float16, (3, 333)),
    (torch.int64, (1234,)),
    (torch.int8, (4099,)),
    (torch.bool, (77,)),
    (torch.complex64, (10, 10)),
    (torch.complex32, (33,)),
    (torch.float8_e5m2, (300,)),
    (torch.float64, ()),
    (torch.float32, (0,)),
]


@pytest.mark.parametrize(("dtype", "shape"), TENSORS, ids=[f"{d}-{s}".replace("torch.", "") for d, s in TENSORS])
@pytest.mark.parametrize("codec", ["auto", "zstd", "gdeflate", "none"])
def test_encode_tensor_round_trip(dtype: torch.dtype, shape: tuple[int, ...], codec: str) -> None:
    e = ItemEncoder(EncodeConfig(codec=codec, chunk_bytes=1024, codec_threads=2))
    try:
        t = random_tensor(dtype, shape, seed=3)
        item = e.encode_tensor(t, "item 't'")
        layout = choose_layout(dtype, codec)
        assert item.header.plane_codecs == tuple(codec_id(n) for n in layout.plane_codecs)
        assert item.header.transform == layout.transform
        assert item.header.shape == shape and item.header.chunk_bytes == 1024
        assert bit_equal(_decoded_tensor(item, dtype), t)
    finally:
        e.close()


def test_encode_tensor_auto_on_the_cpu_is_zstd_on_the_exponent_plane() -> None:
    e = ItemEncoder(EncodeConfig(codec="auto", codec_threads=1))
    try:
        item = e.encode_tensor(weights_like((256, 256)), "w")
        assert item.header.transform == TRANSFORM_BYTEPLANES
        assert item.header.plane_codecs == (0, 0, 0, codec_id("zstd"))
        assert item.nbytes < 256 * 256 * 4
    finally:
        e.close()


def test_encode_tensor_of_views(enc: ItemEncoder) -> None:
    base = weights_like((300, 200), torch.bfloat16, seed=4)
    for view in (base[::2, 5:150], base.t(), base[7], base[3, 4], base.as_strided((1,), (13,), 5)):
        item = enc.encode_tensor(view, "v")
        assert item.header.shape == tuple(view.shape)
        assert bit_equal(_decoded_tensor(item, torch.bfloat16), view.contiguous())


def test_encode_tensor_stores_lazy_conj_and_neg_resolved(enc: ItemEncoder) -> None:
    c = torch.randn(50, dtype=torch.complex64)
    assert bit_equal(_decoded_tensor(enc.encode_tensor(c.conj(), "c"), torch.complex64), c.conj().resolve_conj())
    if hasattr(torch.Tensor, "_neg_view"):
        f = torch.randn(50)
        assert bit_equal(_decoded_tensor(enc.encode_tensor(f._neg_view(), "n"), torch.float32), -f)


def test_encode_tensor_with_requires_grad(enc: ItemEncoder) -> None:
    t = torch.randn(100, requires_grad=True)
    assert bit_equal(_decoded_tensor(enc.encode_tensor(t, "g"), torch.float32), t.detach())


@no_gpu
@pytest.mark.parametrize("codec", ["ans", "bitcomp"])
def test_encode_tensor_gpu_only_codec_without_gpu(codec: str) -> None:
    e = ItemEncoder(EncodeConfig(codec=codec, codec_threads=1))
    try:
        with pytest.raises(CodecUnavailableError, match=f"state_dict entry 'layer.w'.*{codec!r}"):
            e.encode_tensor(torch.ones(10), "state_dict entry 'layer.w'")
        with pytest.raises(CodecUnavailableError, match="scalar"):
            e.encode_tensor(torch.tensor(1.0), "scalar")  # one element is not empty
    finally:
        e.close()


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 2)])
def test_encode_tensor_gpu_only_codec_empty_tensor_is_stored_raw(shape: tuple[int, ...]) -> None:
    e = ItemEncoder(EncodeConfig(codec="ans", codec_threads=1))
    try:
        t = torch.empty(shape, dtype=torch.float32)
        item = e.encode_tensor(t, "empty")
        assert item.header.plane_codecs == (0,)
        assert item.header.transform == TRANSFORM_NONE
        assert item.header.shape == shape and item.header.raw_nbytes == 0 and item.chunks == []
        assert descriptor_codec(item) == "none"
        assert _decoded_tensor(item, torch.float32).shape == shape
    finally:
        e.close()


def test_encode_tensor_unsupported_dtype_names_where(enc: ItemEncoder) -> None:
    t = torch.empty(4, dtype=UNSUPPORTED)
    with pytest.raises(ValueError, match="state_dict entry 'q': nvdcp cannot store tensors of dtype"):
        enc.encode_tensor(t, "state_dict entry 'q'")


def test_encode_items_unsupported_dtype_names_the_described_key(enc: ItemEncoder) -> None:
    items = [("a", torch.ones(3)), ("bad", torch.empty(2, dtype=UNSUPPORTED))]
    with pytest.raises(ValueError, match="<bad>"):
        list(enc.encode_items(items, lambda key: f"<{key}>"))


# -- encode_items / encode_owned ---------------------------------------------------------------
def test_encode_items_keeps_input_order_and_kinds(enc: ItemEncoder) -> None:
    tensors = {f"t{i}": random_tensor(torch.float32, (100 + i,), seed=i) for i in range(5)}
    items: list[tuple[str, object]] = []
    for i, (k, v) in enumerate(tensors.items()):
        items.append((k, v))
        items.append((f"b{i}", io.BytesIO(f"blob {i}".encode() * 50)))
    items.append(("raw", b"plain bytes"))
    described: list[str] = []

    def describe(key: str) -> str:
        described.append(key)
        return f"entry {key!r}"

    out = list(enc.encode_items(items, describe))  # type: ignore[arg-type]
    assert [k for k, _ in out] == [k for k, _ in items]
    assert set(described) <= set(tensors)  # only tensors are described
    for (_, data), (_, item) in zip(items, out):
        if isinstance(data, torch.Tensor):
            assert bit_equal(_decoded_tensor(item, torch.float32), data)
        elif isinstance(data, io.BytesIO):
            assert _decoded_bytes(item) == data.getvalue()
        else:
            assert _decoded_bytes(item) == data


def test_encode_items_pulls_one_large_item_ahead_and_no_further(enc: ItemEncoder) -> None:
    """A large item's record comes once the next item was pulled (its compression starts while
    the caller writes the record), and no item beyond that one is asked for."""
    pulled = []

    def items() -> Iterator[tuple[str, torch.Tensor]]:
        for key in ("a", "b"):
            pulled.append(key)
            yield key, torch.ones(SMALL_ITEM_BYTES // 4)
        raise RuntimeError("third item requested")

    gen = enc.encode_items(items(), str)
    key, first = next(gen)
    assert key == "a" and first.header.shape == (SMALL_ITEM_BYTES // 4,)
    assert pulled == ["a", "b"]
    with pytest.raises(RuntimeError, match="third item requested"):
        next(gen)


def test_the_next_large_item_is_compressed_while_the_caller_holds_the_record_before_it(
    enc: ItemEncoder, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the caller writes item N's record, item N+1 is being compressed: the caller sees
    N+1's compression start before it asks for the next record (without the overlap it would
    wait here forever). Records come in the items' order, small ones between large ones too,
    each the record that item gets encoded alone; closing the generator waits for the item
    compressed ahead."""
    started: dict[str, threading.Event] = collections.defaultdict(threading.Event)
    finished: list[str] = []
    encode_cpu = ItemEncoder._encode_cpu

    slow: set[str] = set()

    def watched(self: ItemEncoder, data: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
        started[key].set()
        out = encode_cpu(self, data, key, *args, **kwargs)
        time.sleep(0.5 if key in slow else 0.02)
        finished.append(key)
        return out

    monkeypatch.setattr(ItemEncoder, "_encode_cpu", watched)
    big = SMALL_ITEM_BYTES // 4
    order = ["L0", "L1", "s2", "s3", "L4", "L5"]
    tensors = {k: torch.arange(big if k[0] == "L" else 100, dtype=torch.float32) + i for i, k in enumerate(order)}
    gen = enc.encode_items(iter(tensors.items()), str)
    got = []
    for key, record in gen:
        got.append(key)
        nxt = order.index(key) + 1
        if key[0] == "L" and nxt < len(order) and order[nxt][0] == "L":
            assert started[order[nxt]].wait(10), f"{order[nxt]} was not compressed while {key} was written"
        assert decode_item(_record(record), key, None, 4)[1].tobytes() == tensors[key].numpy().tobytes()
    assert got == order

    slow.add("L1")
    finished.clear()
    gen = enc.encode_items(iter(tensors.items()), str)
    assert next(gen)[0] == "L0"
    assert "L1" not in finished  # still compressing (0.5 s)
    gen.close()
    assert finished == ["L0", "L1"]  # close waited for the item compressed ahead


def test_encode_items_batches_small_items_with_a_bounded_look_ahead(enc: ItemEncoder) -> None:
    """Small items are encoded in batches on the pool: the caller's items are pulled ahead of
    the records, but only a few batches' worth, and records come back in order."""
    pulled = []

    def items() -> Iterator[tuple[int, torch.Tensor]]:
        for i in itertools.count():
            pulled.append(i)
            yield i, torch.full((16,), float(i))

    gen = enc.encode_items(items(), str)
    records = [next(gen) for _ in range(3 * SMALL_BATCH_ITEMS)]
    assert [k for k, _ in records] == list(range(3 * SMALL_BATCH_ITEMS))
    assert len(pulled) <= (2 * enc.config.threads + 5) * SMALL_BATCH_ITEMS
    for key, record in records[:: SMALL_BATCH_ITEMS // 4]:
        assert bit_equal(_decoded_tensor(record, torch.float32), torch.full((16,), float(key)))
    gen.close()


def test_small_item_batches_run_at_most_small_item_threads_at_once_on_the_codec_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three file threads' small-item batches run at most SMALL_ITEM_THREADS at once (the codec
    pool here has more threads), and no thread is added for them (the codec pool runs them)."""
    enc = ItemEncoder(EncodeConfig(codec="zstd", chunk_bytes=4096, codec_threads=6))
    running, most, threads = [0], [0], set()
    lock = threading.Lock()
    real = enc._encode_small

    def watched(*args: Any, **kwargs: Any) -> Any:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            threads.add(threading.current_thread().name)
        time.sleep(0.0005)
        with lock:
            running[0] -= 1
        return real(*args, **kwargs)

    monkeypatch.setattr(enc, "_encode_small", watched)
    items = [(i, torch.full((16,), float(i))) for i in range(4 * SMALL_BATCH_ITEMS)]
    results: list[list[int]] = [[], [], []]

    def one_file(k: int) -> None:
        results[k] = [key for key, _ in enc.encode_items(items, str)]

    files = [threading.Thread(target=one_file, args=(k,)) for k in range(3)]
    for t in files:
        t.start()
    for t in files:
        t.join()
    enc.close()
    assert results == [list(range(len(items)))] * 3
    assert 1 <= most[0] <= encoder_module.SMALL_ITEM_THREADS == 2
    assert threads and all(name.startswith("nvdcp-codec") for name in threads)


def test_encode_items_error_in_a_batch_names_the_item(enc: ItemEncoder) -> None:
    bad = torch.quantize_per_tensor(torch.ones(8), 0.1, 0, torch.quint8)  # no dtype code in the format
    with pytest.raises(ValueError, match="item bad"):
        list(enc.encode_items([("ok", torch.ones(8)), ("bad", bad), ("after", torch.ones(8))], "item {}".format))


def test_encode_items_of_nothing(enc: ItemEncoder) -> None:
    assert list(enc.encode_items([], str)) == []


def test_encode_owned_tensor_and_bytes(enc: ItemEncoder) -> None:
    t = weights_like((64, 64), seed=5)
    item = enc.encode_owned(t, "owned")
    assert bit_equal(_decoded_tensor(item, torch.float32), t)
    blob = enc.encode_owned(io.BytesIO(b"xyz" * 1000), "blob")
    assert _decoded_bytes(blob) == b"xyz" * 1000


@no_gpu
def test_encode_owned_error_names_where() -> None:
    e = ItemEncoder(EncodeConfig(codec="bitcomp", codec_threads=1))
    try:
        with pytest.raises(CodecUnavailableError, match="model.w"):
            e.encode_owned(torch.ones(8), "model.w")
    finally:
        e.close()


# -- routing -----------------------------------------------------------------------------------
@no_gpu
@pytest.mark.parametrize("codec", ["auto", "zstd", "ans"])
def test_uses_gpu_is_false_without_cuda(codec: str) -> None:
    e = ItemEncoder(EncodeConfig(codec=codec))
    for t in (torch.ones(10), torch.empty(0), torch.tensor(2.0)):
        assert e.uses_gpu(t) is False
        assert e.uses_gpu(t, gpu_ok=False) is False


def test_uses_gpu_routing_when_a_gpu_is_said_to_work() -> None:
    """``gpu_ok=True`` stands for a GPU machine: CPU tensors go to the GPU only for GPU-only codecs."""
    zstd = ItemEncoder(EncodeConfig(codec="zstd"))
    ans = ItemEncoder(EncodeConfig(codec="ans"))
    assert zstd.uses_gpu(torch.ones(10), gpu_ok=True) is False
    assert ans.uses_gpu(torch.ones(10), gpu_ok=True) is True
    assert ans.uses_gpu(torch.empty(0, 3), gpu_ok=True) is False  # empty: stored raw on the CPU


# -- descriptor_codec --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("codec", "dtype", "expected"),
    [
        ("auto", torch.float32, "zstd"),
        ("gdeflate", torch.bfloat16, "gdeflate"),
        ("zstd", torch.int64, "zstd"),
        ("gdeflate", torch.int8, "gdeflate"),
        ("none", torch.float32, "none"),
    ],
)
def test_descriptor_codec(codec: str, dtype: torch.dtype, expected: str) -> None:
    e = ItemEncoder(EncodeConfig(codec=codec, codec_threads=1))
    try:
        item = e.encode_tensor(torch.zeros(100, dtype=dtype), "d")
        assert descriptor_codec(item) == expected
        assert descriptor_codec(item) == choose_layout(dtype, codec).descriptor_codec
    finally:
        e.close()


def test_descriptor_codec_names_the_first_non_none_plane() -> None:
    item = ItemEncoder(EncodeConfig(codec="zstd", codec_threads=1)).encode_tensor(torch.zeros(8), "x")
    header = item.header.__class__(**{**item.header.__dict__, "plane_codecs": (0, 2, 1, 0)})
    assert descriptor_codec(EncodedItem(header, header.pack(), item.chunks)) == "gdeflate"


# -- resources ---------------------------------------------------------------------------------
def test_codec_pool_is_made_once_with_the_configured_threads() -> None:
    e = ItemEncoder(EncodeConfig(codec_threads=3))
    try:
        pool = e.codec_pool()
        assert e.codec_pool() is pool
        assert pool._max_workers == 3
    finally:
        e.close()


def test_close_then_reuse(enc: ItemEncoder) -> None:
    t = weights_like((100, 100), seed=6)
    first = enc.encode_tensor(t, "x")
    pool = enc._pool
    assert pool is not None
    enc.close()
    assert enc._pool is None and enc._idle == {}
    with pytest.raises(RuntimeError):
        pool.submit(int)  # the old threads are gone
    again = enc.encode_tensor(t, "x")
    assert enc._pool is not None and enc._pool is not pool
    assert again.header_bytes == first.header_bytes
    assert [bytes(c) for c in again.chunks] == [bytes(c) for c in first.chunks]
    enc.close()
    enc.close()  # closing twice is harmless


# -- shared encoders ---------------------------------------------------------------------------
@pytest.fixture
def clean_shared() -> Iterator[None]:
    close_shared_encoders()
    yield
    close_shared_encoders()


def test_shared_encoder_is_shared_per_settings(clean_shared: None) -> None:
    a = shared_encoder(EncodeConfig(codec="zstd"), GpuConfig())
    assert shared_encoder(EncodeConfig(codec="zstd"), GpuConfig()) is a
    assert a.config == EncodeConfig(codec="zstd") and a.gpu == GpuConfig()
    assert shared_encoder(EncodeConfig(codec="gdeflate"), GpuConfig()) is not a
    assert shared_encoder(EncodeConfig(codec="zstd", chunk_bytes=4096), GpuConfig()) is not a
    assert shared_encoder(EncodeConfig(codec="zstd"), GpuConfig(pinned_memory_bytes=64 << 20)) is not a


def test_close_shared_encoders_closes_and_forgets(clean_shared: None) -> None:
    a = shared_encoder(EncodeConfig(codec_threads=1), GpuConfig())
    a.encode_tensor(torch.ones(10), "x")
    assert a._pool is not None
    close_shared_encoders()
    assert a._pool is None  # closed
    b = shared_encoder(EncodeConfig(codec_threads=1), GpuConfig())
    assert b is not a
    assert not encoder_module._SHARED or all(v is not a for v in encoder_module._SHARED.values())


def test_release_resources_closes_shared_encoders(clean_shared: None) -> None:
    import nvdcp

    a = shared_encoder(EncodeConfig(codec_threads=1), GpuConfig())
    nvdcp.release_resources()
    assert shared_encoder(EncodeConfig(codec_threads=1), GpuConfig()) is not a


# -- pickling ----------------------------------------------------------------------------------
def test_pickle_round_trip_keeps_settings_not_runtime() -> None:
    cfg = EncodeConfig(codec="gdeflate", chunk_bytes=2048, codec_threads=2)
    gpu = GpuConfig(pinned_memory_bytes=32 << 20, gdeflate_algorithm_type=1)
    e = ItemEncoder(cfg, gpu)
    try:
        t = weights_like((50, 50), seed=7)
        before = e.encode_tensor(t, "p")  # starts the codec threads, which must not travel
        clone = pickle.loads(pickle.dumps(e))
        assert clone.config == cfg and clone.gpu == gpu
        assert clone._pool is None and clone._pinned is None and clone._idle == {}
        assert clone._lock is not e._lock
        after = clone.encode_tensor(t, "p")
        assert after.header_bytes == before.header_bytes
        assert bit_equal(_decoded_tensor(after, torch.float32), t)
        clone.close()
    finally:
        e.close()

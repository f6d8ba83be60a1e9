"""ChunkSpans: an item's chunks as spans of a few buffers, with a view per chunk made on access."""

from __future__ import annotations

import ctypes
import gc
from typing import Any

import numpy as np
import pytest

from nvdcp.storage.spans import ChunkSpans


def _spans() -> tuple[ChunkSpans, list[bytes]]:
    a = memoryview(bytes(range(200)))
    b = memoryview(bytes(range(100, 160)))
    spans = ChunkSpans()
    spans.add(a, np.array([0, 16, 64]), np.array([10, 40, 3]))  # gaps between chunks, as after packing
    spans.add(b, np.array([5]), np.array([50]))
    want = [bytes(a[0:10]), bytes(a[16:56]), bytes(a[64:67]), bytes(b[5:55])]
    return spans, want


def test_iteration_indexing_and_sizes() -> None:
    spans, want = _spans()
    assert len(spans) == 4
    assert [bytes(c) for c in spans] == want
    assert [bytes(spans[i]) for i in range(4)] == want
    assert bytes(spans[-1]) == want[-1]
    assert [bytes(c) for c in spans[1:3]] == want[1:3]
    assert spans.sizes.tolist() == [10, 40, 3, 50] and spans.nbytes == 103
    assert b"".join(spans) == b"".join(want)  # what the writer does with an item's chunks
    with pytest.raises(IndexError, match="chunk 4 of 4"):
        spans[4]


def test_extend_and_copied_keep_the_bytes() -> None:
    spans, want = _spans()
    backing = bytearray(b"x" * 32)
    more = ChunkSpans()
    more.add(memoryview(backing), np.array([4]), np.array([8]))
    spans.extend(more)
    copied = spans.copied()
    backing[:] = b"y" * 32  # the buffer is reused: the copy keeps what it held
    assert [bytes(c) for c in copied] == [*want, b"x" * 8]
    assert bytes(spans[-1]) == b"y" * 8


def test_empty_and_mismatched() -> None:
    spans = ChunkSpans()
    spans.add(memoryview(b"abc"), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    assert len(spans) == 0 and list(spans) == [] and spans.nbytes == 0 and spans.sizes.size == 0
    with pytest.raises(ValueError, match="2 chunk starts for 1 sizes"):
        spans.add(memoryview(b"abc"), np.array([0, 1]), np.array([1]))


def test_holds_no_object_per_chunk() -> None:
    """Thousands of chunks, a handful of garbage-collected objects (why the class exists)."""
    buffer = memoryview(bytes(1 << 20))
    gc.collect()
    before = len(gc.get_objects())
    held = []
    for _ in range(10):
        spans = ChunkSpans()
        spans.add(buffer, np.arange(1000) * 1000, np.full(1000, 900))
        held.append(spans)
    gc.collect()
    assert len(gc.get_objects()) - before < 100  # 10,000 chunks
    assert sum(len(s) for s in held) == 10_000


def _local_stream(tmp_path: Any, name: str = "f") -> Any:
    from nvdcp.storage.local import LocalStorage

    storage = LocalStorage(str(tmp_path))
    storage.prepare()
    return storage, storage.create(name)


@pytest.mark.parametrize("parallel", [False, True])
def test_local_write_spans_writes_head_and_chunks_in_order(tmp_path: Any, parallel: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Vectored writes straight from spans (more chunks than IOV_MAX, split over I/O threads)
    give the bytes of writing each chunk in turn."""
    from nvdcp.storage import local

    monkeypatch.setattr(local, "PARALLEL_MIN_BYTES", 1 << 16)
    monkeypatch.setattr(local, "PARALLEL_SLICE_BYTES", 1 << 14)
    rng = np.random.default_rng(0)
    backing = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    starts = np.sort(rng.choice(np.arange(0, (3 << 20) - 600, 640), 3000, replace=False))
    sizes = rng.integers(0, 600, len(starts))
    spans = ChunkSpans()
    spans.add(memoryview(backing), starts, sizes)
    spans.add(memoryview(b"tail-bytes"), np.array([0, 5]), np.array([4, 5]))
    storage, stream = _local_stream(tmp_path)
    stream.write(b"file-header")
    stream.write_spans(b"HEAD", spans, parallel=parallel)
    stream.write(b"after")
    assert stream.tell() == len(b"file-header") + 4 + spans.nbytes + 5
    stream.commit()
    got = (tmp_path / "f").read_bytes()
    assert got == b"file-header" + b"HEAD" + b"".join(bytes(c) for c in spans) + b"after"


def test_local_write_spans_short_writes_resume_inside_a_chunk(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pwritev that moves fewer bytes than asked (allowed by POSIX) is resumed where it stopped."""
    from nvdcp.storage import local

    real = local._PWRITEV
    calls = []

    def short(fd: int, iov: int, count: int, offset: int) -> int:
        rows = np.ctypeslib.as_array(ctypes.cast(iov, ctypes.POINTER(ctypes.c_uint64)), shape=(count, 2))
        first = int(rows[0, 1])
        calls.append(first)
        return int(real(fd, iov, 1, offset)) if first < 7 else int(_partial(real, fd, rows, offset, first // 2))

    monkeypatch.setattr(local, "_PWRITEV", short)
    data = bytes(range(256)) * 4
    spans = ChunkSpans()
    spans.add(memoryview(data), np.array([0, 100, 500]), np.array([50, 300, 400]))
    storage, stream = _local_stream(tmp_path)
    stream.write_spans(b"H", spans)
    stream.commit()
    assert (tmp_path / "f").read_bytes() == b"H" + data[0:50] + data[100:400] + data[500:900]
    assert len(calls) > 4  # every chunk was split at least once


def _partial(real: Any, fd: int, rows: np.ndarray, offset: int, n: int) -> int:
    one = np.array([[rows[0, 0], n]], dtype=np.uint64)
    return int(real(fd, one.ctypes.data, 1, offset))


def test_other_streams_write_spans_chunk_by_chunk(tmp_path: Any) -> None:
    from nvdcp.storage.base import WriteStream

    class Collect(WriteStream):
        def __init__(self) -> None:
            self.parts: list[bytes] = []

        def write(self, data: Any) -> None:
            self.parts.append(bytes(data))

        def tell(self) -> int:
            return sum(map(len, self.parts))

        def commit(self) -> None: ...

        def abort(self) -> None: ...

    spans, want = _spans()
    s = Collect()
    s.write_spans(b"H", spans)
    assert s.parts == [b"H", *want]


@pytest.mark.parametrize("max_run", [None, 1 << 20])
def test_record_writer_writes_span_records_like_chunk_lists(tmp_path: Any, max_run: int | None) -> None:
    """A record whose chunks are spans (as GPU-staged records are) lands in the data file byte
    for byte as the same record with a list of chunks."""
    import torch

    from nvdcp.dcp.writer import _RecordWriter
    from nvdcp.pipeline.config import EncodeConfig
    from nvdcp.pipeline.cpu import EncodedItem
    from nvdcp.pipeline.encoder import ItemEncoder

    encoder = ItemEncoder(EncodeConfig("zstd", 4096, 2))
    big = encoder.encode_tensor(torch.randn(300_000, generator=torch.Generator().manual_seed(2)), "big")
    small = encoder.encode_tensor(torch.arange(100, dtype=torch.float32), "small")
    encoder.close()
    # The big record's chunks copied into one buffer with gaps between them, as packed on a GPU.
    starts, pos = [], 0
    for c in big.chunks:
        starts.append(pos)
        pos += -(-(len(c) + 1) // 256) * 256
    backing = bytearray(pos)
    for s, c in zip(starts, big.chunks):
        backing[s : s + len(c)] = c
    spans = ChunkSpans()
    spans.add(memoryview(backing), np.array(starts), np.array([len(c) for c in big.chunks]))
    as_spans = EncodedItem(big.header, big.header_bytes, spans)
    files = {}
    for name, record in (("list", big), ("spans", as_spans)):
        storage, stream = _local_stream(tmp_path, name)
        writer = _RecordWriter(stream, max_run)
        writer.start(b"file-header")
        offsets = [writer.append(small), writer.append(record), writer.append(small)]
        writer.flush()
        stream.commit()
        files[name] = ((tmp_path / name).read_bytes(), offsets)
    assert files["list"] == files["spans"]
    assert len(files["spans"][0]) == len(b"file-header") + 2 * small.nbytes + big.nbytes


@pytest.mark.parametrize("parallel", [False, True])
def test_local_read_into_spans_scatters_a_file_range_into_slots(tmp_path: Any, parallel: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU reader's staging slots as spans: one vectored read (split over I/O threads when
    large) lands each chunk of a contiguous file range in its slot."""
    from nvdcp.storage import local

    if parallel:
        monkeypatch.setattr(local, "PARALLEL_MIN_BYTES", 1 << 16)
        monkeypatch.setattr(local, "PARALLEL_SLICE_BYTES", 1 << 14)
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 600_000, dtype=np.uint8).tobytes()
    (tmp_path / "f").write_bytes(b"prefix" + data)
    storage = local.LocalStorage(str(tmp_path))
    sizes = rng.integers(1, 700, 1500)
    sizes = sizes[: np.searchsorted(np.cumsum(sizes), len(data))]
    stride = 1024
    staging = bytearray(stride * len(sizes))
    slots = ChunkSpans()
    slots.add(memoryview(staging), np.arange(len(sizes)) * stride, sizes)
    storage.read_into("f", 6, slots)
    pos = 0
    for i, n in enumerate(sizes.tolist()):
        assert staging[i * stride : i * stride + n] == data[pos : pos + n], i
        pos += n


def test_local_read_into_spans_past_the_end_is_truncation(tmp_path: Any) -> None:
    from nvdcp.errors import TruncatedCheckpointError
    from nvdcp.storage import local

    (tmp_path / "f").write_bytes(b"x" * 100)
    storage = local.LocalStorage(str(tmp_path))
    slots = ChunkSpans()
    slots.add(memoryview(bytearray(4096)), np.array([0, 2048]), np.array([80, 80]))
    with pytest.raises(TruncatedCheckpointError, match="file ends at offset 100"):
        storage.read_into("f", 0, slots)


def test_gather_writes_its_pieces_in_order_through_local_and_generic_streams(tmp_path: Any) -> None:
    """A Gather's pieces, from two buffers in any interleaving, land in the file in order
    (local files: vectored calls over numpy-built iovecs; other streams: a view per piece);
    empty pieces are skipped and a piece past its buffer is refused before anything is written."""
    from nvdcp.storage.base import WriteStream
    from nvdcp.storage.local import LocalStorage
    from nvdcp.storage.spans import Gather

    heads = memoryview(bytes(range(50)))
    body = memoryview(bytes(range(100, 250)))
    which = np.array([0, 1, 1, 0, 1, 0], dtype=np.int64)
    starts = np.array([0, 10, 40, 7, 0, 49], dtype=np.int64)
    sizes = np.array([7, 20, 0, 3, 5, 1], dtype=np.int64)
    gather = Gather([heads, body], which, starts, sizes)
    want = b"".join(bytes([heads, body][w][s : s + n]) for w, s, n in zip(which, starts, sizes))
    assert b"".join(gather) == want and gather.nbytes == len(want) == 36 and len(gather) == 6

    storage = LocalStorage(tmp_path / "ck", sync=False)
    storage.prepare()
    stream = storage.create("data")
    stream.write(b"HEAD")
    stream.write_gather(gather)
    stream.write(b"TAIL")
    stream.commit()
    assert (tmp_path / "ck" / "data").read_bytes() == b"HEAD" + want + b"TAIL"

    class Collect(WriteStream):
        def __init__(self) -> None:
            self.out = bytearray()

        def write(self, data: Any) -> None:
            self.out += bytes(data)

        def tell(self) -> int:
            return len(self.out)

        def commit(self) -> None: ...

        def abort(self) -> None: ...

    generic = Collect()
    generic.write_gather(gather)
    assert bytes(generic.out) == want

    past = Gather([heads, body], np.array([1]), np.array([140]), np.array([20]))
    stream = storage.create("bad")
    with pytest.raises(ValueError, match="past its 150-byte buffer"):
        stream.write_gather(past)
    assert stream.tell() == 0
    stream.abort()
    with pytest.raises(ValueError, match="2 buffer indexes, 1 starts, 1 sizes"):
        Gather([heads], np.array([0, 0]), np.array([0]), np.array([1]))

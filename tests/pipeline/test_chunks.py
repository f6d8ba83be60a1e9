"""ChunkSpans: an item's chunks as spans of a few buffers, with a view per chunk made on access."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from nvdcp.pipeline.chunks import ChunkSpans


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

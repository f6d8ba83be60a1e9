"""RecordBatch: a bucket's whole records as arrays; parts of it, and its split over files."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from nvdcp.format.header import KIND_TENSOR, TRANSFORM_NONE, parse_item_header_only
from nvdcp.format.header_batch import HeaderFields, header_layout, pack_headers_into
from nvdcp.pipeline.record_batch import RecordBatch, split_by_load


def _batch(chunk_counts: list[int], seed: int = 0) -> RecordBatch:
    """Records of float32 items (one plane) with ``chunk_counts[i]`` chunks each (0: empty),
    chunks scattered through one buffer with padding between them, as after compaction."""
    rng = np.random.default_rng(seed)
    counts = np.asarray(chunk_counts, dtype=np.int64)
    first_chunk = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    n_chunks = int(first_chunk[-1])
    stored = rng.integers(1, 3000, n_chunks).astype(np.int64)
    starts = np.concatenate(([0], np.cumsum(-(-stored // 256) * 256)[:-1])).astype(np.int64) if n_chunks else stored
    chunks = memoryview(rng.integers(0, 256, int(starts[-1] + stored[-1]) if n_chunks else 0, dtype=np.uint8).tobytes())
    table = np.stack([stored, rng.integers(0, 2**32, n_chunks)], axis=1).astype(np.uint32)
    fields = [HeaderFields(KIND_TENSOR, 9, TRANSFORM_NONE, (4,), (int(k), 256), 1024, int(k) * 1024)
              for k in counts.tolist()]
    table_at, sizes = header_layout(fields, counts)
    header_starts = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    headers = np.empty(int(header_starts[-1]), dtype=np.uint8)
    digests = pack_headers_into(headers, header_starts[:-1], fields, table_at, sizes, table, first_chunk)
    jobs = [SimpleNamespace(key=f"item{i}") for i in range(len(counts))]
    return RecordBatch(jobs, fields, headers, header_starts, digests, chunks, starts, table, first_chunk, 1024)


def _record_bytes(batch: RecordBatch) -> list[bytes]:
    return [record.header_bytes + b"".join(record.chunks) for _, record in batch.items()]


def test_items_gather_and_sizes_agree() -> None:
    batch = _batch([1, 4, 0, 3, 2])
    records = batch.items()
    assert [job.key for job, _ in records] == [f"item{i}" for i in range(5)]
    for (_, record), size, digest in zip(records, batch.record_nbytes.tolist(), batch.digests.tolist()):
        parsed = parse_item_header_only(memoryview(record.header_bytes), "test")  # parses, CRC checked
        assert parsed == record.header and record.header.stored_crc == digest
        assert record.nbytes == size == len(record.header_bytes) + sum(len(c) for c in record.chunks)
    assert b"".join(bytes(p) for p in batch.gather()) == b"".join(_record_bytes(batch))
    assert batch.nbytes == sum(map(len, _record_bytes(batch)))
    assert batch.raw_nbytes == (1 + 4 + 0 + 3 + 2) * 1024


@pytest.mark.parametrize(("lo", "hi"), [(0, 5), (1, 3), (2, 3), (4, 5), (3, 3)])
def test_a_part_is_those_records(lo: int, hi: int) -> None:
    batch = _batch([1, 4, 0, 3, 2], seed=1)
    part = batch.part(lo, hi)
    assert len(part) == hi - lo
    assert _record_bytes(part) == _record_bytes(batch)[lo:hi]
    assert b"".join(bytes(p) for p in part.gather()) == b"".join(_record_bytes(batch)[lo:hi])
    assert part.record_nbytes.tolist() == batch.record_nbytes.tolist()[lo:hi]
    if hi > lo:  # a part of a part
        assert _record_bytes(part.part(0, 1)) == _record_bytes(batch)[lo : lo + 1]
    with pytest.raises(ValueError, match="records 2..7 of a batch of 5"):
        batch.part(2, 7)


@pytest.mark.parametrize("loads", [[0, 0, 0, 0], [5000, 0, 0, 20000], [0, 10**9], [300, 100, 200]])
def test_split_by_load_covers_the_batch_in_order_and_evens_out_the_files(loads: list[int]) -> None:
    batch = _batch([1, 2, 1, 3, 1, 1, 2, 1, 1, 4, 1, 1, 2, 1, 1, 1] * 4, seed=2)
    parts = split_by_load(batch, loads)
    # consecutive, in order, nothing left out or given twice; one part per file at most
    assert b"".join(b"".join(_record_bytes(p)) for _, p in parts) == b"".join(_record_bytes(batch))
    assert len({f for f, _ in parts}) == len(parts)
    after = list(loads)
    for f, part in parts:
        after[f] += part.nbytes
    got = [after[f] for f, _ in parts]
    biggest = int(batch.record_nbytes.max())
    # the files given a part end within a record of each other; a file given none was above that level
    assert max(got) - min(got) <= 2 * biggest, (loads, after)
    assert all(after[f] + biggest >= max(got) for f in range(len(loads)) if f not in {g for g, _ in parts})
    if loads == [0, 10**9]:
        assert [f for f, _ in parts] == [0]  # the busy file gets nothing


def test_split_by_load_of_an_empty_batch() -> None:
    batch = _batch([2, 1]).part(1, 1)
    assert split_by_load(batch, [0, 0]) == []


def test_split_by_load_breaks_ties_by_bytes_given() -> None:
    """Files with nothing queued (they keep up) are filled fewest-bytes-given first, so a batch
    of two records does not always land on the same two of four files."""
    batch = _batch([1, 1], seed=3)
    assert [f for f, _ in split_by_load(batch, [0, 0, 0, 0], [900, 0, 500, 100])][:2] == [1, 3]
    assert [f for f, _ in split_by_load(batch, [0, 0, 0, 0], [0, 900, 100, 500])][:2] == [0, 2]

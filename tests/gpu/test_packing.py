"""The GPU encoder's packing of stored chunks, run on the CPU: the same torch gather and the same
host placement the GPU path uses, so the layout logic is checked on every machine."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

from nvdcp.dcp.stager import HostBuffers
from nvdcp.gpu import encoder as encoder_module
from nvdcp.gpu.encoder import HostBucket, compaction_plan, granule_for, pack_chunks
from nvdcp.gpu.plan import Bucket, JobColumns, SlotLayout
from nvdcp.transform import delta as delta_transform

MiB = 1 << 20


def test_granule_divides_the_chunk_size() -> None:
    assert granule_for(65536) == 256
    assert granule_for(1024) == 256
    assert granule_for(3000) == 8
    assert granule_for(1025) == 1


def _arena_with_chunks(rng: np.random.Generator, stored: list[int], chunk: int, granule: int) -> tuple[torch.Tensor, np.ndarray]:
    """An arena holding chunks at shuffled, granule-aligned, non-overlapping places."""
    slot = -(-chunk // granule) * granule
    order = rng.permutation(len(stored))
    src = np.asarray([int(k) * slot for k in order], dtype=np.int64)
    arena = torch.from_numpy(rng.integers(0, 256, size=max(len(stored) * slot, granule), dtype=np.uint8))
    return arena, src


@pytest.mark.parametrize("chunk", [4096, 3000, 1025])
@pytest.mark.parametrize("seed", range(20))
def test_packed_chunks_equal_the_source_chunks(chunk: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, chunk + 1, size=int(rng.integers(0, 40)))
    sizes[rng.random(len(sizes)) < 0.2] = chunk  # some chunks stored raw, whole
    stored = sizes.astype(np.int64)
    g = granule_for(chunk)
    arena, src = _arena_with_chunks(rng, stored.tolist(), chunk, g)
    packed, offsets = pack_chunks(arena, src, stored, g)
    assert len(offsets) == len(stored) + 1
    assert all(o % g == 0 for o in offsets)
    assert offsets[-1] <= stored.sum() + len(stored) * (g - 1)  # padding below one granule per chunk
    flat = packed.numpy()
    for i, n in enumerate(stored.tolist()):
        assert offsets[i] + n <= offsets[i + 1]
        assert bytes(flat[offsets[i] : offsets[i] + n]) == bytes(arena.numpy()[src[i] : src[i] + n])


def test_compaction_plan_of_nothing() -> None:
    rows, offsets = compaction_plan(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 256)
    assert rows.numel() == 0 and offsets.tolist() == [0]


def test_compaction_plan_rows() -> None:
    rows, offsets = compaction_plan(np.asarray([512, 0]), np.asarray([300, 256]), 256)
    assert rows.dtype == torch.int64 and rows.tolist() == [2, 3, 0]
    assert offsets.tolist() == [0, 512, 768]


def test_placement_covers_every_piece_in_order_without_splitting_one() -> None:
    buffers = HostBuffers(keep_bytes=16 * MiB, segment_bytes=MiB)
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 65536, size=300).astype(np.int64)
    runs = buffers.place(sizes)
    assert runs[0][1] == 0 and runs[-1][2] == len(sizes)
    for (_, _, hi), (_, lo, _) in itertools.pairwise(runs):
        assert hi == lo  # consecutive
    for buf, lo, hi in runs:
        assert buf.numel() == int(sizes[lo:hi].sum())
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b, _, _ in runs if b.numel())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))  # disjoint
    kept = buffers.kept_bytes
    assert kept <= 16 * MiB and buffers.temp_bytes == 0
    buffers.reset()
    again = buffers.place(sizes)
    assert [(b.data_ptr(), lo, hi) for b, lo, hi in again] == [(b.data_ptr(), lo, hi) for b, lo, hi in runs]
    assert buffers.kept_bytes == kept  # the second save reuses the memory


def test_placement_beyond_the_kept_limit_is_temporary() -> None:
    buffers = HostBuffers(keep_bytes=2 * MiB, segment_bytes=MiB)
    sizes = np.full(80, 65536, dtype=np.int64)  # 5 MiB
    runs = buffers.place(sizes)
    assert sum(b.numel() for b, _, _ in runs) == 5 * MiB
    assert buffers.kept_bytes <= 2 * MiB and buffers.temp_bytes >= 3 * MiB
    buffers.reset()
    assert buffers.temp_bytes == 0 and buffers.kept_bytes <= 2 * MiB


def test_placement_of_nothing_and_of_empty_pieces() -> None:
    buffers = HostBuffers(keep_bytes=MiB)
    assert buffers.place(np.zeros(0, dtype=np.int64)) == []
    runs = buffers.place(np.zeros(3, dtype=np.int64))
    assert [(b.numel(), lo, hi) for b, lo, hi in runs] == [(0, 0, 3)]


def test_host_bucket_views_are_the_stored_bytes() -> None:
    buffers = HostBuffers(keep_bytes=MiB, segment_bytes=MiB)
    stored = np.asarray([5, 0, 256, 70000 % 65536], dtype=np.int64)
    g = 256
    arena, src = _arena_with_chunks(np.random.default_rng(1), stored.tolist(), 65536, g)
    packed, offsets = pack_chunks(arena, src, stored, g)
    runs = buffers.place(np.diff(offsets))
    for host, lo, hi in runs:
        host.copy_(packed[int(offsets[lo]) : int(offsets[hi])])
    bucket = HostBucket(bucket=None, stored=stored, offsets=offsets, runs=runs, done=None)  # type: ignore[arg-type]
    views = bucket.views()
    assert [bytes(v) for v in views] == [bytes(arena.numpy()[s : s + n]) for s, n in zip(src, stored)]


@pytest.mark.parametrize("nbytes", [1, MiB, MiB + 1, 3 * MiB])
def test_pinned_footprint_is_the_next_power_of_two(nbytes: int) -> None:
    from nvdcp.dcp.stager import _pinned_footprint

    got = _pinned_footprint(nbytes)
    assert got >= nbytes and got & (got - 1) == 0 and got < 2 * nbytes + 1


def test_placement_after_a_segment_of_odd_size_never_goes_back() -> None:
    # A large host copy made a kept segment of MiB + 40 bytes (not a multiple of the 64-byte
    # alignment); a later save fills it exactly. The cursor used to land past its end, the next
    # step saw negative room and placed a piece twice, shifting every later chunk's bytes.
    buffers = HostBuffers(keep_bytes=1 << 30)
    buffers.alloc(MiB + 40)
    buffers.reset()
    sizes = np.asarray([MiB, 40, 16, 16], dtype=np.int64)
    runs = buffers.place(sizes)
    assert [(lo, hi) for _, lo, hi in runs] == [(0, 2), (2, 4)]
    assert [b.numel() for b, _, _ in runs] == [MiB + 40, 32]


class _CountingPool:
    """PinnedPool's interface over plain host tensors (no CUDA needed)."""

    def __init__(self) -> None:
        self.in_use = 0
        self.released: list[int] = []

    def acquire(self, nbytes: int) -> torch.Tensor:
        self.in_use += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def release(self, buf: torch.Tensor) -> None:
        self.in_use -= 1
        self.released.append(buf.numel())


def test_pooled_sink_releases_buckets_by_number_in_any_order() -> None:
    import threading

    from nvdcp.gpu.encoder import EncodedBucket, _PooledSink, _Stopped

    pool = _CountingPool()
    sink = _PooledSink(pool, depth=3)  # type: ignore[arg-type]
    runs = [sink.place(np.asarray([10 * (k + 1), 5])) for k in range(3)]
    assert [r[0][0].numel() for r in runs] == [15, 25, 35] and pool.in_use == 3
    placed: list[int] = []
    t = threading.Thread(target=lambda: placed.append(len(sink.place(np.asarray([7])))))
    t.start()
    t.join(0.3)
    assert t.is_alive(), "a fourth bucket must wait for room"
    buckets = [EncodedBucket([], k, sink) for k in range(3)]
    buckets[1].release()
    t.join(5)
    assert not t.is_alive() and placed == [1]
    buckets[1].release()  # twice: nothing more
    assert pool.in_use == 3
    sink.release(first=2)  # what the encoder does when it ends: the buckets never handed out
    assert pool.released == [25, 35, 7] and sorted(sink.held) == [0]
    sink.release_oldest()
    assert pool.in_use == 0 and sink.held == {}
    sink.release()  # nothing left: nothing happens
    assert pool.in_use == 0
    full = _PooledSink(pool, depth=1)  # type: ignore[arg-type]
    full.place(np.asarray([1]))
    full.closed = True  # a closed sink without room refuses new buckets instead of waiting
    with pytest.raises(_Stopped):
        full.place(np.asarray([1]))
    full.release()


# -- small tensors split into planes in groups --------------------------------------------------
def _reference_split(source: torch.Tensor, first_slot: int, p: int, m: int, slots: torch.Tensor) -> None:
    """The per-segment copy of a one-block segment (GpuEncoder._split_planes before grouping)."""
    slots[first_slot : first_slot + p, :m].copy_(source.view(m, p).t())


@pytest.mark.parametrize(("p", "m"), [(4, 1024), (2, 4096), (1, 3000), (8, 1), (4, 4096), (2, 1)])
@pytest.mark.parametrize("group_bytes", [1 << 20, 3 * 4096])
def test_small_tensors_split_in_groups_as_one_segment_at_a_time(
    p: int, m: int, group_bytes: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows land where the per-segment copies put them, whatever the group bound (several
    groups, and a group of one); bytes of other rows and past ``m`` are untouched."""
    monkeypatch.setattr(encoder_module, "SMALL_SPLIT_BYTES", group_bytes)
    chunk = 4096
    rng = np.random.default_rng(p * 7919 + m)
    k = 13
    sources = [torch.from_numpy(rng.integers(0, 256, size=m * p, dtype=np.uint8)) for _ in range(k)]
    order = rng.permutation(k)  # slots in another order than the sources, with gaps
    first_slots = [int(i) * (p + 1) for i in order]
    fill = torch.from_numpy(rng.integers(0, 256, size=(k * (p + 1) + 3, chunk), dtype=np.uint8))
    got, want = fill.clone(), fill.clone()
    encoder_module.split_small_tensors(sources, first_slots, p, m, got)
    for source, first in zip(sources, first_slots):
        _reference_split(source, first, p, m, want)
    assert torch.equal(got, want)
    assert not torch.equal(got, fill)


def _reference_split_blocks(source: torch.Tensor, first_slot: int, p: int, c: int, full: int, slots: torch.Tensor) -> None:
    """The per-segment copy of a segment of ``full`` whole blocks (GpuEncoder._split_planes)."""
    slots[first_slot : first_slot + full * p].view(full, p, c).copy_(source.view(full, c, p).permute(0, 2, 1))


@pytest.mark.parametrize(("p", "full"), [(4, 2), (2, 4), (1, 3), (8, 2)])
@pytest.mark.parametrize("group_bytes", [1 << 22, 3 * 4096])
def test_tensors_of_whole_blocks_split_in_groups_as_one_segment_at_a_time(
    p: int, full: int, group_bytes: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(encoder_module, "SMALL_SPLIT_BYTES", group_bytes)
    chunk = 1024
    rng = np.random.default_rng(p * 31 + full)
    k = 7
    sources = [torch.from_numpy(rng.integers(0, 256, size=full * chunk * p, dtype=np.uint8)) for _ in range(k)]
    order = rng.permutation(k)
    first_slots = [int(i) * (full * p + 1) for i in order]  # other order, with gaps
    fill = torch.from_numpy(rng.integers(0, 256, size=(k * (full * p + 1) + 2, chunk), dtype=np.uint8))
    got, want = fill.clone(), fill.clone()
    encoder_module.split_small_tensors(sources, first_slots, p, chunk, got, blocks=full)
    for source, first in zip(sources, first_slots):
        _reference_split_blocks(source, first, p, chunk, full, want)
    assert torch.equal(got, want)
    assert not torch.equal(got, fill)


# -- delta items and kept bytes split in runs ---------------------------------------------------
def _reference_segment(job: Any, seg: Any, slots: torch.Tensor, c: int) -> None:
    """The per-segment path of GpuEncoder._split_planes (before runs): keep, difference, split."""
    p = job.n_planes
    start = seg.first_block * c
    m = min(job.elements, (seg.first_block + seg.n_blocks) * c) - start
    full, tail = divmod(m, c)
    src = job.data[start * p : (start + m) * p]
    base = job.delta.base[start * p : (start + m) * p].clone() if job.delta is not None else None
    if job.keep is not None:
        job.keep[start * p : (start + m) * p].copy_(src)
    if base is not None:
        src = delta_transform.encode_into_base_torch(src, base, delta_transform.kind_for(job.dtype), job.dtype.itemsize)
    region = slots[seg.first_slot : seg.first_slot + seg.n_blocks * p]
    if full:
        region[: full * p].view(full, p, c).copy_(src[: full * c * p].view(full, c, p).permute(0, 2, 1))
    if tail:
        region[full * p : (full + 1) * p, :tail].copy_(src[full * c * p :].view(tail, p).t())


def _delta_bucket(seed: int, c: int) -> tuple[list[Any], Any, list[torch.Tensor]]:
    """Jobs of every kind _split_planes meets, in one bucket: deltas whose bases lie back to back
    in one host arena, one in another arena, bases kept nowhere, keep-only jobs between them, a
    job with a tail, a delta kept elsewhere than its base, a job split over two segments, other
    dtypes, plain jobs."""
    from nvdcp.gpu.encoder import GpuJob
    from nvdcp.gpu.plan import Bucket, JobColumns
    from nvdcp.pipeline.delta import DeltaInput
    from nvdcp.pipeline.policy import choose_delta_layout, choose_layout

    rng = np.random.default_rng(seed)
    arena = torch.from_numpy(rng.integers(0, 256, size=64 * c * 8, dtype=np.uint8))
    other = torch.from_numpy(rng.integers(0, 256, size=8 * c * 8, dtype=np.uint8))
    used = {"arena": 0, "other": 0}

    def host(nbytes: int, where: str = "arena") -> torch.Tensor:
        buf = arena if where == "arena" else other
        out = buf[used[where] : used[where] + nbytes]
        used[where] += nbytes
        return out

    def job(dtype: torch.dtype, elements: int, kind: str, where: str = "arena") -> Any:
        size = torch.empty((), dtype=dtype).element_size()
        data = torch.from_numpy(rng.integers(0, 256, size=elements * size, dtype=np.uint8))
        layout = choose_layout(dtype, "zstd")
        j = GpuJob(kind, data, layout, dtype, 0, (elements,))
        if kind in ("delta", "delta-kept", "delta-apart"):
            base = host(data.numel(), where)
            j.layout = choose_delta_layout(dtype, "zstd")
            j.delta = DeltaInput(base, 1, None, None)
            if kind == "delta-kept":
                j.keep = base
            elif kind == "delta-apart":
                j.keep = host(data.numel(), "other")
        elif kind == "keep":
            j.keep = host(data.numel(), where)
        return j

    jobs = [
        job(torch.float32, 2 * c, "delta-kept"), job(torch.float32, 3 * c, "delta-kept"),
        job(torch.float32, c, "delta-kept"),  # a run of three
        job(torch.bfloat16, 2 * c, "delta-kept"),  # another dtype: a run of its own
        job(torch.float32, 2 * c, "delta-kept", "other"),  # its base in another arena
        job(torch.float32, 2 * c, "delta"), job(torch.float32, c, "delta"),  # bases kept nowhere
        job(torch.float32, c + 5, "delta-kept"),  # a tail: per segment
        job(torch.float32, 2 * c, "delta-apart"),  # kept elsewhere than its base: per segment
        job(torch.float32, 2 * c, "keep"), job(torch.float32, c, "keep"),  # keep-only run
        job(torch.float32, 2 * c, "plain"), job(torch.int64, c, "plain"),
        job(torch.float32, 4 * c, "delta-kept"),  # split over two segments: per segment
    ]
    segments, slots = [], 0
    for j, jb in enumerate(jobs):
        blocks = -(-jb.elements // c)
        parts = [(0, blocks)] if j != len(jobs) - 1 else [(0, 2), (2, 2)]
        for first, n in parts:
            segments.append((j, first, n, slots))
            slots += n * jb.n_planes
    bucket = Bucket.of(JobColumns.of(jobs), segments, slots)
    bases = [j.delta.base.clone() if j.delta is not None else None for j in jobs]
    return jobs, bucket, bases


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("run_bytes", [64 << 20, 3 * 1024 * 4])
def test_delta_and_kept_jobs_split_in_runs_as_one_segment_at_a_time(
    seed: int, run_bytes: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slots and kept bytes are what the per-segment path writes, whatever the run bound (runs
    whose slots follow one another, and runs written through an index)."""
    from nvdcp.gpu.encoder import GpuEncoder

    monkeypatch.setattr(encoder_module, "DELTA_RUN_BYTES", run_bytes)
    c = 1024
    jobs, bucket, bases = _delta_bucket(seed, c)
    encoder = object.__new__(GpuEncoder)
    encoder.chunk_bytes = c
    encoder.keep_stream = None  # type: ignore[assignment]  # the CPU: kept bytes on the current stream
    runs = [[job for job, _ in run] for run in encoder._runs(jobs, bucket, bucket.first_slot)]
    fp32_deltas = [run for run in runs if run[0].delta is not None and run[0].dtype == torch.float32]
    # all seven fp32 deltas held whole in whole blocks (not the one with a tail, not the split one)
    assert sum(map(len, fp32_deltas)) == 7
    assert len(fp32_deltas) == 1 if run_bytes > 1 << 20 else len(fp32_deltas) > 2
    for run in fp32_deltas:
        assert len(run) == 1 or sum(job.data.numel() for job in run) <= run_bytes
    assert [len(run) for run in runs if run[0].key == "keep"] == [2]
    assert not any(job is jobs[7] or job is jobs[13] for run in runs for job in run)
    slots = torch.zeros(bucket.slots, c, dtype=torch.uint8)
    encoder._split_planes(jobs, bucket, slots.view(-1), SlotLayout.rows(bucket.slots, c, kernel=False))
    got_keeps = [j.keep.clone() if j.keep is not None else None for j in jobs]
    for j, base in zip(jobs, bases):  # restore the bases (the kept bytes overwrote them)
        if base is not None:
            j.delta.base.copy_(base)
    want = torch.zeros_like(slots)
    for seg in bucket.segments:
        _reference_segment(jobs[seg.job], seg, want, c)
    assert torch.equal(slots, want)
    for j, kept in zip(jobs, got_keeps):
        if kept is not None:
            assert torch.equal(kept, j.data), j.key


def _bucket_of(jobs: list[Any], pieces: list[tuple[int, int, int]], chunk: int, rng: np.random.Generator,
               run_bounds: list[int]) -> HostBucket:
    """A bucket of segments ``(job, first block, blocks)`` in order, random stored sizes and
    CRCs, its packed bytes (chunks padded to the compaction granule) in host runs cut at slots
    ``run_bounds``."""
    segments, slot = [], 0
    for job, first, blocks in pieces:
        segments.append((job, first, blocks, slot))
        slot += blocks * jobs[job].n_planes
    stored = rng.integers(0, chunk + 1, slot).astype(np.int64)
    granule = 256  # chunks start at granule boundaries, as after compaction: padding between them
    offsets = np.concatenate(([0], np.cumsum(-(-stored // granule) * granule)))
    packed = torch.from_numpy(rng.integers(0, 256, int(offsets[-1]), dtype=np.uint8))
    bounds = [0, *run_bounds, slot]
    runs = [(packed[int(offsets[a]) : int(offsets[b])].clone(), a, b) for a, b in zip(bounds, bounds[1:])]
    crcs = torch.from_numpy(rng.integers(-(2**31), 2**31, slot).astype(np.int32))
    bucket = Bucket.of(JobColumns.of(jobs), segments, slot)
    return HostBucket(bucket, stored, offsets, runs, None, crcs)  # type: ignore[arg-type]


@pytest.mark.parametrize("run_bounds", [[], [3], [1, 9, 10]])
def test_bucket_records_built_together_equal_those_built_one_at_a_time(run_bounds: list[int]) -> None:
    """GpuEncoder._bucket_items packs the headers of a bucket's whole jobs together: the same
    header bytes, header and chunk bytes as the per-item _item, in the same order, for float
    byte-plane jobs, a delta job, an empty one and a job cut over two buckets."""
    from nvdcp.gpu.encoder import GpuEncoder, GpuJob
    from nvdcp.pipeline.delta import DeltaInput
    from nvdcp.pipeline.policy import Layout

    chunk = 1024
    encoder = object.__new__(GpuEncoder)
    encoder.chunk_bytes = chunk
    planes4, planes2 = Layout(1, ("gdeflate", "none", "none", "none")), Layout(1, ("zstd", "none"))

    def job(key: str, elements: int, dtype: torch.dtype, layout: Layout, shape: tuple[int, ...], delta: Any = None) -> GpuJob:
        data = torch.zeros(elements * dtype.itemsize, dtype=torch.uint8)
        return GpuJob(key, data, layout, dtype, 7 if dtype == torch.float32 else 9, shape, delta=delta)

    jobs = [
        job("a", 1000, torch.float32, planes4, (10, 100)),
        job("cut", 3 * chunk, torch.float32, planes4, (3 * chunk,)),
        job("b", 2 * chunk + 5, torch.bfloat16, planes2, (2 * chunk + 5,)),
        job("delta", 700, torch.float32, planes4, (700,), DeltaInput(None, 0xDEADBEEF, None, None)),
        job("empty", 0, torch.float32, planes4, (0, 4)),
    ]
    rng = np.random.default_rng(3)
    first = _bucket_of(jobs, [(0, 0, 1), (1, 0, 2)], chunk, rng, [])
    second = _bucket_of(jobs, [(1, 2, 1), (2, 0, 3), (3, 0, 1), (4, 0, 0)], chunk, rng, run_bounds)

    partial: dict[int, Any] = {}
    got = [*encoder._bucket_items(jobs, first, partial, True), *encoder._bucket_items(jobs, second, partial, True)]
    assert [j.key for j, _ in got] == ["a", "cut", "b", "delta", "empty"]
    assert not partial

    expected = {}
    partial_ref: dict[int, Any] = {}
    for hb in (first, second):
        crcs = hb.checksums()
        for seg in hb.bucket.segments:
            j = jobs[seg.job]
            lo, hi = seg.first_slot, seg.first_slot + seg.n_blocks * j.n_planes
            if seg.job == 1:
                partial_ref.setdefault(1, []).append((bytes(b"".join(hb.spans(lo, hi))), hb.stored[lo:hi], crcs[lo:hi]))
                continue
            expected[j.key] = (encoder._item(j, hb.spans(lo, hi), crcs[lo:hi]), b"".join(hb.spans(lo, hi)))
    data, sizes, crcs = zip(*partial_ref[1])
    spans = encoder_module.ChunkSpans()
    joined = b"".join(data)
    spans.add(memoryview(joined), np.concatenate(([0], np.cumsum(np.concatenate(sizes))[:-1])), np.concatenate(sizes))
    expected["cut"] = (encoder._item(jobs[1], spans, np.concatenate(crcs)), joined)
    for j, record in got:
        ref, ref_bytes = expected[j.key]
        assert record.header_bytes == ref.header_bytes, j.key
        assert record.header == ref.header, j.key
        assert b"".join(record.chunks) == ref_bytes, j.key
        assert record.nbytes == ref.nbytes, j.key
        assert record.header.stored_crc in (None, int.from_bytes(ref.header_bytes[-4:], "little")), j.key
    assert got[3][1].header.is_delta and got[3][1].header.base_digest == 0xDEADBEEF

    # As batches (the writer's path): the whole records of jobs without a base as one
    # RecordBatch when they lie in one host buffer run; its records, and the bytes a file gets
    # from its gather, are those above; the delta job and the job cut over buckets stay records.
    partial = {}
    batched = [*encoder._bucket_items(jobs, first, partial, True, batches=True),
               *encoder._bucket_items(jobs, second, partial, True, batches=True)]
    batches = [r for r in batched if isinstance(r, encoder_module.RecordBatch)]
    singles = [r for r in batched if not isinstance(r, encoder_module.RecordBatch)]
    keys = [j.key for b in batches for j, _ in b.items()] + [j.key for j, _ in singles]
    assert sorted(keys) == sorted(["a", "cut", "b", "delta", "empty"])
    assert "delta" in [j.key for j, _ in singles] and "cut" in [j.key for j, _ in singles]
    if not run_bounds:
        assert len(batches) == 2  # one per bucket
    for b in batches:
        for (j, record), size in zip(b.items(), b.record_nbytes.tolist()):
            ref, ref_bytes = expected[j.key]
            assert record.header_bytes == ref.header_bytes and record.header == ref.header, j.key
            assert b"".join(record.chunks) == ref_bytes and size == ref.nbytes, j.key
        whole = b"".join(bytes(piece) for piece in b.gather())
        assert whole == b"".join(expected[j.key][0].header_bytes + expected[j.key][1] for j, _ in b.items())
        assert len(whole) == b.nbytes


@pytest.mark.parametrize("seed", range(6))
def test_slot_table_matches_the_per_segment_rule(seed: int) -> None:
    """GpuEncoder._slot_table fills its arrays with numpy: every slot's raw size (a full chunk,
    or the short last block of an item) and codec group, and the groups numbered in order of
    first use, are those of the per-segment rule, for segments of mixed layouts and dtypes, items
    cut over buckets, single short blocks and empty items."""
    from nvdcp.gpu.encoder import GpuEncoder, GpuJob
    from nvdcp.gpu.nvcomp_codecs import typed_data_type
    from nvdcp.gpu.plan import Bucket, JobColumns, Segment
    from nvdcp.pipeline.policy import Layout

    rng = np.random.default_rng(seed)
    chunk = 1024
    encoder = object.__new__(GpuEncoder)
    encoder.chunk_bytes = chunk
    layouts = [(torch.float32, Layout(1, ("gdeflate", "none", "none", "zstd"))), (torch.bfloat16, Layout(1, ("ans", "none"))),
               (torch.uint8, Layout(0, ("zstd",))), (torch.float32, Layout(1, ("gdeflate", "gdeflate", "none", "none")))]
    jobs, segments, slot = [], [], 0
    for j in range(int(rng.integers(1, 30))):
        dtype, layout = layouts[int(rng.integers(len(layouts)))]
        elements = int(rng.choice([0, rng.integers(1, chunk), rng.integers(1, 6) * chunk, rng.integers(chunk, 7 * chunk)]))
        jobs.append(GpuJob(f"j{j}", torch.zeros(elements * len(layout.plane_codecs), dtype=torch.uint8), layout,
                           dtype, 0, (elements,)))
        blocks = -(-elements // chunk)
        first_block = int(rng.integers(0, blocks)) if blocks and rng.random() < 0.3 else 0  # a later part of a cut item
        n_blocks = blocks - first_block if blocks else 0
        segments.append(Segment(j, first_block, n_blocks, slot))
        slot += n_blocks * len(layout.plane_codecs)
    bucket = Bucket.of(JobColumns.of(jobs), segments, slot)
    raw_sizes, slot_key, keys = encoder._slot_table(bucket)

    want_raw = np.empty(slot, dtype=np.int64)
    want_key = np.full(slot, -1, dtype=np.int32)
    ids: dict[Any, int] = {}
    for seg in segments:
        job = jobs[seg.job]
        p = job.n_planes
        m = min(job.elements, (seg.first_block + seg.n_blocks) * chunk) - seg.first_block * chunk
        full, tail = divmod(m, chunk)
        want_raw[seg.first_slot : seg.first_slot + seg.n_blocks * p] = chunk
        if tail:
            want_raw[seg.first_slot + full * p : seg.first_slot + seg.n_blocks * p] = tail
        plane_keys = [-1 if n == "none" else ids.setdefault((n, typed_data_type(n, job.dtype)), len(ids))
                      for n in job.layout.plane_codecs]
        want_key[seg.first_slot : seg.first_slot + seg.n_blocks * p] = np.tile(np.asarray(plane_keys, dtype=np.int32), seg.n_blocks)
    assert raw_sizes.tolist() == want_raw.tolist()
    assert slot_key.tolist() == want_key.tolist()
    assert keys == sorted(ids, key=lambda k: ids[k])


def test_copy_pairs_copies_runs_of_adjacent_pairs_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pairs whose destinations and sources each follow one another in one allocation go as one
    copy; a pair out of line (another arena, a gap, another dtype) starts a new copy."""
    src_arena = torch.arange(400, dtype=torch.int64).to(torch.uint8)
    dst_arena = torch.zeros(400, dtype=torch.uint8)
    other = torch.zeros(50, dtype=torch.uint8)
    spans = [(0, 30), (30, 100), (100, 101), (120, 160), (160, 200)]  # a gap before the fourth
    dsts = [dst_arena[a:b] for a, b in spans] + [other[:10]]
    srcs = [src_arena[a:b] for a, b in spans] + [src_arena[200:210]]
    copies: list[int] = []
    real = torch.Tensor.copy_

    def spy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        copies.append(self.numel())
        return real(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    encoder_module.copy_pairs(dsts, srcs)
    monkeypatch.undo()
    assert copies == [101, 80, 10]
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s)
    assert not dst_arena[101:120].any()  # the gap is not written


def test_a_failed_slot_is_named_by_its_item_and_chunk() -> None:
    """An nvCOMP failure in a bucket names the item and its chunk (block-major, planes within)."""
    from nvdcp.format.header import TRANSFORM_BYTEPLANES
    from nvdcp.pipeline.policy import Layout

    layout = Layout(TRANSFORM_BYTEPLANES, ("gdeflate", "gdeflate"))
    jobs = [encoder_module.GpuJob(key, torch.zeros(4096, dtype=torch.bfloat16), layout, torch.bfloat16, 0, (4096,))
            for key in ("model.a", "model.b")]
    bucket = Bucket.of(JobColumns.of(jobs), [(0, 0, 2, 0), (1, 3, 1, 4)], 6)
    owner = encoder_module._slot_owner
    assert owner(jobs, bucket, 0) == "model.a: chunk 0"
    assert owner(jobs, bucket, 3) == "model.a: chunk 3"
    assert owner(jobs, bucket, 5) == "model.b: chunk 7"  # its block 3, plane 1

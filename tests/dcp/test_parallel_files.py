"""The writer's parallel data files, exercised without a GPU.

GPU records reach the files through ``ItemEncoder.encode_gpu_buckets``: buckets of records whose
chunks view one shared (pinned) buffer each, released when every record of the bucket is
written. Here a fake encoder stands in for the GPU: it routes float64 tensors to that path,
encodes them on the CPU into bucket buffers that are poisoned on release, and holds at most
``depth`` buckets at once (as the GPU encoder's sink does). A record written after its bucket
went back would load wrong; a writer that closes the buckets before its files finished, or
that deadlocks on an error, fails here.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from nvdcp.cores import usable_cores
from nvdcp.dcp import writer as writer_mod
from nvdcp.format.digest import digest_of_record_header, read_digests
from nvdcp.format.header_batch import HeaderFields
from nvdcp.gpu.config import GpuConfig
from nvdcp.pipeline.config import EncodeConfig
from nvdcp.pipeline.cpu import EncodedItem
from nvdcp.pipeline.encoder import ItemEncoder
from nvdcp.pipeline.record_batch import RecordBatch
from nvdcp.storage.local import LocalStorage
from nvdcp.storage.spans import ChunkSpans
from tests.conftest import bit_equal, weights_like
from tests.dcp.helpers import data_files, failure_of


class _Bucket:
    def __init__(self, owner: FakeGpu, records: list[Any], buf: bytearray) -> None:
        self.records = records
        self.owner = owner
        self.buf = buf
        self.released = False

    def release(self) -> None:
        with self.owner.lock:
            if self.released:
                return
            self.released = True
            self.owner.held -= 1
            self.buf[:] = b"\xee" * len(self.buf)  # a late write of these records would store this


def batch_of(owned: list[tuple[Any, Any, bytes, list[bytes]]], view: memoryview) -> RecordBatch:
    """The records ``owned`` (job, header, header bytes, chunks), whose chunks lie back to back
    in ``view``, as one RecordBatch: what the GPU encoder hands the writer."""
    headers = np.frombuffer(b"".join(hb for _, _, hb, _ in owned), dtype=np.uint8).copy()
    header_starts = np.concatenate(([0], np.cumsum([len(hb) for _, _, hb, _ in owned]))).astype(np.int64)
    sizes = [len(c) for *_, chunks in owned for c in chunks]
    chunk_starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64) if sizes else np.zeros(0, np.int64)
    table = np.array([pair for _, h, _, _ in owned for pair in h.chunks], dtype=np.uint32).reshape(-1, 2)
    first_chunk = np.concatenate(([0], np.cumsum([len(chunks) for *_, chunks in owned]))).astype(np.int64)
    fields = [HeaderFields(h.kind, h.dtype_code, h.transform, h.plane_codecs, h.shape, h.chunk_bytes, h.raw_nbytes)
              for _, h, _, _ in owned]
    digests = np.array([digest_of_record_header(hb) for _, _, hb, _ in owned], dtype=np.uint32)
    return RecordBatch([job for job, *_ in owned], fields, headers, header_starts, digests, view, chunk_starts,
                       table, first_chunk, owned[0][1].chunk_bytes)


class FakeGpu(ItemEncoder):
    """float64 tensors take the 'GPU' path: buckets of ``per_bucket`` records (as one
    RecordBatch each where the writer asks for batches, unless ``batches`` is False)."""

    def __init__(self, per_bucket: int = 3, fail_after: int | None = None, batches: bool = True,
                 spans: bool = False) -> None:
        super().__init__(EncodeConfig(), GpuConfig())
        self.batches = batches
        self.spans = spans  # single records' chunks as ChunkSpans of the bucket (as the GPU encoder's)
        self.per_bucket = per_bucket
        self.fail_after = fail_after
        self.lock = threading.Lock()
        self.held = 0
        self.max_held = 0
        self.depths: list[int] = []
        self.held_at_close: list[int] = []
        self.buckets: list[_Bucket] = []

    def uses_gpu(self, data: torch.Tensor, gpu_ok: bool | None = None) -> bool:
        return data.dtype == torch.float64

    def gpu_job(self, key: Any, tensor: torch.Tensor, where: str) -> Any:
        return SimpleNamespace(key=key, tensor=tensor, where=where)

    def encode_gpu_buckets(self, jobs: list[Any], depth: int = 2, batches: bool = False) -> Any:
        self.depths.append(depth)
        try:
            for start in range(0, len(jobs), self.per_bucket):
                if self.fail_after is not None and start >= self.fail_after:
                    raise RuntimeError("encode failed on the device")
                deadline = time.monotonic() + 20
                while True:  # the GPU encoder's sink: at most `depth` buckets held
                    with self.lock:
                        if self.held < depth:
                            self.held += 1
                            self.max_held = max(self.max_held, self.held)
                            break
                    assert time.monotonic() < deadline, "buckets never released"
                    time.sleep(0.001)
                owned = []
                for job in jobs[start : start + self.per_bucket]:
                    e = self.encode_tensor(job.tensor, job.where, pool=None)
                    owned.append((job, e.header, e.header_bytes, [bytes(c) for c in e.chunks]))
                buf = bytearray(b"".join(c for *_, chunks in owned for c in chunks))
                if batches and self.batches:
                    bucket = _Bucket(self, [batch_of(owned, memoryview(buf))], buf)
                    self.buckets.append(bucket)
                    yield bucket
                    continue
                view, pos, records = memoryview(buf), 0, []
                for job, header, header_bytes, chunks in owned:
                    views: Any = []
                    sizes = np.array([len(c) for c in chunks], dtype=np.int64)
                    if self.spans:
                        views = ChunkSpans.of(view, pos + np.cumsum(sizes) - sizes, sizes)
                    for c in chunks:
                        if not self.spans:
                            views.append(view[pos : pos + len(c)])
                        pos += len(c)
                    records.append((job, EncodedItem(header, header_bytes, views)))
                bucket = _Bucket(self, records, buf)
                self.buckets.append(bucket)
                yield bucket
        except GeneratorExit:  # the writer closes early only once its files are done
            with self.lock:
                self.held_at_close.append(self.held)
            for b in self.buckets:
                b.release()
            raise


def _state(n_gpu: int = 10, n_cpu: int = 5) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for i in range(n_gpu):
        sd[f"g{i}"] = weights_like((200 + 37 * i, 64), seed=i).double()
    for i in range(n_cpu):
        sd[f"c{i}"] = weights_like((100 + i, 33), seed=100 + i)
    sd["step"] = 7
    sd["empty"] = torch.empty(0, dtype=torch.float64)
    return sd


def _save(sd: dict[str, Any], path: Path, enc: ItemEncoder, **kw: Any) -> nvdcp.NvcompWriter:
    writer = nvdcp.NvcompWriter(path, encoder=enc, sync_files=False, on_identical_save="ignore", **kw)
    dcp.save(sd, storage_writer=writer)
    return writer


def _load_same(sd: dict[str, Any], path: Path) -> None:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
    dcp.load(out, storage_reader=nvdcp.NvcompReader(path))
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert bit_equal(out[k], v), k
        else:
            assert out[k] == v, k


@pytest.mark.parametrize("batches", [True, False])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_gpu_records_spread_over_files_and_load_bit_exactly(tmp_path: Path, threads: int, batches: bool) -> None:
    enc = FakeGpu(per_bucket=3, batches=batches)
    sd = _state()
    try:
        _save(sd, tmp_path, enc, thread_count=threads)
    finally:
        enc.close()
    _load_same(sd, tmp_path)
    names = data_files(tmp_path)
    assert len(names) == threads
    md = nvdcp.NvcompReader(tmp_path).read_metadata()
    used = {info.relative_path for info in md.storage_data.values()}
    assert used == set(names), "every file holds records"
    # one encode of every GPU item, all buckets released before the encode was closed
    assert enc.depths == [2 if threads == 1 else writer_mod.PARALLEL_DEPTH]
    assert all(h == 0 for h in enc.held_at_close) and enc.max_held <= enc.depths[0]
    assert all(b.released for b in enc.buckets)
    # the digest record covers every item, in storage_data's order
    digests = read_digests(md)
    assert digests.status == "recorded" and set(digests.by_index) == set(md.storage_data)


def test_gpu_bytes_are_balanced_over_files(tmp_path: Path) -> None:
    enc = FakeGpu(per_bucket=2)
    sd = {f"g{i}": weights_like((512, 64), seed=i).double() for i in range(16)}
    try:
        _save(sd, tmp_path, enc, thread_count=4)
    finally:
        enc.close()
    sizes = [os.path.getsize(tmp_path / n) for n in data_files(tmp_path)]
    assert len(sizes) == 4 and max(sizes) < 2 * min(sizes), sizes
    _load_same(sd, tmp_path)


def test_results_follow_the_plan_order(tmp_path: Path) -> None:
    enc = FakeGpu(per_bucket=4)
    sd = _state(n_gpu=9, n_cpu=3)
    try:
        w = _save(sd, tmp_path / "a", enc, thread_count=3)
    finally:
        enc.close()
    assert w.last_report is not None
    md = nvdcp.NvcompReader(tmp_path / "a").read_metadata()
    fqns = [ix.fqn for ix in md.storage_data]
    assert sorted(fqns) == sorted(sd)


def test_a_failing_file_fails_the_save_without_hanging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    append = writer_mod._RecordWriter.append
    calls = {"n": 0}

    def failing(self: Any, encoded: EncodedItem, borrowed: bool = False) -> int:
        if encoded.header.dtype_code == 8 or encoded.header.raw_nbytes > 50_000:  # a 'GPU' record
            calls["n"] += 1
            if calls["n"] == 4:
                raise OSError(28, "No space left on device")
        return append(self, encoded, borrowed)

    monkeypatch.setattr(writer_mod._RecordWriter, "append", failing)
    enc = FakeGpu(per_bucket=2, batches=False)
    try:
        with pytest.raises(BaseException) as info:
            _save(_state(n_gpu=16), tmp_path, enc, thread_count=3)
    finally:
        enc.close()
    assert "No space left" in str(failure_of(info.value))
    assert all(h == 0 for h in enc.held_at_close) and all(b.released for b in enc.buckets)
    assert data_files(tmp_path) == []  # every file of the failed save aborted


def test_a_failing_gpu_encode_fails_the_save_without_hanging(tmp_path: Path) -> None:
    enc = FakeGpu(per_bucket=2, fail_after=4)
    try:
        with pytest.raises(BaseException) as info:
            _save(_state(n_gpu=12), tmp_path, enc, thread_count=4)
    finally:
        enc.close()
    assert "encode failed on the device" in str(failure_of(info.value))
    assert all(b.released for b in enc.buckets)
    assert data_files(tmp_path) == []


def test_a_failing_cpu_item_fails_the_save_without_hanging(tmp_path: Path) -> None:
    enc = FakeGpu(per_bucket=2)
    original = enc._encode_small_batches  # the CPU items here are small: encoded in batches

    def boom(keys: list[Any], datas: list[Any], describe: Any) -> list[Any]:
        for key in keys:
            if describe(key).endswith(" c2"):
                raise ValueError(f"{describe(key)}: cannot encode")
        return original(keys, datas, describe)

    enc._encode_small_batches = boom  # type: ignore[method-assign]
    try:
        with pytest.raises(BaseException) as info:
            _save(_state(n_gpu=8), tmp_path, enc, thread_count=3)
    finally:
        enc.close()
    assert "cannot encode" in str(failure_of(info.value))
    assert all(b.released for b in enc.buckets)
    assert data_files(tmp_path) == []


def test_thread_count_none_picks_files_by_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = LocalStorage(tmp_path / "x", sync=False)
    cores = min(writer_mod.AUTO_MAX_FILES, usable_cores())
    assert writer_mod.auto_file_count(local, 0) == 1
    assert writer_mod.auto_file_count(local, writer_mod.AUTO_FILE_BYTES) == 1
    assert writer_mod.auto_file_count(local, 100 * writer_mod.AUTO_FILE_BYTES) == cores
    assert writer_mod.auto_file_count(SimpleNamespace(), 100 * writer_mod.AUTO_FILE_BYTES) == 1  # type: ignore[arg-type]
    assert nvdcp.NvcompWriter(tmp_path / "d").thread_count is None
    monkeypatch.setattr(writer_mod, "AUTO_FILE_BYTES", 1024)
    sd = {f"w{i}": weights_like((64, 64), seed=i) for i in range(12)}
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "auto", sync_files=False))
    assert len(data_files(tmp_path / "auto")) == cores
    _load_same(sd, tmp_path / "auto")
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "one", thread_count=1, sync_files=False))
    assert len(data_files(tmp_path / "one")) == 1


def test_large_records_go_out_in_small_calls_when_files_run_in_parallel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    monkeypatch.setattr(writer_mod, "SMALL_WRITE_RUN_BYTES", 64 << 10)
    from nvdcp.storage.local import _LocalWriteStream as stream_cls
    writelines = stream_cls.writelines

    def spy(self: Any, parts: Any) -> None:
        parts = list(parts)
        sizes.append(sum(memoryview(p).nbytes for p in parts))
        writelines(self, parts)

    monkeypatch.setattr(stream_cls, "writelines", spy)
    sd = {f"w{i}": torch.randn(300_000, generator=torch.Generator().manual_seed(i)) for i in range(2)}
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "c", thread_count=2, sync_files=False, codec="none"))
    assert sizes and max(sizes) <= (64 << 10) + 65536 + 4096, max(sizes)
    _load_same(sd, tmp_path / "c")


def test_a_bucket_is_shared_out_to_the_least_loaded_files_one_entry_each() -> None:
    """Each record of a bucket goes to the file with the fewest bytes waiting (then the fewest
    so far), counting what the bucket already gave it; each file gets its records in order."""

    class File:
        def __init__(self, waiting: int, assigned: int) -> None:
            self.counts = (waiting, assigned)

        def load(self) -> tuple[int, int]:
            return self.counts

    def record(key: str, nbytes: int) -> tuple[Any, Any]:
        return SimpleNamespace(key=key), SimpleNamespace(nbytes=nbytes)

    busy, idle, fresh = File(500, 900), File(0, 700), File(0, 100)
    records = [record("a", 300), record("b", 300), record("c", 50), record("d", 400)]
    shares = writer_mod._share_out(records, [busy, idle, fresh])  # type: ignore[arg-type]
    keys = {f: [key for key, _ in share] for f, share in shares.items()}
    # fresh (0, 100) -> a; idle (0, 700) -> b (fresh now waits 300); c to the less waiting of
    # (300, 400) and (300, 1000): fresh; d: idle (300) < fresh (350) < busy (500)
    assert keys == {fresh: ["a", "c"], idle: ["b", "d"]}
    assert writer_mod._share_out([], [busy, idle]) == {}
    only = writer_mod._share_out(records, [busy])  # type: ignore[arg-type]
    assert [key for key, _ in only[busy]] == ["a", "b", "c", "d"]


def test_a_failing_batch_write_fails_the_save_without_hanging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gather of a bucket's batch that fails (disk full) fails the save: every file aborts,
    every bucket goes back, nothing is left behind."""
    append_batch = writer_mod._RecordWriter.append_batch
    calls = {"n": 0}

    def failing(self: Any, batch: RecordBatch) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return append_batch(self, batch)

    monkeypatch.setattr(writer_mod._RecordWriter, "append_batch", failing)
    enc = FakeGpu(per_bucket=2)
    try:
        with pytest.raises(BaseException) as info:
            _save(_state(n_gpu=16), tmp_path, enc, thread_count=3)
    finally:
        enc.close()
    assert calls["n"] >= 3 and "No space left" in str(failure_of(info.value))
    assert all(h == 0 for h in enc.held_at_close) and all(b.released for b in enc.buckets)
    assert data_files(tmp_path) == []


def test_a_batch_with_large_records_writes_them_alone_in_one_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One data file (no run limit): a batch's records above SMALL_RECORD_BYTES go out through
    write_spans (which local storage may split over its I/O threads), the small ones between
    them in gathers; offsets stay right (the load is bit-exact)."""
    monkeypatch.setattr(writer_mod, "SMALL_RECORD_BYTES", 60_000)
    from nvdcp.storage.local import _LocalWriteStream as stream_cls
    calls: list[str] = []
    write_spans, write_gather = stream_cls.write_spans, stream_cls.write_gather

    def spans_spy(self: Any, head: Any, spans: Any, parallel: bool = True) -> None:
        calls.append("spans")
        write_spans(self, head, spans, parallel)

    def gather_spy(self: Any, gather: Any) -> None:
        calls.append(f"gather{len(gather)}")
        write_gather(self, gather)

    monkeypatch.setattr(stream_cls, "write_spans", spans_spy)
    monkeypatch.setattr(stream_cls, "write_gather", gather_spy)
    sd = {f"g{i}": weights_like((300 if i % 3 == 1 else 20, 64), seed=i).double() for i in range(9)}
    enc = FakeGpu(per_bucket=9)
    try:
        _save(sd, tmp_path, enc, thread_count=1)
    finally:
        enc.close()
    assert calls.count("spans") == 3 and len([c for c in calls if c.startswith("gather")]) >= 2, calls
    _load_same(sd, tmp_path)


def test_large_records_of_a_bucket_share_go_out_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several data files (a run limit): the large records of a bucket that come one by one (as
    deltas do) wait for the end of the bucket's share and go out with one write_spans call per
    file and bucket, not one each; offsets stay right (the load is bit-exact)."""
    monkeypatch.setattr(writer_mod, "SMALL_RECORD_BYTES", 60_000)
    from nvdcp.storage.local import _LocalWriteStream as stream_cls
    calls: list[int] = []
    write_spans = stream_cls.write_spans

    def spans_spy(self: Any, head: Any, spans: Any, parallel: bool = True) -> None:
        calls.append(len(spans))
        write_spans(self, head, spans, parallel)

    monkeypatch.setattr(stream_cls, "write_spans", spans_spy)
    # large 'GPU' records (300 x 64 float64: 150 KiB) with small ones between them
    sd = {f"g{i}": weights_like((300 if i % 3 else 20, 64), seed=i).double() for i in range(12)}
    sd.update({f"c{i}": weights_like((50,), seed=50 + i) for i in range(3)})
    large = sum(1 for i in range(12) if i % 3)
    enc = FakeGpu(per_bucket=6, batches=False, spans=True)
    try:
        _save(sd, tmp_path, enc, thread_count=2)
    finally:
        enc.close()
    assert len(data_files(tmp_path)) == 2
    assert 0 < len(calls) < large, calls  # several records a call
    _load_same(sd, tmp_path)


def test_a_failing_write_of_queued_large_records_fails_the_save_without_hanging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The vectored write of a share's queued large records fails (disk full): every file
    aborts, every bucket goes back, nothing is left behind."""
    monkeypatch.setattr(writer_mod, "SMALL_RECORD_BYTES", 60_000)
    from nvdcp.storage.local import _LocalWriteStream as stream_cls
    write_spans = stream_cls.write_spans
    calls = {"n": 0}

    def failing(self: Any, head: Any, spans: Any, parallel: bool = True) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        write_spans(self, head, spans, parallel)

    monkeypatch.setattr(stream_cls, "write_spans", failing)
    sd = {f"g{i}": weights_like((300, 64), seed=i).double() for i in range(12)}
    enc = FakeGpu(per_bucket=3, batches=False, spans=True)
    try:
        with pytest.raises(BaseException) as info:
            _save(sd, tmp_path, enc, thread_count=2)
    finally:
        enc.close()
    assert calls["n"] >= 2 and "No space left" in str(failure_of(info.value))
    assert all(h == 0 for h in enc.held_at_close) and all(b.released for b in enc.buckets)
    assert data_files(tmp_path) == []


def test_a_batch_is_shared_out_in_consecutive_parts() -> None:
    """A bucket's batch goes to the files in consecutive parts that even out their waiting
    bytes, at most one part each; single records keep the per-record rule."""

    class File:
        def __init__(self, waiting: int) -> None:
            self.counts = (waiting, 0)

        def load(self) -> tuple[int, int]:
            return self.counts

    owned = []
    for i in range(12):
        chunk = bytes([i]) * (100 + 10 * i)
        header = SimpleNamespace(kind=0, dtype_code=2, transform=0, plane_codecs=(0,), shape=(len(chunk),),
                                 chunk_bytes=65536, raw_nbytes=len(chunk), chunks=[(len(chunk), 0)])
        owned.append((SimpleNamespace(key=f"k{i}"), header, b"H" * 40, [chunk]))
    batch = batch_of(owned, memoryview(b"".join(c for *_, (c,) in owned)))
    files = [File(0), File(900), File(0)]
    single = (SimpleNamespace(key="s"), SimpleNamespace(nbytes=10))
    shares = writer_mod._share_out([batch, single], files)  # type: ignore[arg-type]
    parts = {f: [e for e in share if isinstance(e, RecordBatch)] for f, share in shares.items()}
    assert all(len(p) <= 1 for p in parts.values())
    order = sorted((p[0].lo, p[0].hi) for p in parts.values() if p)
    assert order[0][0] == 0 and order[-1][1] == 12 and all(a[1] == b[0] for a, b in zip(order, order[1:]))
    after = {f: f.counts[0] + sum(e.nbytes for e in parts.get(f, [])) for f in files}
    assert abs(after[files[0]] - after[files[2]]) <= 2 * int(batch.record_nbytes.max()), after
    assert ("s" in [e[0] for e in shares[files[0]] + shares[files[2]] if not isinstance(e, RecordBatch)])


def test_append_batch_offsets_follow_what_is_already_written(tmp_path: Path) -> None:
    """A batch appended after other bytes gets the offsets where its records start in the file
    (each record's header at its offset); an empty part writes nothing."""
    owned = []
    for i in range(5):
        chunk = bytes([i + 1]) * (50 + 7 * i)
        header = SimpleNamespace(kind=0, dtype_code=2, transform=0, plane_codecs=(0,), shape=(len(chunk),),
                                 chunk_bytes=65536, raw_nbytes=len(chunk), chunks=[(len(chunk), 0)])
        owned.append((SimpleNamespace(key=f"k{i}"), header, bytes([0x40 + i]) * 24, [chunk]))
    batch = batch_of(owned, memoryview(b"".join(c for *_, (c,) in owned)))
    storage = LocalStorage(tmp_path, sync=False)
    storage.prepare()
    stream = storage.create("data")
    out = writer_mod._RecordWriter(stream)
    out.start(b"FILEHEAD")
    assert out.append_batch(batch.part(2, 2)).tolist() == [] and out.pos == 8
    offsets = out.append_batch(batch.part(1, 4))
    out.flush()
    stream.commit()
    data = (tmp_path / "data").read_bytes()
    assert len(data) == out.pos == 8 + batch.part(1, 4).nbytes
    for off, (_, _, head, (chunk,)) in zip(offsets.tolist(), owned[1:4]):
        assert data[off : off + len(head) + len(chunk)] == head + chunk

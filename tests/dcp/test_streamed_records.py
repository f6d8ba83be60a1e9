"""Large host tensors written as they compress: room for the record's header, each group's
chunks as soon as that group is compressed, the header last (nvdcp.pipeline.cpu.StreamedRecord).
The bytes on disk are the records encode_item makes; a save stopped anywhere inside such a
record leaves the previous checkpoint whole."""

from __future__ import annotations

import errno
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import nvdcp
from nvdcp.dcp.save_guard import PENDING as SAVE_MARKER
from nvdcp.format.dtypes import dtype_code
from nvdcp.format.header import KIND_TENSOR
from nvdcp.pipeline import cpu as cpu_module
from nvdcp.pipeline.cpu import encode_item, stream_item
from nvdcp.pipeline.policy import choose_layout
from nvdcp.storage import local as local_module
from nvdcp.testing import faults as F
from tests.conftest import bit_equal, weights_like
from tests.dcp.helpers import empty_like_sd, item_span, load, save

MiB = 1 << 20


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).reshape(-1).numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("numel", [0, 7, 3 * MiB + 5])
@pytest.mark.parametrize("pooled", [False, True])
def test_a_streamed_record_is_the_record_encode_item_makes(dtype: torch.dtype, numel: int, pooled: bool) -> None:
    t = weights_like((numel,), dtype) if dtype.is_floating_point else torch.arange(numel, dtype=dtype) * 7919
    kw: dict[str, Any] = dict(kind=KIND_TENSOR, dtype_code=dtype_code(dtype), shape=tuple(t.shape),
                              element_size=t.element_size(), layout=choose_layout(dtype, "auto"), chunk_bytes=64 << 10)
    with ThreadPoolExecutor(2) as pool:
        whole = encode_item(_raw(t), pool=pool if pooled else None, **kw)
        record = stream_item(_raw(t), pool=pool if pooled else None, **kw)
        streamed = b"".join(bytes(c) for group in record.groups() for c in group)
        finished = record.finish()
    assert record.head_nbytes == len(finished.header_bytes) == len(whole.header_bytes)
    assert finished.header_bytes == whole.header_bytes
    assert streamed == b"".join(bytes(c) for c in whole.chunks)


def test_a_record_cannot_be_finished_before_every_group_came() -> None:
    t = weights_like((MiB,))
    record = stream_item(_raw(t), kind=KIND_TENSOR, dtype_code=dtype_code(t.dtype), shape=tuple(t.shape),
                         element_size=4, layout=choose_layout(t.dtype, "auto"), pool=None)
    groups = record.groups()
    next(groups)
    with pytest.raises(RuntimeError, match="before every group"):
        record.finish()


def test_a_large_tensor_is_written_while_its_later_groups_compress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last group of a 12 MiB tensor may not finish compressing until the file holds some
    of the tensor's chunks: without streaming, nothing is written before every group is done
    and the wait times out. The header goes in last, into the room left for it, and the record
    on disk is byte for byte the one encode_item makes."""
    sd = {"big": weights_like((3 * MiB,))}
    first_write = threading.Event()
    waited: list[bool] = []
    encode_blocks, writelines = cpu_module._encode_blocks, local_module._LocalWriteStream.writelines
    last_block = -(-(3 * MiB) // (64 << 10)) - 1

    def gated_blocks(*args: Any, **kwargs: Any) -> Any:
        if args[6].stop - 1 == last_block:  # the item's last group
            waited.append(first_write.wait(timeout=20))
        return encode_blocks(*args, **kwargs)

    def noting_writelines(self: Any, parts: Any) -> None:
        parts = list(parts)
        if sum(memoryview(p).nbytes for p in parts) >= 64 << 10:  # chunks, not the file header
            first_write.set()
        writelines(self, parts)

    headers: list[tuple[int, int]] = []
    write_at = local_module._LocalWriteStream.write_at

    def noting_write_at(self: Any, offset: int, data: Any) -> None:
        headers.append((offset, self.tell()))
        write_at(self, offset, data)

    monkeypatch.setattr(cpu_module, "_encode_blocks", gated_blocks)
    monkeypatch.setattr(local_module._LocalWriteStream, "writelines", noting_writelines)
    monkeypatch.setattr(local_module._LocalWriteStream, "write_at", noting_write_at)
    save(sd, tmp_path, thread_count=1, chunk_bytes=64 << 10)
    assert waited == [True], "the last group compressed only after chunks of the item were written"
    path, offset, length = item_span(tmp_path, "big")
    assert len(headers) == 1 and headers[0] == (offset, offset + length), "the header goes in last, at the start"
    whole = encode_item(_raw(sd["big"]), kind=KIND_TENSOR, dtype_code=dtype_code(torch.float32),
                        shape=(3 * MiB,), element_size=4, layout=choose_layout(torch.float32, "auto"),
                        pool=None, chunk_bytes=64 << 10)
    with open(path, "rb") as f:
        f.seek(offset)
        assert f.read(length) == whole.header_bytes + b"".join(bytes(c) for c in whole.chunks)
    out = empty_like_sd(sd)
    load(out, tmp_path)
    assert bit_equal(out["big"], sd["big"])


def _raise_enospc() -> None:
    raise OSError(errno.ENOSPC, "injected: no space left on device")


def _state(seed: int) -> dict[str, Any]:
    return {"big": weights_like((2 * MiB,), seed=seed), "small": weights_like((64, 64), seed=seed + 1)}


@pytest.mark.parametrize("stop", ["chunks", "header"])
def test_a_save_stopped_inside_a_streamed_record_leaves_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: str
) -> None:
    """A write fails half-way through the large item's chunks, or when its header is filled in:
    the save fails, the checkpoint already there loads as it was and no file of the failed save
    is left."""
    target = tmp_path / "ckpt"
    old = _state(1)
    save(old, target, thread_count=1)
    before = F.checkpoint_files(target)
    if stop == "header":
        def failing_write_at(self: Any, offset: int, data: Any) -> None:
            raise nvdcp.StorageError(f"injected: cannot write the header at {offset}")

        monkeypatch.setattr(local_module._LocalWriteStream, "write_at", failing_write_at)
        stopper = F.Stopper()
    else:
        stopper = F.Stopper(after_bytes=3 * MiB, action=_raise_enospc)  # inside the 8 MiB tensor's chunks
    with pytest.raises(CheckpointException):
        dcp.save(_state(2), storage_writer=F.StoppingWriter(target, stopper=stopper, thread_count=1))
    referenced, present = F.checkpoint_files(target)
    # the failed save's in-progress marker stays for the next save to clear (nvdcp.dcp.save_guard)
    assert (referenced, {n for n in present if not SAVE_MARKER.match(n)}) == before
    out = empty_like_sd(old)
    load(out, target)
    assert bit_equal(out["big"], old["big"]) and bit_equal(out["small"], old["small"])


def test_files_and_s3_uploads_take_a_header_after_its_record() -> None:
    from nvdcp.storage.base import WriteStream
    from nvdcp.storage.fsspec_store import _FsspecWriteStream
    from nvdcp.storage.s3 import _S3WriteStream

    assert local_module._LocalWriteStream.fills_in and _S3WriteStream.fills_in
    assert not WriteStream.fills_in and not _FsspecWriteStream.fills_in


def test_room_left_in_a_local_file_is_filled_in_later(tmp_path: Path) -> None:
    stream = local_module.LocalStorage(tmp_path, sync=False).create("f")
    stream.write(b"head")
    at = stream.skip(3)
    stream.write(b"tail")
    stream.write_at(at, b"mid")
    with pytest.raises(ValueError, match="not inside room"):
        stream.write_at(stream.tell() - 2, b"past the end")
    stream.commit()
    assert (tmp_path / "f").read_bytes() == b"headmidtail"


def test_encode_items_streams_large_host_tensors_in_their_order_and_one_ahead() -> None:
    """With ``streams``, large plain host tensors come as streamed records between the small
    items' records, in the items' order; the next large item's groups are queued before the
    caller takes the record before it (its plane buffer taken: one item ahead)."""
    from nvdcp.pipeline.config import EncodeConfig
    from nvdcp.pipeline.cpu import StreamedRecord
    from nvdcp.pipeline.encoder import ItemEncoder
    from nvdcp.pipeline.record_batch import RecordBatch

    items = [("a", weights_like((MiB + 3,), seed=1)), ("s", weights_like((64,), seed=2)),
             ("b", weights_like((2 * MiB,), torch.bfloat16, seed=3)), ("c", weights_like((MiB,), seed=4))]
    encoder = ItemEncoder(EncodeConfig(chunk_bytes=64 << 10, codec_threads=2))
    started: list[str] = []
    stream_tensor = encoder.stream_tensor

    def noting(tensor: torch.Tensor, where: str, pool: Any) -> StreamedRecord:
        started.append(where)
        return stream_tensor(tensor, where, pool)

    encoder.stream_tensor = noting  # type: ignore[method-assign]
    got = []
    try:
        for entry in encoder.encode_items(iter(items), str, batches=True, streams=True):
            if isinstance(entry, RecordBatch):  # the small item
                got.extend((job.key, None) for job in entry.jobs)
                continue
            key, record = entry
            if key == "a":
                assert started == ["a"], "a large item after small ones waits for them"
            if key == "b":
                assert started == ["a", "b", "c"], "the next large item is started one ahead"
            assert isinstance(record, StreamedRecord)
            chunks = b"".join(bytes(c) for group in record.groups() for c in group)  # valid until the next group
            got.append((key, (record.finish().header_bytes, chunks)))
    finally:
        encoder.close()
    assert [k for k, _ in got] == ["a", "s", "b", "c"]
    for (key, record), (_, tensor) in zip(got, items):
        if record is None:
            continue
        want = encoder.encode_tensor(tensor, key, pool=None)
        assert record == (want.header_bytes, b"".join(bytes(c) for c in want.chunks))


@pytest.mark.parametrize("window", [1, 2])
def test_group_buffers_are_reused_a_window_later_without_changing_a_byte(
    window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An item over ``STREAM_WHOLE_MAX_BYTES``: its groups (ten, of a 10 MiB tensor) share a
    ring of ``window`` plane buffer slots of one group's size."""
    monkeypatch.setattr(cpu_module, "STREAM_WHOLE_MAX_BYTES", 0)
    monkeypatch.setattr(cpu_module, "STREAM_RING_BYTES", window * MiB)
    t = weights_like((10 * MiB // 4 + 3,))
    kw: dict[str, Any] = dict(kind=KIND_TENSOR, dtype_code=dtype_code(t.dtype), shape=tuple(t.shape),
                              element_size=4, layout=choose_layout(t.dtype, "auto"), chunk_bytes=64 << 10)
    with ThreadPoolExecutor(2) as pool:
        record = stream_item(_raw(t), pool=pool, **kw)
        assert len(record._ring) == window and all(b is not None and b.size <= MiB for b in record._ring)
        streamed = b"".join(bytes(c) for group in record.groups() for c in group)
        header = record.finish().header_bytes
    whole = encode_item(_raw(t), pool=None, **kw)
    assert header == whole.header_bytes and streamed == b"".join(bytes(c) for c in whole.chunks)


def test_a_failed_streamed_record_stops_the_one_ahead_and_the_next_save_works(tmp_path: Path) -> None:
    """The write of the first of two large tensors fails half-way while the second is already
    compressing ahead: the save fails without hanging, and the same process's next save (the
    shared encoder's codec pool again) writes both and loads them bit-exactly."""
    sd = {"a": weights_like((2 * MiB,), seed=5), "b": weights_like((2 * MiB,), seed=6)}
    stopper = F.Stopper(after_bytes=2 * MiB, action=_raise_enospc)
    with pytest.raises(CheckpointException):
        dcp.save(sd, storage_writer=F.StoppingWriter(tmp_path / "failed", stopper=stopper, thread_count=1))
    assert not (tmp_path / "failed" / ".metadata").exists()
    save(sd, tmp_path / "ok", thread_count=1)
    out = empty_like_sd(sd)
    load(out, tmp_path / "ok")
    assert bit_equal(out["a"], sd["a"]) and bit_equal(out["b"], sd["b"])

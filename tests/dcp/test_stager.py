"""NvcompStager on the CPU, one process: what DCP sees, isolation from training, buffer reuse and
bounds, waiting for the previous save, pickling (PROCESS mode), async_save end to end."""

from __future__ import annotations

import copy
import gc
import logging
import pickle
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.staging import AsyncStager

import nvdcp
from nvdcp.dcp.stager import HostBuffers, NvcompStager, StagedShard, StagedTensor, release_staged
from nvdcp.pipeline.encoder import ItemEncoder
from tests.conftest import bit_equal

MiB = 1 << 20


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(300, 70, generator=g) * 0.02,
        "nested": {
            "bf16": (torch.randn(40, 33, generator=g) * 0.02).bfloat16(),
            "list": [torch.ones(3), torch.zeros(2, 0)],  # a list of tensors: DCP visits each
            "tuple": (torch.ones(2), 3),  # a tuple: DCP pickles it whole
        },
        "view": torch.arange(1000, dtype=torch.int64).reshape(10, 100)[:, ::7],
        "param_groups": [{"lr": 0.1, "params": ["w"]}],
        "step": torch.tensor(3.0),
        "mask": torch.rand(100, generator=g) > 0.5,
        "complex": torch.randn(5, dtype=torch.complex64, generator=g),
        "n": 7,
    }


def _target() -> dict[str, Any]:
    sd = _state()
    for k in ("w", "view", "step", "mask", "complex"):
        sd[k] = torch.zeros_like(sd[k].contiguous())
    sd["nested"] = {"bf16": torch.zeros(40, 33, dtype=torch.bfloat16), "list": [torch.zeros(3), torch.zeros(2, 0)],
                    "tuple": None}
    sd["param_groups"] = [{"lr": 0.0, "params": None}]
    sd["n"] = 0
    return sd


def _assert_same(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and bit_equal(got, want.contiguous()), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}.{i}")
    else:
        assert got == want, where


def _mutate(sd: dict[str, Any]) -> None:
    """What the next training step does to the live state."""
    sd["w"].mul_(3)
    sd["nested"]["bf16"].add_(1)
    sd["nested"]["list"][0].add_(1)
    sd["nested"]["tuple"][0].add_(5)
    sd["view"].add_(1)
    sd["step"].add_(1)
    sd["param_groups"][0]["lr"] = 0.5


def _load(path: Path) -> dict[str, Any]:
    out = _target()
    dcp.load(out, storage_reader=nvdcp.NvcompReader(path))
    return out


@pytest.mark.parametrize("mode", ["copy", "compress"])
def test_staged_dict_plans_like_the_original(mode: str) -> None:
    sd = _state()
    staged = NvcompStager(cpu_mode=mode).stage(sd)
    flat, _ = flatten_state_dict(sd)
    flat_staged, _ = flatten_state_dict(staged)
    assert list(flat_staged) == list(flat)
    assert create_default_local_save_plan(flat_staged, True).items == create_default_local_save_plan(flat, True).items
    assert isinstance(staged["w"], StagedTensor) and staged["w"].shape == sd["w"].shape
    assert staged["w"].device.type == "meta"  # no data of its own
    assert isinstance(staged["nested"]["tuple"][0], torch.Tensor) and not isinstance(
        staged["nested"]["tuple"][0], StagedTensor)


@pytest.mark.parametrize("mode", ["copy", "compress"])
def test_saved_state_is_the_staged_one_not_the_mutated_one(tmp_path: Path, mode: str) -> None:
    sd = _state()
    snapshot = copy.deepcopy(sd)
    stager = NvcompStager(cpu_mode=mode)
    staged = stager.stage(sd)
    _mutate(sd)
    dcp.save(staged, storage_writer=nvdcp.NvcompWriter(tmp_path))
    _assert_same(_load(tmp_path), snapshot)
    stats = stager.last_stats
    assert stats is not None and stats.shards == 8
    if mode == "compress":
        assert stats.compressed_shards == 8 and stats.staged_bytes < stats.raw_bytes
    else:
        assert stats.copied_shards == 8 and stats.staged_bytes == stats.raw_bytes


def test_pre_encoded_items_are_written_without_compressing_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    staged = NvcompStager(cpu_mode="compress").stage(_state())
    calls: list[str] = []
    encode_bytes, encode_tensor = ItemEncoder.encode_bytes, ItemEncoder.encode_tensor

    def spy_bytes(self: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append("BYTE_IO")
        return encode_bytes(self, data, *args, **kwargs)

    def spy_tensor(self: Any, tensor: Any, where: str, *args: Any, **kwargs: Any) -> Any:
        calls.append("TENSOR")
        return encode_tensor(self, tensor, where, *args, **kwargs)

    monkeypatch.setattr(ItemEncoder, "encode_bytes", spy_bytes)
    monkeypatch.setattr(ItemEncoder, "encode_tensor", spy_tensor)
    writer = nvdcp.NvcompWriter(tmp_path)
    dcp.save(staged, storage_writer=writer)
    assert calls and set(calls) == {"BYTE_IO"}  # only the pickled leaves
    assert writer.last_report is not None and writer.last_report.ratio > 1.0


def test_buffers_are_reused_across_saves(tmp_path: Path) -> None:
    stager = NvcompStager(buffer_bytes=64 * MiB)
    for i in range(3):
        staged = stager.stage(_state())
        kept = stager._buffers.kept_bytes  # type: ignore[union-attr]
        base = staged["w"].staged_shards[0].tensor.untyped_storage().data_ptr()
        if i == 0:
            first = (kept, base)
        assert (kept, base) == first  # same memory, nothing new allocated
        dcp.save(staged, storage_writer=nvdcp.NvcompWriter(tmp_path / str(i)))
    assert stager.last_stats is not None and stager.last_stats.temp_bytes == 0


def test_kept_memory_is_bounded_and_overflow_is_temporary(tmp_path: Path) -> None:
    stager = NvcompStager(buffer_bytes=32 * 1024)
    sd = _state()
    staged = stager.stage(sd)
    buffers = stager._buffers
    assert buffers is not None and buffers.kept_bytes <= 32 * 1024 and buffers.temp_bytes > 0
    dcp.save(staged, storage_writer=nvdcp.NvcompWriter(tmp_path))
    assert buffers.temp_bytes == 0  # released with the save
    _assert_same(_load(tmp_path), sd)


def test_host_buffers_align_and_carve_front_to_back() -> None:
    buffers = HostBuffers(keep_bytes=4 * MiB, segment_bytes=MiB)
    a = buffers.alloc(10)
    b = buffers.alloc(100)
    assert b.data_ptr() - a.data_ptr() == 64
    big = buffers.alloc(3 * MiB)  # larger than a segment: a segment of its own
    assert big.numel() == 3 * MiB and buffers.temp_bytes == 0
    buffers.alloc(2 * MiB)  # over the kept limit: temporary
    assert buffers.temp_bytes >= 2 * MiB and buffers.kept_bytes <= 4 * MiB
    buffers.reset()
    assert buffers.alloc(10).data_ptr() == a.data_ptr() and buffers.temp_bytes == 0


def test_next_stage_waits_until_the_previous_save_wrote_its_data(tmp_path: Path) -> None:
    stager = NvcompStager()
    staged = stager.stage(_state())
    order: list[str] = []

    def second() -> None:
        stager.stage(_state())
        order.append("staged again")

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.5)
    assert t.is_alive()  # blocked: the first staged dict still holds the buffers
    order.append("saving")
    dcp.save(staged, storage_writer=nvdcp.NvcompWriter(tmp_path))
    t.join(30)
    assert order == ["saving", "staged again"]
    _assert_same(_load(tmp_path), _state())


def test_buffers_come_back_when_the_staged_dict_is_dropped() -> None:
    stager = NvcompStager(wait_timeout_s=30)
    staged = stager.stage(_state())
    del staged  # e.g. a save that failed before writing
    t0 = time.perf_counter()
    stager.stage(_state())
    assert time.perf_counter() - t0 < 5


def test_a_stuck_previous_save_never_hangs_staging(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    stager = NvcompStager(wait_timeout_s=0.3)
    sd = _state()
    held = stager.stage(sd)
    with caplog.at_level(logging.WARNING, logger="nvdcp.dcp.stager"):
        other = stager.stage({"x": torch.full((5000,), 9.0)})
    assert "still holds its staging buffers" in caplog.text
    # The held dict's bytes were not overwritten: both still save correctly.
    dcp.save(held, storage_writer=nvdcp.NvcompWriter(tmp_path / "held"))
    dcp.save(other, storage_writer=nvdcp.NvcompWriter(tmp_path / "other"))
    _assert_same(_load(tmp_path / "held"), sd)
    out = {"x": torch.zeros(5000)}
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path / "other"))
    assert torch.equal(out["x"], torch.full((5000,), 9.0))


@pytest.mark.parametrize("mode", ["copy", "compress"])
def test_staged_dict_pickles_for_process_mode(tmp_path: Path, mode: str) -> None:
    sd = _state()
    staged = NvcompStager(cpu_mode=mode).stage(sd)
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions, as in PROCESS mode)

    copied = pickle.loads(ForkingPickler.dumps(staged))
    assert isinstance(copied["w"], StagedTensor)
    assert all(isinstance(s, StagedShard) and s.lease is None for s in copied["w"].staged_shards)
    _mutate(sd)
    dcp.save(copied, storage_writer=nvdcp.NvcompWriter(tmp_path))
    _assert_same(_load(tmp_path), _state())


def test_writer_and_stager_pickle_and_speak_async_stager(tmp_path: Path) -> None:
    writer = nvdcp.NvcompWriter(tmp_path, codec="zstd")
    assert isinstance(writer, AsyncStager) and not writer.should_synchronize_after_execute
    dcp.save({"a": torch.ones(3)}, storage_writer=writer)  # a used writer must pickle too
    again = pickle.loads(pickle.dumps(writer))
    assert again.codec == "zstd" and again.last_report is None
    stager = NvcompStager(cpu_mode="compress", buffer_bytes=8 * MiB)
    stager.stage(_state())
    clone = pickle.loads(pickle.dumps(stager))
    assert (clone.cpu_mode, clone.buffer_bytes, clone._buffers) == ("compress", 8 * MiB, None)
    assert isinstance(stager, AsyncStager)
    stager.close()


def test_async_save_with_the_writer_as_stager(tmp_path: Path) -> None:
    sd = _state()
    snapshot = copy.deepcopy(sd)
    fut = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path))
    _mutate(sd)
    fut.result()
    _assert_same(_load(tmp_path), snapshot)


def test_async_save_twice_with_one_stager(tmp_path: Path) -> None:
    stager = NvcompStager(cpu_mode="compress")
    sd = _state()
    for i in range(2):
        snapshot = copy.deepcopy(sd)
        fut = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / str(i)), async_stager=stager)
        _mutate(sd)
        fut.result()
        _assert_same(_load(tmp_path / str(i)), snapshot)
    stager.close()


def test_return_future_makes_async_save_answer_an_async_save_response(tmp_path: Path) -> None:
    """``return_future=True``: ``stage`` hands back a completed future of the staged dict, so
    ``dcp.async_save`` returns ``AsyncSaveResponse`` (what torchtitan's pinned mode asserts);
    the default still returns the dict."""
    from concurrent.futures import Future

    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    plain = NvcompStager(cpu_mode="compress")
    assert isinstance(plain.stage(_state()), dict)
    plain.close()
    stager = NvcompStager(cpu_mode="compress", return_future=True)
    assert pickle.loads(pickle.dumps(stager)).return_future is True
    staged = stager.stage(_state())
    assert isinstance(staged, Future) and staged.done() and isinstance(staged.result()["w"], StagedTensor)
    del staged  # its buffers come back with it
    sd = _state()
    for i in range(2):  # the second save reuses the buffers the first one released
        snapshot = copy.deepcopy(sd)
        response = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / str(i)), async_stager=stager)
        assert isinstance(response, AsyncSaveResponse)
        assert response.staging_completion.done() and response.staging_completion.result() is None
        _mutate(sd)
        response.upload_completion.result()
        _assert_same(_load(tmp_path / str(i)), snapshot)
    assert stager.last_stats is not None and stager.last_stats.wait_seconds < 5
    stager.close()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="cpu_mode"):
        NvcompStager(cpu_mode="gpu")
    with pytest.raises(ValueError, match="chunk_bytes"):
        NvcompStager(chunk_bytes=10)
    with pytest.raises(nvdcp.UnknownCodecError):
        NvcompStager(codec="lzma")


@pytest.mark.gpu
def test_overlapped_gpu_staging_writes_the_records_of_synchronous_staging(tmp_path: Path) -> None:
    """async_staging compresses a device snapshot in the background: the same records as
    staging synchronously from the tensors (bit-identical files' item sizes and loads)."""
    cuda = torch.device("cuda", 0)
    g = torch.Generator(device=cuda).manual_seed(3)
    sd = {"w": torch.randn(1000, 300, device=cuda, generator=g), "b": torch.randn(77, device=cuda, generator=g).half(),
          "t": torch.randn(64, 64, device=cuda, generator=g).t(), "n": 5}
    want = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    for name, stager in (("sync", NvcompStager()), ("overlap", NvcompStager(async_staging=True))):
        staged = stager.stage(sd)
        if name == "overlap":
            assert isinstance(staged, Future)
            staged = staged.result()
        dcp.save(staged, storage_writer=nvdcp.NvcompWriter(tmp_path / name))
        out = {k: (torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else 0) for k, v in sd.items()}
        dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path / name))
        _assert_same(out, want)
        stager.close()
    sizes = [{(k.fqn, tuple(k.offset or ())): v.length  # offset None: the bytes item
              for k, v in nvdcp.NvcompReader(tmp_path / n).read_metadata().storage_data.items()} for n in ("sync", "overlap")]
    assert sizes[0] == sizes[1]


def test_staged_records_hold_no_object_per_chunk() -> None:
    """A staged save lives until its upload ends; objects per chunk in it would be promoted to
    the collector's oldest generation and trigger full collections that pause the training
    loop. Records copied into the stager's buffers hold one view per item."""
    g = torch.Generator().manual_seed(1)
    sd = {f"t{i}": torch.randn(256 * 1024, generator=g) for i in range(4)}  # 4 MiB, 1 KiB chunks: 4,096 chunks
    stager = NvcompStager(cpu_mode="compress", chunk_bytes=1024)
    gc.collect()
    before = len(gc.get_objects())
    staged = stager.stage(sd)
    gc.collect()
    grown = len(gc.get_objects()) - before
    shards = [s for t in staged.values() for s in t.staged_shards]
    assert sum(len(s.encoded.header.chunks) for s in shards) >= 4 * 1024
    assert all(len(s.encoded.chunks) <= 2 for s in shards)  # one view per buffer run
    assert grown < 400, grown
    release_staged(shards)
    stager.close()


@pytest.mark.gpu
def test_gpu_staged_records_hold_no_object_per_chunk(tmp_path: Path) -> None:
    """Records staged on the GPU view the stager's buffers as spans (ChunkSpans), not as one
    memoryview per chunk, and still save and load bit-exactly."""
    from nvdcp.storage.spans import ChunkSpans

    cuda = torch.device("cuda", 0)
    g = torch.Generator(device=cuda).manual_seed(5)
    sd = {f"t{i}": torch.randn(1 << 20, device=cuda, generator=g) for i in range(4)}  # 16 MiB, 4 KiB chunks
    stager = NvcompStager(async_staging=True, chunk_bytes=4096)
    stager.warm_up(sd)
    gc.collect()
    before = len(gc.get_objects())
    future = stager.stage(sd)
    assert isinstance(future, Future)
    staged = future.result()
    shards = [s for t in staged.values() for s in t.staged_shards]
    assert all(isinstance(s.encoded.chunks, ChunkSpans) for s in shards)
    gc.collect()
    grown = len(gc.get_objects()) - before
    assert sum(len(s.encoded.header.chunks) for s in shards) >= 4096
    assert grown < 400, grown
    dcp.save(staged, storage_writer=nvdcp.NvcompWriter(tmp_path))
    out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path))
    for k, v in sd.items():
        assert bit_equal(out[k], v.cpu()), k
    stager.close()


def test_host_buffers_reserve_the_fewest_power_of_two_segments() -> None:
    buffers = HostBuffers(keep_bytes=64 * MiB, segment_bytes=MiB)
    for _ in range(10):
        buffers.alloc(MiB - 100)
    buffers.reset()
    buffers.reserve(21 * MiB + 5)  # + 0.1%, rounded up to MiB: 22 MiB = 16 + 4 + 2
    assert [t.numel() for t in buffers._kept] == [16 * MiB, 4 * MiB, 2 * MiB]
    assert buffers.kept_bytes == 22 * MiB
    runs = buffers.place(np.full(21, MiB))  # 21 MiB in pieces of 1 MiB: all in kept segments
    assert sum(hi - lo for _, lo, hi in runs) == 21 and buffers.temp_bytes == 0
    small = HostBuffers(keep_bytes=8 * MiB)
    small.reserve(100 * MiB)  # never past keep_bytes
    assert small.kept_bytes == 8 * MiB


def test_warm_up_reserves_about_the_staged_size(tmp_path: Path) -> None:
    """After warm-up the kept buffers hold what the state stages to, not the segments grown
    while staging it; the first save then grows nothing."""
    g = torch.Generator().manual_seed(3)
    sd = {f"t{i}": torch.randn(700_000, generator=g) for i in range(3)}
    stager = NvcompStager(cpu_mode="compress", buffer_bytes=256 * MiB)
    warm = stager.warm_up(sd)
    assert stager._buffers is not None
    kept = stager._buffers.kept_bytes
    assert warm.staged_bytes <= kept <= warm.staged_bytes * 1.001 + MiB
    staged = stager.stage(sd)
    assert stager.last_stats is not None and stager.last_stats.grown_bytes == 0
    assert stager.last_stats.temp_bytes == 0
    dcp.save(staged, storage_writer=nvdcp.NvcompWriter(tmp_path))
    stager.close()


def test_warm_up_lets_the_replaced_segments_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """When warm-up re-reserves its buffers, nothing of the warm-up staging may still hold the
    segments being replaced (with CUDA they could then not be handed back to the system and
    would stay pinned next to the new ones)."""
    alive: list[int] = []
    reserve = HostBuffers.reserve

    def checking(self: HostBuffers, nbytes: int) -> None:
        storages = [t.untyped_storage() for t in self._kept]  # these wrappers are one holder each
        self.close()
        gc.collect()
        alive.append(sum(torch._C._storage_Use_Count(st._cdata) > 1 for st in storages))
        del storages
        reserve(self, nbytes)

    monkeypatch.setattr(HostBuffers, "reserve", checking)
    g = torch.Generator().manual_seed(4)
    sd = {f"t{i}": torch.randn(300_000, generator=g) for i in range(3)}
    stager = NvcompStager(cpu_mode="compress", buffer_bytes=256 * MiB)
    stager.warm_up(sd)
    assert alive == [0]
    stager.close()

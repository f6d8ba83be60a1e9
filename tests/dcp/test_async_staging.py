"""Overlapped staging (``NvcompStager(async_staging=True)``, issue 14) on the CPU: the API that
torch's zero-overhead recipe uses (``AsyncSaveResponse``, ``staging_completion``), background
compression from a host snapshot, a second save while one is in flight, warm-up, errors.
The device side (snapshot on the GPU, stream order) is tests/training/test_async_gpu.py."""

from __future__ import annotations

import copy
import pickle
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import nvdcp
from nvdcp.dcp.stager import NvcompStager, StagedTensor
from nvdcp.pipeline.encoder import ItemEncoder
from tests.dcp.test_stager import _assert_same, _load, _mutate, _state

MiB = 1 << 20


@pytest.mark.parametrize("mode", ["copy", "compress"])
def test_async_save_answers_an_async_save_response_and_keeps_the_save_step_state(tmp_path: Path, mode: str) -> None:
    stager = NvcompStager(cpu_mode=mode, async_staging=True)
    sd = _state()
    for i in range(2):
        want = copy.deepcopy(sd)
        response = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / str(i)), async_stager=stager)
        assert isinstance(response, AsyncSaveResponse)
        _mutate(sd)  # the next step writes in place before the staging wait
        assert response.staging_completion.result(timeout=60) is None
        response.upload_completion.result(timeout=120)
        _assert_same(_load(tmp_path / str(i)), want)
    stats = stager.last_stats
    assert stats is not None and stats.shards == 8
    if mode == "compress":
        assert stats.snapshot_bytes == stats.raw_bytes - 0  # every non-empty shard
        assert stats.compressed_shards == 8 and 0 < stats.staged_bytes < stats.raw_bytes
    stager.close()


def test_compression_runs_in_the_background_from_the_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    threads: list[str] = []
    encode_tensor = ItemEncoder.encode_tensor

    def slow(self: Any, tensor: torch.Tensor, where: str, *args: Any, **kwargs: Any) -> Any:
        if tensor.numel():  # empty tensors are encoded at once: nothing to snapshot
            threads.append(threading.current_thread().name)
            gate.wait(30)
        return encode_tensor(self, tensor, where, *args, **kwargs)

    monkeypatch.setattr(ItemEncoder, "encode_tensor", slow)
    stager = NvcompStager(cpu_mode="compress", async_staging=True)
    sd = _state()
    want = copy.deepcopy(sd)
    t0 = time.perf_counter()
    staged = stager.stage(sd)
    assert time.perf_counter() - t0 < 10
    assert isinstance(staged, Future) and staged.done()  # the host snapshot is complete
    assert isinstance(staged.result()["w"], StagedTensor)
    _mutate(sd)
    gate.set()
    dcp.save(staged.result(), storage_writer=nvdcp.NvcompWriter(tmp_path))
    assert threads and all(name.startswith("nvdcp-stage") for name in threads)
    _assert_same(_load(tmp_path), want)
    stager.close()


def test_a_second_save_while_one_is_in_flight_waits_for_its_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither staging_completion nor upload_completion awaited before the next async_save: the
    second call blocks until the first save's data is written, and both checkpoints hold the
    state of their own step."""
    from nvdcp.dcp import writer as writer_mod

    write_file = writer_mod.NvcompWriter._write_file
    writers = [nvdcp.NvcompWriter(tmp_path / str(i)) for i in range(2)]

    def slow(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self is writers[0]:
            time.sleep(1.0)
        return write_file(self, *args, **kwargs)

    monkeypatch.setattr(writer_mod.NvcompWriter, "_write_file", slow)
    stager = NvcompStager(cpu_mode="compress", async_staging=True)
    sd = _state()
    wants, responses = [], []
    for i in range(2):
        wants.append(copy.deepcopy(sd))
        responses.append(dcp.async_save(sd, storage_writer=writers[i], async_stager=stager))
        _mutate(sd)
    # The second call waited until the first save's data was written (its buffers were free).
    assert stager.last_stats is not None and stager.last_stats.wait_seconds > 0.5
    for i, r in enumerate(responses):
        r.upload_completion.result(timeout=120)
        _assert_same(_load(tmp_path / str(i)), wants[i])
    stager.close()


def test_warm_up_reserves_the_buffers_of_the_first_save(tmp_path: Path) -> None:
    stager = NvcompStager(cpu_mode="compress", async_staging=True)
    sd = _state()
    stats = stager.warm_up(sd)
    assert stager.warm_up_stats is stats and stats.grown_bytes > 0 and stats.seconds > 0
    assert not any(tmp_path.iterdir())  # nothing saved
    response = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path), async_stager=stager)
    response.upload_completion.result(timeout=120)
    assert stager.last_stats is not None and stager.last_stats.grown_bytes == 0  # no first-save penalty
    assert stager.last_stats.wait_seconds < 5  # warm-up left the buffers free
    _assert_same(_load(tmp_path), sd)
    stager.close()


def test_a_background_failure_fails_the_save_and_the_next_one_works(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    stager = NvcompStager(cpu_mode="compress", async_staging=True, wait_timeout_s=30)
    encode_tensor = ItemEncoder.encode_tensor

    def broken(self: Any, tensor: torch.Tensor, where: str, *args: Any, **kwargs: Any) -> Any:
        if tensor.numel():  # only the background's work (empty tensors are encoded at once)
            raise RuntimeError(f"injected failure at {where}")
        return encode_tensor(self, tensor, where, *args, **kwargs)

    monkeypatch.setattr(ItemEncoder, "encode_tensor", broken)
    response = dcp.async_save(_state(), storage_writer=nvdcp.NvcompWriter(tmp_path / "bad"), async_stager=stager)
    response.staging_completion.result(timeout=60)  # the snapshot itself was fine
    with pytest.raises(BaseException, match="injected failure"):  # CheckpointException is a BaseException
        response.upload_completion.result(timeout=120)
    assert not (tmp_path / "bad" / ".metadata").exists()
    monkeypatch.setattr(ItemEncoder, "encode_tensor", encode_tensor)
    sd = _state()
    dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "good"), async_stager=stager) \
        .upload_completion.result(timeout=120)
    _assert_same(_load(tmp_path / "good"), sd)
    stager.close()


def test_the_writer_as_its_own_stager_overlaps_with_an_async_stager(tmp_path: Path) -> None:
    """nvdcp's own entry point: ``NvcompWriter(stager=...)``, no ``async_stager`` argument."""
    stager = NvcompStager(cpu_mode="compress", async_staging=True)
    sd = _state()
    want = copy.deepcopy(sd)
    response = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path, stager=stager))
    assert isinstance(response, AsyncSaveResponse)
    response.staging_completion.result(timeout=60)
    _mutate(sd)
    response.upload_completion.result(timeout=120)
    _assert_same(_load(tmp_path), want)
    stager.close()


def test_settings_pickle_and_bad_arguments() -> None:
    stager = NvcompStager(async_staging=True, snapshot_bytes=64 * MiB)
    clone = pickle.loads(pickle.dumps(stager))
    assert (clone.async_staging, clone.snapshot_bytes, clone.warm_up_stats) == (True, 64 * MiB, None)
    with pytest.raises(ValueError, match="snapshot_bytes"):
        NvcompStager(snapshot_bytes=-1)

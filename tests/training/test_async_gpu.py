"""async_save with NvcompStager on a real GPU: compression on the device into reused host
buffers, isolation from the next training step, stream ordering, PROCESS mode.

Run on the GPU device machine; skipped without CUDA and nvidia-nvcomp-cu12.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import nvdcp
from nvdcp.dcp.stager import NvcompStager
from nvdcp.demo.model import GPT, GPTConfig, batch_for_step, stdlib_bytes
from nvdcp.gpu.config import GpuConfig
from tests._dist import free_port
from tests.conftest import bit_equal

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
CUDA = torch.device("cuda", 0)
MiB = 1 << 20


def _trained(steps: int = 3) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=256, n_layers=2, n_heads=4, context=64)).to(CUDA)
    optim = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True)
    data = stdlib_bytes(1 << 20)
    for step in range(steps):
        _step(model, optim, data, step)
    return model, optim


def _step(model: GPT, optim: torch.optim.Optimizer, data: torch.Tensor, step: int) -> None:
    x, y = batch_for_step(data, step, 0, 1, 8, 64)
    model(x.to(CUDA), y.to(CUDA)).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _state(model: GPT, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def _snapshot(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return sd.detach().clone()
    if isinstance(sd, dict):
        return {k: _snapshot(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_snapshot(v) for v in sd]
    return copy.deepcopy(sd)


def _assert_same(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert bit_equal(got.detach().cpu(), want.detach().cpu()), where
    elif isinstance(want, dict):
        for k in want:
            _assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}.{i}")
    else:
        assert got == want, where


def _load_like(want: Any, path: Path, device: torch.device, **reader: Any) -> Any:
    def zeros(sd: Any) -> Any:
        if isinstance(sd, torch.Tensor):
            return torch.zeros(sd.shape, dtype=sd.dtype, device=device)
        if isinstance(sd, dict):
            return {k: zeros(v) for k, v in sd.items()}
        if isinstance(sd, list):
            return [zeros(v) for v in sd]
        return sd

    out = zeros(want)
    dcp.load(out, storage_reader=nvdcp.NvcompReader(path, **reader))
    return out


def test_gpu_staging_compresses_on_device_and_isolates_the_next_step(tmp_path: Path) -> None:
    model, optim = _trained()
    sd = _state(model, optim)
    want = _snapshot(sd)
    stager = NvcompStager()
    fut = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path), async_stager=stager)
    _step(model, optim, stdlib_bytes(1 << 20), 99)  # changes every parameter and moment at once
    fut.result()
    stats = stager.last_stats
    assert stats is not None and stats.gpu_shards > 0 and stats.staged_bytes < stats.raw_bytes
    _assert_same(_load_like(want, tmp_path, CUDA), want)
    # GPU-written (GDeflate) records decode on the CPU too.
    _assert_same(_load_like(want, tmp_path, torch.device("cpu"), gpu=GpuConfig(decode_device="cpu")), want)
    stager.close()


def test_staging_waits_for_the_kernel_that_writes_the_tensor(tmp_path: Path) -> None:
    src = torch.randn(64 * MiB // 4, device=CUDA)
    dst = torch.empty_like(src)
    torch.cuda._sleep(50_000_000)  # keep the stream busy, so the copy below is still queued
    dst.copy_(src)
    stager = NvcompStager()
    fut = dcp.async_save({"x": dst}, storage_writer=nvdcp.NvcompWriter(tmp_path), async_stager=stager)
    dst.zero_()
    fut.result()
    out = {"x": torch.zeros_like(src)}
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path))
    assert bit_equal(out["x"].cpu(), src.cpu())
    stager.close()


def test_pinned_buffers_are_reused_and_bounded(tmp_path: Path) -> None:
    model, optim = _trained()
    stager = NvcompStager(buffer_bytes=16 * MiB, gpu=GpuConfig(pinned_memory_bytes=64 * MiB))
    kept = []
    for i in range(3):
        sd = _state(model, optim)
        want = _snapshot(sd)
        fut = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / str(i)), async_stager=stager)
        fut.result()
        kept.append(stager._buffers.kept_bytes)  # type: ignore[union-attr]
        _assert_same(_load_like(want, tmp_path / str(i), CUDA), want)
    assert kept[0] == kept[1] == kept[2] <= 16 * MiB
    assert stager.last_stats is not None and stager.last_stats.pinned_bytes <= 16 * MiB
    # Staging copies into the stager's own buffers; its encoder's pinned pool stays within its bound.
    assert stager.encoder.pinned.peak <= 64 * MiB
    stager.close()


def test_process_mode_async_save(tmp_path: Path) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    try:
        model, optim = _trained()
        sd = _state(model, optim)
        want = _snapshot(sd)
        fut = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path),
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        _step(model, optim, stdlib_bytes(1 << 20), 99)
        fut.result()
        _assert_same(_load_like(want, tmp_path, CUDA), want)
    finally:
        dist.destroy_process_group()


def test_staged_records_equal_the_writers_across_many_buckets(tmp_path: Path) -> None:
    # A tiny GPU budget cuts the state into many buckets, tensors spanning several of them.
    gpu = GpuConfig(gpu_memory_bytes=16 * MiB)
    big = torch.randn(6 * MiB, device=CUDA)  # 24 MiB: spans buckets
    sd = {"big": big, "bf16": big[: MiB].bfloat16(), "ints": torch.arange(70_000, device=CUDA),
          "empty": torch.empty(0, device=CUDA), "scalar": torch.tensor(2.5, device=CUDA)}
    want = _snapshot(sd)
    stager = NvcompStager(gpu=gpu)
    dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "staged", gpu=gpu), async_stager=stager).result()
    dcp.save(want, storage_writer=nvdcp.NvcompWriter(tmp_path / "direct", gpu=gpu))
    _assert_same(_load_like(want, tmp_path / "staged", CUDA), want)
    _assert_same(_load_like(want, tmp_path / "staged", torch.device("cpu"), gpu=GpuConfig(decode_device="cpu")), want)
    def record_sizes(path: Path) -> dict[Any, int]:
        storage = nvdcp.NvcompReader(path).read_metadata().storage_data
        return {(k.fqn, tuple(k.offset)): v.length for k, v in storage.items()}

    assert record_sizes(tmp_path / "staged") == record_sizes(tmp_path / "direct")  # the same records
    stats, buffers = stager.last_stats, stager._buffers
    assert stats is not None and buffers is not None
    # Only stored bytes are kept: granule padding and segment tails stay small.
    assert buffers.pinned_bytes <= stats.staged_bytes * 1.02 + buffers.segment_bytes
    stager.close()


# -- overlapped staging (issue 14) ------------------------------------------------------------
def _write_in_place(model: GPT, optim: torch.optim.Optimizer) -> None:
    """What a training step does to the state, queued on the current stream: every parameter
    and every AdamW moment overwritten in place."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0).add_(1.0)
        for state in optim.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    v.add_(7.0)


def test_overlapped_staging_returns_first_and_keeps_the_save_step_state(tmp_path: Path) -> None:
    """async_save returns before the snapshot is even taken (the stream is busy); the next step
    writes every tensor in place before staging_completion is awaited; the checkpoint holds the
    state at the call, bit for bit."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    model, optim = _trained()
    sd = _state(model, optim)
    want = _snapshot(sd)
    stager = NvcompStager(async_staging=True)
    stager.warm_up(sd)  # as the recipe does before training: buffers pinned outside the timed call
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s busy: nothing queued after this runs before the call returns
    response = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path), async_stager=stager)
    assert isinstance(response, AsyncSaveResponse)
    assert not response.staging_completion.done()  # returned before compression (and the snapshot)
    _write_in_place(model, optim)  # before the staging wait
    _step(model, optim, stdlib_bytes(1 << 20), 99)
    response.staging_completion.result()
    response.upload_completion.result()
    stats = stager.last_stats
    assert stats is not None and stats.snapshot_bytes >= stats.raw_bytes and stats.sync_shards == 0
    assert stats.gpu_shards > 0 and 0 < stats.staged_bytes < stats.raw_bytes
    assert stats.seconds < stats.snapshot_seconds  # the call returned before the snapshot was done
    _assert_same(_load_like(want, tmp_path, CUDA), want)
    _assert_same(_load_like(want, tmp_path, torch.device("cpu"), gpu=GpuConfig(decode_device="cpu")), want)
    stager.close()


def test_overlapped_saves_never_waited_for_stay_exact(tmp_path: Path) -> None:
    """A loop that never awaits staging_completion (nor the upload) before the next step and
    the next save: writes on the current stream are ordered after the snapshot, and the second
    save waits for the first one's buffers; both checkpoints hold their own step's state."""
    model, optim = _trained()
    stager = NvcompStager(async_staging=True)
    wants, responses = [], []
    for i in range(3):
        sd = _state(model, optim)
        wants.append(_snapshot(sd))
        responses.append(dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / str(i)), async_stager=stager))
        _write_in_place(model, optim)
        _step(model, optim, stdlib_bytes(1 << 20), 100 + i)
    for i, r in enumerate(responses):
        r.upload_completion.result()
        _assert_same(_load_like(wants[i], tmp_path / str(i), CUDA), wants[i])
    stager.close()


def test_snapshot_budget_overflow_is_staged_before_the_call_returns(tmp_path: Path) -> None:
    model, optim = _trained()
    sd = _state(model, optim)
    want = _snapshot(sd)
    stager = NvcompStager(async_staging=True, snapshot_bytes=2 * MiB)
    response = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path), async_stager=stager)
    _write_in_place(model, optim)
    response.staging_completion.result()
    response.upload_completion.result()
    stats = stager.last_stats
    assert stats is not None and stats.sync_shards > 0 and 0 < stats.snapshot_bytes <= 2 * MiB
    _assert_same(_load_like(want, tmp_path, CUDA), want)
    stager.close()


def test_warm_up_removes_the_first_save_penalty(tmp_path: Path) -> None:
    model, optim = _trained()
    stager = NvcompStager(async_staging=True, buffer_bytes=512 * MiB)
    warm = stager.warm_up(_state(model, optim))
    assert warm.grown_bytes > 0 and warm.pinned_bytes > 0
    for i in range(2):
        sd = _state(model, optim)
        want = _snapshot(sd)
        response = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / str(i)), async_stager=stager)
        response.staging_completion.result()
        _step(model, optim, stdlib_bytes(1 << 20), 200 + i)
        response.upload_completion.result()
        stats = stager.last_stats
        assert stats is not None and stats.grown_bytes <= 8 * MiB  # at most one more segment
        # Pinned memory is about the compressed size of the state.
        assert stats.pinned_bytes <= stats.staged_bytes * 1.02 + 8 * MiB
        _assert_same(_load_like(want, tmp_path / str(i), CUDA), want)
    stager.close()


def test_overlapped_staging_in_process_mode(tmp_path: Path) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    stager = NvcompStager(async_staging=True)
    try:
        model, optim = _trained()
        sd = _state(model, optim)
        want = _snapshot(sd)
        response = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path), async_stager=stager,
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        _write_in_place(model, optim)
        response.staging_completion.result()
        response.upload_completion.result()
        _assert_same(_load_like(want, tmp_path, CUDA), want)
    finally:
        stager.close()
        dist.destroy_process_group()

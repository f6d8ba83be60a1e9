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

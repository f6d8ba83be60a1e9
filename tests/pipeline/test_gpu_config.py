"""GpuConfig's budgets: defaults differ for saves and loads; an explicit value sets both."""

from __future__ import annotations

import pytest
import torch

from nvdcp.gpu.config import LOAD_PINNED_BYTES, SAVE_PINNED_BYTES, GpuConfig

MiB = 1 << 20


def test_pinned_defaults_and_explicit_values() -> None:
    cfg = GpuConfig()
    assert cfg.pinned_bytes() == SAVE_PINNED_BYTES == 512 * MiB
    assert cfg.pinned_bytes(load=True) == LOAD_PINNED_BYTES == 2048 * MiB
    fixed = GpuConfig(pinned_memory_bytes=64 * MiB)
    assert fixed.pinned_bytes() == fixed.pinned_bytes(load=True) == 64 * MiB


def test_explicit_gpu_budget_is_used_for_both() -> None:
    cfg = GpuConfig(gpu_memory_bytes=256 * MiB)
    assert cfg.gpu_budget(torch.device("cuda", 0)) == cfg.gpu_budget(torch.device("cuda", 0), load=True) == 256 * MiB


def test_bad_budgets_are_refused() -> None:
    with pytest.raises(ValueError, match="pinned_memory_bytes must be at least 8 MiB"):
        GpuConfig(pinned_memory_bytes=MiB)
    with pytest.raises(ValueError, match="gpu_memory_bytes must be at least 16 MiB"):
        GpuConfig(gpu_memory_bytes=MiB)


@pytest.mark.gpu
def test_default_gpu_budgets_follow_free_memory() -> None:
    dev = torch.device("cuda", 0)
    free, _ = torch.cuda.mem_get_info(dev)
    cfg = GpuConfig()
    assert cfg.gpu_budget(dev) <= min(1 << 30, free // 20) + MiB
    assert cfg.gpu_budget(dev, load=True) <= min(8 << 30, free // 10) + MiB
    assert cfg.gpu_budget(dev, load=True) >= cfg.gpu_budget(dev)

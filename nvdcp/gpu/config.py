"""Bounds and choices for the GPU path, in one frozen config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class GpuConfig:
    """Settings of the GPU path of :class:`~nvdcp.NvcompWriter` and :class:`~nvdcp.NvcompReader`.

    Args:
        gpu_memory_bytes: scratch GPU memory a save or load may use (planes, compressed chunks,
            staging). ``None``: 1 GiB or 5% of the free GPU memory, whichever is smaller.
        pinned_memory_bytes: pinned host memory for device<->host copies, reused across saves.
        gdeflate_algorithm_type: nvCOMP GDeflate algorithm type (0-5) for GPU compression; 0 is
            the entropy-only mode, which measured both the best ratio and the highest speed on
            sign+exponent planes (benchmarks/results/gpu_probe_*.json).
        decode_device: where to decompress items whose destination is host memory on a GPU
            machine: ``"auto"`` (the GPU, measured faster for every codec here), ``"cuda"`` or ``"cpu"``.
    """

    gpu_memory_bytes: int | None = None
    pinned_memory_bytes: int = 512 * MiB
    gdeflate_algorithm_type: int = 0
    decode_device: str = "auto"

    def __post_init__(self) -> None:
        if self.gpu_memory_bytes is not None and self.gpu_memory_bytes < 16 * MiB:
            raise ValueError(f"gpu_memory_bytes must be at least 16 MiB, got {self.gpu_memory_bytes}")
        if self.pinned_memory_bytes < 8 * MiB:
            raise ValueError(f"pinned_memory_bytes must be at least 8 MiB, got {self.pinned_memory_bytes}")
        if not 0 <= self.gdeflate_algorithm_type <= 5:
            raise ValueError(f"gdeflate_algorithm_type must be 0-5, got {self.gdeflate_algorithm_type}")
        if self.decode_device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"decode_device must be 'auto', 'cuda' or 'cpu', got {self.decode_device!r}")

    def gpu_budget(self, device: torch.device) -> int:
        if self.gpu_memory_bytes is not None:
            return self.gpu_memory_bytes
        free, _total = torch.cuda.mem_get_info(device)
        return max(16 * MiB, min(GiB, free // 20))

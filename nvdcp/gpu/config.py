"""Bounds and choices for the GPU path, in one frozen config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GiB = 1 << 30
MiB = 1 << 20


#: Default budgets (``GpuConfig`` fields left None): caps of the GPU scratch, pinned host memory.
SAVE_GPU_BYTES = GiB
LOAD_GPU_BYTES = 8 * GiB
SAVE_PINNED_BYTES = 512 * MiB
LOAD_PINNED_BYTES = 2 * GiB


@dataclass(frozen=True)
class GpuConfig:
    """Settings of the GPU path of :class:`~nvdcp.NvcompWriter` and :class:`~nvdcp.NvcompReader`.

    Args:
        gpu_memory_bytes: the most GPU memory a save or load may add: its scratch (planes,
            compressed chunks, staging, the bases of deltas) and nvCOMP's workspaces
            (:mod:`nvdcp.gpu.bound`: under a bound too small for Zstd's 1.07 GiB compression
            workspace a delta's top planes get GDeflate, and ``codec="zstd"`` is refused; loads
            set a quarter aside for decompression and split calls to fit it). ``None``: a
            scratch of 1 GiB or 5% of the free GPU memory for saves, whichever is smaller, with
            the workspaces beside it; for loads 8 GiB or 10% of the free memory (load passes are bound by their
            per-pass host work: larger passes measured 6.4 -> 17.3 GB/s on an H200,
            benchmarks/results/load_knobs_2026-12-01_h200.json). Loads run before training
            allocates its activations, and give the memory back to torch's caching allocator.
        pinned_memory_bytes: pinned host memory for device<->host copies, reused across saves
            and loads. ``None``: 512 MiB for saves (more measured no faster), 2 GiB for loads
            (the readers' shared pool, freed by :func:`nvdcp.release_resources`).
        gdeflate_algorithm_type: nvCOMP GDeflate algorithm type (0-5) for GPU compression; 0 is
            the entropy-only mode, which measured both the best ratio and the highest speed on
            sign+exponent planes (benchmarks/results/gpu_probe_*.json).
        decode_device: where to decompress items whose destination is host memory on a GPU
            machine: ``"auto"`` (the GPU, except records of at most 4 MiB stored with a CPU codec,
            zstd or none, which the CPU decodes faster in batches: see
            ``nvdcp.dcp.reader.HOST_DECODE_RECORD_BYTES``), ``"cuda"`` or ``"cpu"``.
    """

    gpu_memory_bytes: int | None = None
    pinned_memory_bytes: int | None = None
    gdeflate_algorithm_type: int = 0
    decode_device: str = "auto"

    def __post_init__(self) -> None:
        if self.gpu_memory_bytes is not None and self.gpu_memory_bytes < 16 * MiB:
            raise ValueError(f"gpu_memory_bytes must be at least 16 MiB, got {self.gpu_memory_bytes}")
        if self.pinned_memory_bytes is not None and self.pinned_memory_bytes < 8 * MiB:
            raise ValueError(f"pinned_memory_bytes must be at least 8 MiB, got {self.pinned_memory_bytes}")
        if not 0 <= self.gdeflate_algorithm_type <= 5:
            raise ValueError(f"gdeflate_algorithm_type must be 0-5, got {self.gdeflate_algorithm_type}")
        if self.decode_device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"decode_device must be 'auto', 'cuda' or 'cpu', got {self.decode_device!r}")

    def gpu_budget(self, device: torch.device, load: bool = False) -> int:
        """Scratch GPU memory of a save (``load=False``) or a load on ``device``."""
        if self.gpu_memory_bytes is not None:
            return self.gpu_memory_bytes
        free, _total = torch.cuda.mem_get_info(device)
        if load:
            return max(16 * MiB, min(LOAD_GPU_BYTES, free // 10))
        return max(16 * MiB, min(SAVE_GPU_BYTES, free // 20))

    def pinned_bytes(self, load: bool = False) -> int:
        """Pinned host memory of a save's encoders (``load=False``) or of the readers' pool."""
        if self.pinned_memory_bytes is not None:
            return self.pinned_memory_bytes
        return LOAD_PINNED_BYTES if load else SAVE_PINNED_BYTES

"""GPU tests (the ``gpu`` marker): skipped without CUDA and nvidia-nvcomp-cu12."""

from __future__ import annotations


def bound_with_room(codec: str, scratch: int, pinned_bytes: int, chunk_bytes: int = 64 << 10) -> int:
    """A ``GpuConfig(gpu_memory_bytes=...)`` leaving ``scratch`` bytes beside the workspace that
    nvCOMP's Zstd asks for when ``codec`` is ``"zstd"``: a user's bound holds both
    (nvdcp.gpu.bound), and the encoder sets aside what a call of its largest bucket, the
    ``pinned_bytes`` share of two buckets held at once, asks for."""
    if codec != "zstd":
        return scratch
    from nvdcp.gpu.nvcomp_batch import BatchedCodec

    n = max(16 * 16, pinned_bytes // 2 // chunk_bytes)  # GpuEncoder.max_slots_for(2)
    return scratch + BatchedCodec("zstd", None, chunk_bytes).compress_temp_bytes(n, n * chunk_bytes)

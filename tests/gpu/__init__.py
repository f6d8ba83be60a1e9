"""GPU tests (the ``gpu`` marker): skipped without CUDA and nvidia-nvcomp-cu12."""

from __future__ import annotations


def bound_with_room(codec: str, scratch: int, chunk_bytes: int = 64 << 10) -> int:
    """A ``GpuConfig(gpu_memory_bytes=...)`` leaving ``scratch`` bytes beside the workspace that
    nvCOMP's Zstd asks for (about 1.07 GiB) when ``codec`` is ``"zstd"``: a user's bound holds
    both (nvdcp.gpu.bound)."""
    if codec != "zstd":
        return scratch
    from nvdcp.gpu.nvcomp_batch import BatchedCodec

    n = 1 << 16  # more chunks than any bucket of these tests: the workspace never grows with fewer
    return scratch + BatchedCodec("zstd", None, chunk_bytes).compress_temp_bytes(n, n * chunk_bytes)

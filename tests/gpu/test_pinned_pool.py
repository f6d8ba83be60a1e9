"""PinnedPool: reuse, its limit on idle buffers, and trim returning pinned memory to the system
(torch's pinned allocator caches freed blocks, so dropping the tensors alone does not)."""

from __future__ import annotations

import pytest
import torch

from nvdcp.gpu.pinned import PinnedPool, return_cached_pinned_memory

MiB = 1 << 20


def test_a_released_buffer_serves_any_request_it_holds() -> None:
    pool = PinnedPool(limit=64 * MiB, pin=False)
    buf = pool.acquire(4 * MiB)
    assert buf.numel() == 4 * MiB and pool.allocated == 4 * MiB and pool.in_use == 4 * MiB
    pool.release(buf)
    again = pool.acquire(3 * MiB)
    assert again.data_ptr() == buf.data_ptr() and pool.allocated == 4 * MiB and pool.in_use == 4 * MiB


def test_idle_buffers_are_dropped_before_the_limit_is_passed() -> None:
    pool = PinnedPool(limit=100 * MiB, pin=False)
    pool.release(pool.acquire(40 * MiB))
    big = pool.acquire(70 * MiB)  # 40 + 70 > 100: the idle buffer goes first
    assert pool.allocated == 70 * MiB and pool.peak == 70 * MiB
    pool.release(big)


def test_buffers_in_use_are_never_dropped_and_trim_frees_the_rest() -> None:
    pool = PinnedPool(limit=8 * MiB, pin=False)
    held = pool.acquire(8 * MiB)
    other = pool.acquire(8 * MiB)  # over the limit with nothing idle: allocated anyway
    assert pool.allocated == 16 * MiB and held.data_ptr() != other.data_ptr()
    pool.release(other)
    pool.trim()
    assert pool.allocated == 8 * MiB and pool.in_use == 8 * MiB


def _pinned_footprint() -> int:
    """Bytes torch's pinned allocator holds, in use or cached (the key's name changed in 2.x)."""
    stats = torch.cuda.host_memory_stats()
    key = "reserved_bytes.current" if "reserved_bytes.current" in stats else "allocated_bytes.current"
    return int(stats[key])


@pytest.mark.gpu
def test_trim_returns_the_pinned_memory_to_the_system() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (pinned memory)")
    if getattr(torch._C, "_host_emptyCache", None) is None:
        pytest.skip("this torch cannot empty its pinned cache")
    torch.cuda.init()
    return_cached_pinned_memory()
    before = _pinned_footprint()
    pool = PinnedPool(limit=256 * MiB)
    for n in (40, 70, 20):
        pool.release(pool.acquire(n * MiB))
    assert _pinned_footprint() - before >= 64 * MiB, "the pool pinned its buffers"
    pool.trim()
    assert _pinned_footprint() == before, "trimmed buffers stayed pinned in torch's cache"

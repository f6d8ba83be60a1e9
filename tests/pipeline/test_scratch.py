"""The CPU path's pooled plane buffers (nvdcp.pipeline.scratch): reused only once nothing views
them, within the budget, and the records built on them stay intact."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from nvdcp.format.dtypes import dtype_code
from nvdcp.format.header import KIND_TENSOR
from nvdcp.pipeline import cpu
from nvdcp.pipeline.policy import choose_layout
from nvdcp.pipeline.scratch import PLANE_BUFFERS, HostBufferPool
from nvdcp.pipeline.tensors import tensor_to_host_bytes

MiB = 1 << 20


def _address(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def test_small_buffers_are_plain_allocations() -> None:
    pool = HostBufferPool(budget_bytes=64 * MiB, min_bytes=4 * MiB)
    a = pool.take(1 * MiB)
    assert a.nbytes == 1 * MiB and a.flags.writeable and pool.held_bytes == 0


def test_a_buffer_is_reused_once_it_and_every_view_are_gone() -> None:
    pool = HostBufferPool(budget_bytes=64 * MiB, min_bytes=4 * MiB)
    a = pool.take(8 * MiB)
    a[:] = 7
    where = _address(a)
    view = a[MiB:].reshape(7, MiB)  # as encode_item slices and reshapes it per group
    chunk = memoryview(view[3])  # as a record's chunk views a plane
    del a, view
    gc.collect()
    b = pool.take(8 * MiB)
    assert _address(b) != where  # the chunk still views the first buffer
    assert bytes(chunk[:4]) == b"\x07" * 4
    del b, chunk
    gc.collect()
    assert pool.idle_bytes == 2 * 8 * MiB
    c = pool.take(6 * MiB)  # fits an idle 8 MiB mapping (no more than twice its size)
    assert c.nbytes == 6 * MiB and pool.idle_bytes == 8 * MiB  # one of the two, reused


def test_the_budget_bounds_what_the_pool_maps() -> None:
    pool = HostBufferPool(budget_bytes=16 * MiB, min_bytes=4 * MiB)
    big = pool.take(32 * MiB)  # over the budget: a plain allocation
    assert big.nbytes == 32 * MiB and pool.held_bytes == 0
    a, b = pool.take(8 * MiB), pool.take(8 * MiB)
    assert pool.held_bytes == 16 * MiB
    c = pool.take(8 * MiB)  # the budget is in use by live buffers: a plain allocation
    assert c.nbytes == 8 * MiB and pool.held_bytes == 16 * MiB
    del a, b
    gc.collect()
    d = pool.take(12 * MiB)  # no idle one fits: idle ones are unmapped to make room
    assert d.nbytes == 12 * MiB and pool.held_bytes <= 16 * MiB


def test_clear_unmaps_idle_buffers_and_keeps_live_ones() -> None:
    pool = HostBufferPool(budget_bytes=64 * MiB, min_bytes=4 * MiB)
    live, idle = pool.take(8 * MiB), pool.take(8 * MiB)
    del idle
    gc.collect()
    pool.clear()
    assert pool.held_bytes == 8 * MiB and pool.idle_bytes == 0
    live[:] = 1  # still mapped
    del live
    gc.collect()
    assert pool.idle_bytes == 8 * MiB


def test_records_on_pooled_buffers_stay_intact_while_later_items_reuse_them() -> None:
    """Two large items encoded one after the other, the first record still held: its raw plane
    chunks view its plane buffer, which must not be handed to the second item; once dropped, a
    third item reuses it. Records are the same bytes as with plain buffers."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(2 * MiB, generator=g) for _ in range(3)]  # 8 MiB each: pooled

    def encode(t: torch.Tensor) -> cpu.EncodedItem:
        return cpu.encode_item(tensor_to_host_bytes(t), kind=KIND_TENSOR, dtype_code=dtype_code(t.dtype),
                               shape=tuple(t.shape), element_size=4, layout=choose_layout(t.dtype, "zstd"), pool=None)

    def payload(e: cpu.EncodedItem) -> bytes:
        return e.header_bytes + b"".join(bytes(c) for c in e.chunks)

    gc.collect()
    first = encode(tensors[0])
    want = payload(first)
    second = encode(tensors[1])
    assert payload(first) == want  # the second item did not write into the first's buffer
    with pytest.MonkeyPatch.context() as mp:  # the same records with plain buffers
        mp.setattr(PLANE_BUFFERS, "min_bytes", 1 << 62)
        assert payload(encode(tensors[0])) == want
        assert payload(encode(tensors[1])) == payload(second)
    idle = PLANE_BUFFERS.idle_bytes
    del first
    gc.collect()
    assert PLANE_BUFFERS.idle_bytes >= idle + 8 * MiB  # given back once the record is gone
    third = encode(tensors[2])
    _, decoded = cpu.decode_item(memoryview(payload(third)), "x", None, 4)
    assert np.array_equal(decoded, tensor_to_host_bytes(tensors[2]))

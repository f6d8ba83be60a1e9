"""Byte planes to and from elements for many blocks at once, in one kernel launch per plane count.

A pass of :class:`~nvdcp.gpu.decoder.GpuDecoder` holds the decoded chunks (slots) of many items'
blocks. Merging them item by item costs a few torch calls and kernel launches per item, which for
thousands of small tensors is most of a load (and, called from several threads, waits on the
GIL). Here one Triton kernel merges every block of the pass: a table row per block gives the
destination address of the block's first element byte, its element count and the address of each
plane's slot; element ``j`` of the block gets byte ``k`` from plane ``k``'s slot at ``j``.
Without byte planes (one plane) the same kernel is a batched copy.

The encoder needs the inverse for a bucket's small tensors (:meth:`GpuEncoder._split_planes
<nvdcp.gpu.encoder.GpuEncoder._split_planes>`): the same kernel with ``SPLIT`` set reads the
block's elements at the row's first address and writes byte ``k`` of element ``j`` to plane
``k``'s slot at ``j``. It reads each tensor by address, so the encoder's jobs need no flat byte
view per tensor (two torch calls per item on the main thread) and no concatenation, transposed
copy and index upload per group of tensors of one shape. (In the twelfth session the split alone,
with the per-item views still made, measured no end-to-end gain and was taken out; it came back
in the twenty-first with the views gone, docs/BENCHMARKS.md.)

Addresses are absolute (``data_ptr()``): sources and destinations are separate tensors, so no
single base pointer covers them; Triton loads them as int64 and casts them to pointers (the
pattern of Triton's grouped GEMM tutorial). ``TRITON_INTERPRET=1`` runs the kernel on CPU
tensors (tests).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import torch

#: Plane counts the kernel handles (element sizes: 1, 2, 4, 8, 16 bytes).
PLANE_COUNTS = (1, 2, 4, 8, 16)
#: Bytes one program writes (per block: ``TILE_BYTES // planes`` elements of ``planes`` bytes).
TILE_BYTES = 4096


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def planes_kernel(table_ptr, P: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr):
        row = tl.program_id(0)
        base = table_ptr + row * (2 + P)
        n = tl.load(base + 1)
        j = tl.program_id(1) * TILE + tl.arange(0, TILE)
        elements = tl.load(base).to(tl.pointer_type(tl.uint8))
        k = tl.arange(0, P)
        planes = tl.load(base + 2 + k).to(tl.pointer_type(tl.uint8))
        mask = (j < n)[:, None]
        if SPLIT:
            vals = tl.load(elements + j[:, None] * P + k[None, :], mask=mask, other=0)
            tl.store(planes[None, :] + j[:, None], vals, mask=mask)
        else:
            vals = tl.load(planes[None, :] + j[:, None], mask=mask, other=0)
            tl.store(elements + j[:, None] * P + k[None, :], vals, mask=mask)

    return planes_kernel


def _triton_runs_here(switch: str) -> bool:
    """Triton importable, a CUDA device (or ``TRITON_INTERPRET=1``), and ``switch`` not ``0``."""
    if os.environ.get(switch, "1") == "0":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def merge_available() -> bool:
    """Whether the merge runs here (Triton importable; a CUDA device, or ``TRITON_INTERPRET=1``).
    ``NVDCP_GPU_MERGE=0`` turns it off (the decoder then merges item by item with torch)."""
    return _triton_runs_here("NVDCP_GPU_MERGE")


@functools.cache
def split_available() -> bool:
    """Whether the split runs here (as :func:`merge_available`). ``NVDCP_GPU_SPLIT=0`` turns it
    off (the encoder then splits small tensors with torch copies, group by group)."""
    return _triton_runs_here("NVDCP_GPU_SPLIT")


def _launch(table: torch.Tensor, planes: int, max_elements: int, split: bool) -> None:
    if planes not in PLANE_COUNTS:
        raise ValueError(f"{planes} byte planes: the plane kernel takes {PLANE_COUNTS}")
    rows = table.shape[0]
    if rows == 0 or max_elements <= 0:
        return
    tile = TILE_BYTES // planes
    _kernel()[(rows, -(-max_elements // tile))](table, P=planes, TILE=tile, SPLIT=split, num_warps=4)


def merge_rows(table: torch.Tensor, planes: int, max_elements: int) -> None:
    """Run the merge over ``table`` (an int64 tensor of ``rows x (2 + planes)``: destination
    address, element count, then one source address per plane) on the current stream.
    ``max_elements``: the largest element count of any row (the grid's second dimension)."""
    _launch(table, planes, max_elements, split=False)


def split_rows(table: torch.Tensor, planes: int, max_elements: int) -> None:
    """Run the split over ``table`` (an int64 tensor of ``rows x (2 + planes)``: source address
    of the block's elements, element count, then one destination address per plane) on the
    current stream. ``max_elements``: as :func:`merge_rows`."""
    _launch(table, planes, max_elements, split=True)


def merge_table(dst: np.ndarray, counts: np.ndarray, srcs: np.ndarray) -> np.ndarray:
    """The kernel's table from element addresses, element counts and ``rows x planes`` plane
    addresses (all int64); the same layout serves both directions."""
    table = np.empty((len(dst), 2 + srcs.shape[1]), dtype=np.int64)
    table[:, 0] = dst
    table[:, 1] = counts
    table[:, 2:] = srcs
    return table

"""Byte planes back into elements for a whole decode pass, in one kernel launch per plane count.

A pass of :class:`~nvdcp.gpu.decoder.GpuDecoder` holds the decoded chunks (slots) of many items'
blocks. Merging them item by item costs a few torch calls and kernel launches per item, which for
thousands of small tensors is most of a load (and, called from several threads, waits on the
GIL). Here one Triton kernel merges every block of the pass: a table row per block gives the
destination address of the block's first element byte, its element count and the address of each
plane's slot; element ``j`` of the block gets byte ``k`` from plane ``k``'s slot at ``j``.
Without byte planes (one plane) the same kernel is a batched copy.

Addresses are absolute (``data_ptr()``): destinations are separate tensors, so no single base
pointer covers them; Triton loads them as int64 and casts them to pointers (the pattern of
Triton's grouped GEMM tutorial). ``TRITON_INTERPRET=1`` runs the kernel on CPU tensors (tests).
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
    def merge_planes_kernel(table_ptr, P: tl.constexpr, TILE: tl.constexpr):
        row = tl.program_id(0)
        base = table_ptr + row * (2 + P)
        n = tl.load(base + 1)
        j = tl.program_id(1) * TILE + tl.arange(0, TILE)
        dst = tl.load(base).to(tl.pointer_type(tl.uint8))
        k = tl.arange(0, P)
        src = tl.load(base + 2 + k).to(tl.pointer_type(tl.uint8))
        mask = (j < n)[:, None]
        vals = tl.load(src[None, :] + j[:, None], mask=mask, other=0)
        tl.store(dst + j[:, None] * P + k[None, :], vals, mask=mask)

    return merge_planes_kernel


@functools.cache
def merge_available() -> bool:
    """Whether the kernel runs here (Triton importable; a CUDA device, or ``TRITON_INTERPRET=1``).
    ``NVDCP_GPU_MERGE=0`` turns it off (the decoder then merges item by item with torch)."""
    if os.environ.get("NVDCP_GPU_MERGE", "1") == "0":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def merge_rows(table: torch.Tensor, planes: int, max_elements: int) -> None:
    """Run the merge over ``table`` (an int64 tensor of ``rows x (2 + planes)``: destination
    address, element count, then one source address per plane) on the current stream.
    ``max_elements``: the largest element count of any row (the grid's second dimension)."""
    if planes not in PLANE_COUNTS:
        raise ValueError(f"{planes} byte planes: the merge kernel takes {PLANE_COUNTS}")
    rows = table.shape[0]
    if rows == 0 or max_elements <= 0:
        return
    tile = TILE_BYTES // planes
    _kernel()[(rows, -(-max_elements // tile))](table, P=planes, TILE=tile, num_warps=4)


def merge_table(dst: np.ndarray, counts: np.ndarray, srcs: np.ndarray) -> np.ndarray:
    """The kernel's table from destination addresses, element counts and ``rows x planes``
    source addresses (all int64)."""
    table = np.empty((len(dst), 2 + srcs.shape[1]), dtype=np.int64)
    table[:, 0] = dst
    table[:, 1] = counts
    table[:, 2:] = srcs
    return table

"""A delta chain's levels folded together on the GPU for many items at once, in a few kernel launches.

A GPU delta load decodes every level of a batch's chains (the checkpoint's delta records, then
each base's records) into device memory, then folds them item by item: the top level's zigzag
delta turned into a plain difference, each lower level's added (or XORed) to it, down to the
bytes saved whole (:func:`~nvdcp.transform.delta.accumulate_torch`). In torch that is six to
eight elementwise kernels and four temporaries per item and level, launched from the thread
that commits the results: on the H100, loading 160 bf16 tensors of 4 MiB one delta deep, a
third of that thread's samples and 1,432 GPU operations against a full load's 60. The kernel
below took 0-7% off such loads, and the reference model's bf16 depth-1 loads went from 1.54x a
full load's time to 1.27-1.41x (docs/BENCHMARKS.md, twenty-seventh session); the rest of a
level's cost is its reads and host work, as for a full load.

Here one Triton kernel folds one level into the accumulated bytes for every item of a batch: a
table row per item gives the accumulated bytes' address (written in place), the element count,
the level's address and flags saying whether each side is still zigzag-coded and whether the
item's kind is XOR. Rows are grouped by element width (XOR rows as bytes) and by size class
(tile counts within a factor of two), so a launch's grid wastes at most half its programs.
Addresses are absolute, as in :mod:`nvdcp.gpu.merge`. ``TRITON_INTERPRET=1`` runs the kernel
on CPU tensors (tests).
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nvdcp.gpu.merge import _triton_runs_here
from nvdcp.transform.delta import XOR, ZIGZAG_DIFF, accumulate_torch, to_difference_torch

#: Row flags: the accumulated bytes are still a zigzag delta (the first fold of a chain's top
#: level), the level is a zigzag delta, the item's kind is XOR (both sides XORed, as bytes).
ACC_ZIGZAG, LEVEL_ZIGZAG, XOR_KIND = 1, 2, 4
#: Elements one program folds.
TILE = 2048
#: Rows per launch: the grid's second axis holds at most 65,535 blocks.
MAX_ROWS_PER_LAUNCH = 65535
#: Element widths with an integer type; XOR rows are folded as bytes whatever their width.
WIDTHS = (1, 2, 4, 8)


@functools.cache
def fold_available() -> bool:
    """Whether the fold kernel runs here (Triton importable; a CUDA device, or
    ``TRITON_INTERPRET=1``). ``NVDCP_GPU_FOLD=0`` turns it off (the reader then folds item by
    item with torch)."""
    return _triton_runs_here("NVDCP_GPU_FOLD")


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def fold_kernel(table_ptr, DT: tl.constexpr, HALF: tl.constexpr, TILE: tl.constexpr):
        row = table_ptr + tl.program_id(1) * 4
        n = tl.load(row + 1)
        j = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
        mask = j < n
        acc_ptr = tl.load(row).to(tl.pointer_type(DT))
        level_ptr = tl.load(row + 2).to(tl.pointer_type(DT))
        flags = tl.load(row + 3)
        acc = tl.load(acc_ptr + j, mask=mask, other=0)
        level = tl.load(level_ptr + j, mask=mask, other=0)
        if (flags & 4) != 0:
            out = (acc ^ level).to(DT)
        else:
            # zigzag decoding, (z >>> 1) ^ -(z & 1): the arithmetic shift's copied sign bit
            # masked off (no bitwise not or unsigned type: Triton's interpreter makes their
            # all-ones constants with numpy, which refuses -1 as an unsigned value); .to(DT)
            # keeps the type if a constant promoted it (the low bits are the same either way)
            if (flags & 1) != 0:
                acc = (((acc >> 1) & HALF) ^ (0 - (acc & 1))).to(DT)
            if (flags & 2) != 0:
                level = (((level >> 1) & HALF) ^ (0 - (level & 1))).to(DT)
            out = (acc + level).to(DT)  # wraps modulo 2^width, as the encoder's difference did
        tl.store(acc_ptr + j, out, mask=mask)

    return fold_kernel


@functools.cache
def _int_type(width: int) -> Any:
    import triton.language as tl

    return {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}[width]


@dataclass
class FoldPlan:
    """The rows of one fold pass (one chain level into the bytes accumulated above it), for
    :func:`run_fold`. Tensors are kept referenced until the launch."""

    rows: dict[tuple[int, int], list[tuple[int, int, int, int]]] = field(default_factory=lambda: defaultdict(list))
    keep: list[torch.Tensor] = field(default_factory=list)

    def add(self, acc: torch.Tensor, level: torch.Tensor, kind: int, element_size: int, acc_zigzag: bool,
            level_zigzag: bool) -> bool:
        """Queue ``acc`` (uint8, contiguous, written in place) folded with ``level`` (uint8, the
        same size): XORed for ``XOR`` items; for ``ZIGZAG_DIFF`` items added as integers of
        ``element_size`` bytes, each side first zigzag-decoded when its flag says so. Returns
        False (nothing queued) when the pair does not fit the kernel (not contiguous, a size
        not whole elements, an address not aligned to the element width): fold it with torch."""
        if kind not in (XOR, ZIGZAG_DIFF) or acc.numel() != level.numel():
            return False
        width = 1 if kind == XOR else element_size
        if width not in WIDTHS or not (acc.is_contiguous() and level.is_contiguous()) or acc.numel() % width:
            return False
        acc_at, level_at = acc.data_ptr(), level.data_ptr()
        if acc_at % width or level_at % width:
            return False
        n = acc.numel() // width
        if n:
            flags = XOR_KIND if kind == XOR else (ACC_ZIGZAG if acc_zigzag else 0) | (LEVEL_ZIGZAG if level_zigzag else 0)
            size_class = max(0, (-(-n // TILE) - 1).bit_length())
            self.rows[(width, size_class)].append((acc_at, n, level_at, flags))
            self.keep += (acc, level)
        return True


def run_fold(plans: list[FoldPlan], device: torch.device) -> None:
    """Run ``plans`` in order on ``device``'s current stream (a later plan may fold into the
    bytes an earlier one wrote): one table upload for all of them, one launch per element width
    and size class of each plan."""
    groups = [(key, rows) for plan in plans for key, rows in plan.rows.items()]
    if not groups:
        return
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _launch(groups, device)


def _launch(groups: list[tuple[tuple[int, int], list[tuple[int, int, int, int]]]], device: torch.device) -> None:
    table = torch.from_numpy(np.array([row for _, rows in groups for row in rows], dtype=np.int64))
    table = table.to(device)
    kernel = _kernel()
    at = 0
    for (width, size_class), rows in groups:
        dt, half = _int_type(width), (1 << (8 * width - 1)) - 1
        for first in range(0, len(rows), MAX_ROWS_PER_LAUNCH):
            count = min(MAX_ROWS_PER_LAUNCH, len(rows) - first)
            part = table[at + first : at + first + count]
            # tiles on the grid's first axis (up to 2^31 - 1), rows on the second (up to 65,535)
            kernel[(1 << size_class, count)](part, DT=dt, HALF=half, TILE=TILE, num_warps=4)
        at += len(rows)


class ChainFolder:
    """Folds a batch's chain levels top-down into the top level's decoded bytes: :meth:`top` for
    each item's top level, then :meth:`fold` for each lower level, :meth:`end_level` after each
    level, :meth:`finish` at the end. With ``kernel`` (:func:`fold_available`) the folds are
    queued and run a level at a time by :func:`run_fold`; items the kernel does not fit (and
    every item without ``kernel``) are folded with torch at once, after the queued folds (all
    on the current stream, in order). The result is what
    :func:`~nvdcp.transform.delta.to_difference_torch` then
    :func:`~nvdcp.transform.delta.accumulate_torch` per level give."""

    def __init__(self, kernel: bool) -> None:
        self._kernel = kernel
        self._plans = [FoldPlan()]
        self._device: torch.device | None = None
        #: tops still zigzag-coded (their first fold decodes them), by id: (tensor, kind, width)
        self._zigzag: dict[int, tuple[torch.Tensor, int, int]] = {}

    def top(self, raw: torch.Tensor, is_delta: bool, kind: int, element_size: int) -> None:
        """Take an item's top level (``raw``: its decoded bytes, the accumulator from here on)."""
        if not is_delta or kind != ZIGZAG_DIFF or not raw.numel():
            return
        if self._kernel:
            self._zigzag[id(raw)] = (raw, kind, element_size)
        else:
            to_difference_torch(raw, kind, element_size)

    def fold(self, acc: torch.Tensor, level: torch.Tensor, kind: int, element_size: int, level_is_delta: bool) -> None:
        """Fold the next level's decoded bytes ``level`` into ``acc`` (a top given to :meth:`top`)."""
        acc_zigzag = self._zigzag.pop(id(acc), None) is not None
        if not acc.numel():
            return
        self._device = acc.device
        level_zigzag = level_is_delta and kind == ZIGZAG_DIFF
        if self._kernel and self._plans[-1].add(acc, level, kind, element_size, acc_zigzag, level_zigzag):
            return
        self._flush()
        if acc_zigzag:
            to_difference_torch(acc, kind, element_size)
        accumulate_torch(acc, level, kind, element_size, level_is_delta)

    def end_level(self) -> None:
        """The current level is complete: the next folds go into a later launch."""
        if self._plans[-1].rows:
            self._plans.append(FoldPlan())

    def finish(self) -> None:
        """Run what is queued; a top that was never folded is left a plain difference."""
        self._flush()
        for raw, kind, element_size in self._zigzag.values():
            to_difference_torch(raw, kind, element_size)
        self._zigzag.clear()

    def _flush(self) -> None:
        if self._device is not None and any(plan.rows for plan in self._plans):
            run_fold(self._plans, self._device)
        self._plans = [FoldPlan()]


__all__ = ["ACC_ZIGZAG", "ChainFolder", "LEVEL_ZIGZAG", "TILE", "XOR_KIND", "FoldPlan", "fold_available", "run_fold"]

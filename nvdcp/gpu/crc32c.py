"""CRC32C (Castagnoli) of many byte ranges of one device buffer, computed on the GPU (Triton).

The same values as :func:`nvdcp.format.crc.checksum_ranges` and the ``crc32c`` package, for every
length (0 included). The host never walks the bytes: the writer checksums stored chunks on the
device before they are copied out, the reader checks them after they are copied in.

How (CRC is linear over GF(2)). Let ``F(s, M)`` be the CRC register after feeding message ``M``
into register ``s`` (no final xor). Then ``F(s, A || B) = shift_|B|(F(s, A)) ^ F(0, B)`` where
``shift_k`` (feeding ``k`` zero bytes) is a linear map, and ``F(0, .)`` of a tile of ``TILE``
bytes is the XOR of one 32-bit constant per set bit, the constant depending only on the bit's
position in the tile (the *position table*, ``8 x TILE`` words). One program per range:

1. the range is cut into tiles from its start; the last tile is zero-padded to ``TILE`` bytes;
2. the standard initial register ``~0`` is folded into the message: ``F(~0, X) = F(0, X ^ FF FF FF FF 00 ...)``
   for ``|X| >= 4`` (the padded message always has ``TILE >= 4`` bytes);
3. tiles are combined by Horner's rule, ``acc = shift_TILE(acc) ^ F(0, tile)`` (one 32x32 GF(2)
   matrix, applied as the XOR of its columns selected by ``acc``'s bits);
4. the ``pad`` trailing zero bytes are removed by ``shift_{-pad}`` (``shift_1`` is invertible:
   the top byte of the CRC table is a permutation), a table of ``TILE`` matrices;
5. the final xor ``~``; the empty range is 0.

:func:`reference_ranges` runs the same steps in numpy (the tables' and the algorithm's CPU test);
:func:`checksum_ranges_device` launches the kernel. Triton is imported on first use only: the
package works without it, and :func:`device_crc_available` says whether the kernel can run here.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

#: Reflected CRC32C polynomial.
POLY = 0x82F63B78
#: Bytes per tile (one position table of 8 x TILE words); tuned on the H200 by benchmarks/gpu_pipeline_bench.py.
TILE = 256
NUM_WARPS = 2

MASK32 = 0xFFFFFFFF


@functools.cache
def byte_table() -> np.ndarray:
    """The classic 256-entry reflected CRC32C table (uint32)."""
    t = np.arange(256, dtype=np.uint64)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ POLY, t >> 1)
    return t.astype(np.uint32)


def _shift1(c: np.ndarray) -> np.ndarray:
    """Feed one zero byte into registers ``c`` (uint32 array)."""
    t = byte_table()
    return t[c & 0xFF] ^ (c >> np.uint32(8))


@functools.cache
def _inverse_top() -> np.ndarray:
    """``b`` for each top byte of ``table[b]`` (a permutation, which makes ``shift_1`` invertible)."""
    top = byte_table() >> np.uint32(24)
    inv = np.empty(256, dtype=np.uint32)
    inv[top] = np.arange(256, dtype=np.uint32)
    assert len(np.unique(top)) == 256
    return inv


def _unshift1(d: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_shift1`: the register that one zero byte turns into ``d``."""
    b = _inverse_top()[d >> np.uint32(24)]
    return ((d ^ byte_table()[b]) << np.uint32(8)) | b


def _columns(apply: Any, steps: int) -> np.ndarray:
    """The 32 columns (images of the unit vectors) of ``apply`` iterated ``steps`` times."""
    cols = (np.uint32(1) << np.arange(32, dtype=np.uint32)).astype(np.uint32)
    for _ in range(steps):
        cols = apply(cols)
    return cols


@functools.cache
def tables(tile: int = TILE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(position, shift, unshift)`` for tiles of ``tile`` bytes, all uint32:

    - ``position[i, j]``: ``F(0, tile)`` of a tile whose only set bit is bit ``i`` of byte ``j``;
    - ``shift[k]``: column ``k`` of ``shift_tile`` (feeding ``tile`` zero bytes);
    - ``unshift[p, k]``: column ``k`` of ``shift_{-p}`` for ``p`` in ``0..tile-1``.
    """
    if tile < 4 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 4, got {tile}")
    position = np.empty((8, tile), dtype=np.uint32)
    # the last byte of the tile: one table step; each earlier byte: one more zero byte after it
    col = byte_table()[(np.uint32(1) << np.arange(8, dtype=np.uint32))]
    for j in range(tile - 1, -1, -1):
        position[:, j] = col
        col = _shift1(col)
    shift = _columns(_shift1, tile)
    unshift = np.empty((tile, 32), dtype=np.uint32)
    cols = _columns(_shift1, 0)
    for p in range(tile):
        unshift[p] = cols
        cols = _unshift1(cols)
    return position, shift, unshift


def _apply(cols: np.ndarray, v: int) -> int:
    """The matrix with columns ``cols`` times the vector ``v``."""
    out = 0
    for k in range(32):
        if v >> k & 1:
            out ^= int(cols[k])
    return out


def reference_ranges(buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, tile: int = TILE) -> np.ndarray:
    """The kernel's algorithm in numpy (slow; for tests of the tables and the combine math)."""
    position, shift, unshift = tables(tile)
    out = np.empty(len(offsets), dtype=np.uint32)
    for r, (off, n) in enumerate(zip(np.asarray(offsets).tolist(), np.asarray(lengths).tolist())):
        tiles = -(-n // tile)
        acc = 0
        for t in range(tiles):
            x = np.zeros(tile, dtype=np.uint32)
            m = min(tile, n - t * tile)
            x[:m] = buf[off + t * tile : off + t * tile + m]
            if t == 0:
                x[:4] ^= 0xFF
            bits = (x[None, :] >> np.arange(8, dtype=np.uint32)[:, None]) & np.uint32(1)
            f = int(np.bitwise_xor.reduce((bits * position).ravel()))
            acc = _apply(shift, acc) ^ f
        raw = _apply(unshift[tiles * tile - n], acc)
        out[r] = 0 if n == 0 else raw ^ MASK32
    return out


# -- the device kernel --------------------------------------------------------------------------
@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def crc32c_ranges_kernel(buf_ptr, off_ptr, len_ptr, expect_ptr, out_ptr, bad_ptr,
                             pos_ptr, shift_ptr, unshift_ptr,
                             TILE: tl.constexpr, CHECK: tl.constexpr, UNIFORM: tl.constexpr,
                             MAX_TILES: tl.constexpr):
        pid = tl.program_id(0)
        off = tl.load(off_ptr + pid)
        n = tl.load(len_ptr + pid)
        cols = tl.arange(0, TILE)
        bit = tl.arange(0, 8)
        k32 = tl.arange(0, 32)
        position = tl.load(pos_ptr + bit[:, None] * TILE + cols[None, :]).to(tl.uint32, bitcast=True)
        shift = tl.load(shift_ptr + k32).to(tl.uint32, bitcast=True)
        ntiles = (n + TILE - 1) // TILE
        acc = tl.zeros((), dtype=tl.uint32)
        # UNIFORM (Triton's interpreter, whose loops cannot take a loaded bound): every program
        # runs MAX_TILES steps and keeps those below its own count
        for t in range(0, MAX_TILES if UNIFORM else ntiles):  # a constexpr choice: resolved at compile time
            pos = t * TILE + cols
            x = tl.load(buf_ptr + off + pos, mask=pos < n, other=0).to(tl.uint32)
            x = tl.where(pos < 4, x ^ 0xFF, x)
            sel = (x[None, :] >> bit[:, None].to(tl.uint32)) & 1
            f = tl.xor_sum(tl.reshape(sel * position, (8 * TILE,)), axis=0)
            a = (acc >> k32.to(tl.uint32)) & 1
            nxt = tl.xor_sum(a * shift, axis=0) ^ f
            if UNIFORM:
                acc = tl.where(t < ntiles, nxt, acc)
            else:
                acc = nxt
        pad = ntiles * TILE - n
        unshift = tl.load(unshift_ptr + pad * 32 + k32).to(tl.uint32, bitcast=True)
        a = (acc >> k32.to(tl.uint32)) & 1
        crc_i = tl.xor_sum(a * unshift, axis=0).to(tl.int32, bitcast=True) ^ -1  # the final xor
        crc_i = tl.where(n == 0, 0, crc_i)
        tl.store(out_ptr + pid, crc_i)
        if CHECK:
            want = tl.load(expect_ptr + pid)
            # how many chunks fail, and the first failing range (atomic min over the programs)
            tl.atomic_add(bad_ptr, (want != crc_i).to(tl.int32))
            tl.atomic_min(bad_ptr + 1, tl.where(want != crc_i, pid, 2147483647))

    return crc32c_ranges_kernel


@functools.cache
def _device_tables(device: torch.device, tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    position, shift, unshift = tables(tile)
    return tuple(torch.from_numpy(a.view(np.int32).copy()).to(device) for a in (position, shift, unshift))  # type: ignore[return-value]


@functools.cache
def device_crc_available() -> bool:
    """Whether the Triton kernel can run here (Triton importable and a CUDA device present;
    ``TRITON_INTERPRET=1`` runs it on CPU tensors, for tests). ``NVDCP_DEVICE_CRC=0`` turns it off."""
    if os.environ.get("NVDCP_DEVICE_CRC", "1") == "0":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        logger.debug("triton is not installed: chunk checksums are computed on the host")
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _ranges(t: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(t, dtype=np.int64))
    return t.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()


def checksum_ranges_device(buf: torch.Tensor, offsets: torch.Tensor | np.ndarray, lengths: torch.Tensor | np.ndarray,
                           expected: torch.Tensor | None = None, *, tile: int = TILE,
                           num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """CRC32C of ``buf[offsets[i] : offsets[i] + lengths[i]]`` for every ``i``, on ``buf``'s device.

    ``buf`` is a contiguous 1-D uint8 tensor; ranges are not checked against it (the callers
    build them). Runs on the current CUDA stream, without synchronizing. Returns ``(crcs, bad)``:
    ``crcs`` an int32 tensor (the uint32 values' bits); with ``expected`` (int32, one per range),
    ``bad`` is a 2-element int32 tensor: how many ranges differ from it, and the first such range
    (``2**31 - 1`` when none); else None.
    """
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError("buf must be a contiguous 1-D uint8 tensor")
    device = buf.device
    off = _ranges(offsets, device)
    lens = _ranges(lengths, device)
    if off.shape != lens.shape or off.dim() != 1:
        raise ValueError("offsets and lengths must be 1-D and of one length")
    n = off.numel()
    out = torch.empty(n, dtype=torch.int32, device=device)
    bad = None
    if expected is not None:
        expected = expected.to(device=device, dtype=torch.int32, non_blocking=True)
        bad = torch.tensor([0, 2**31 - 1], dtype=torch.int32).to(device, non_blocking=True)
    if n == 0:
        return out, bad
    position, shift, unshift = _device_tables(device, tile)
    if buf.numel() == 0:
        buf = torch.zeros(1, dtype=torch.uint8, device=device)  # every range is empty: nothing is read
    uniform = os.environ.get("TRITON_INTERPRET") == "1"
    max_tiles = -(-int(lens.max()) // tile) if uniform else 0
    _kernel()[(n,)](buf, off, lens, expected if expected is not None else out, out,
                    bad if bad is not None else out, position, shift, unshift,
                    TILE=tile, CHECK=expected is not None, UNIFORM=uniform, MAX_TILES=max_tiles,
                    num_warps=num_warps)
    return out, bad


def as_uint32(crcs: torch.Tensor) -> np.ndarray:
    """Device CRCs (int32 bits) as a host uint32 array (synchronizes with their stream)."""
    return crcs.cpu().numpy().view(np.uint32)

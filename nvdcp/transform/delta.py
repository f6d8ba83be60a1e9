"""Delta transforms: an item's bytes against its base item's, before byte planes (docs/FORMAT.md).

Two kinds, recorded per item record:

- ``XOR`` (0): byte-wise XOR. Bytes that did not change become zero.
- ``ZIGZAG_DIFF`` (1): each element's bit pattern read as a signed integer of the element's
  width, the base's subtracted (modulo 2^width), then zigzag-coded (``(d << 1) ^ (d >> (w-1))``)
  so small differences of either sign have zero high bytes. For a float whose value moved a
  little, the bit patterns differ by a small integer even where a carry flips a run of bits (XOR
  keeps the whole run): on the CPU reference model, 10 steps apart, the byte planes coded 1.73x
  instead of 1.66x (fp32 weights), 5.40x instead of 4.75x (bf16 weights), 1.61x instead of 1.54x
  (fp32 ``exp_avg_sq``). Used for 2-, 4- and 8-byte real floats; everything else uses XOR.

Both are exact inverses modulo 2^width, so any bit pattern (NaN payloads, -0.0, infinities)
round-trips. The numpy functions run on the CPU path, the torch ones on the GPU path; they
produce the same bytes.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch

from nvdcp._native import load_function

XOR = 0
ZIGZAG_DIFF = 1
KINDS = (XOR, ZIGZAG_DIFF)

_NP_INT = {2: np.int16, 4: np.int32, 8: np.int64}
_NP_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def kind_for(dtype: torch.dtype) -> int:
    """The delta kind nvdcp writes for items of ``dtype``."""
    if dtype.is_floating_point and dtype.itemsize in _NP_INT:
        return ZIGZAG_DIFF
    return XOR


# -- numpy (the CPU path) -------------------------------------------------------------------------
#: Elements per pass of the numpy versions: a few passes over a slice that stays in cache cost
#: far less than the same passes over a whole item (16 MiB fp32: 5.7 ms instead of 14 ms here).
_STEP = 1 << 15


_FORMAT_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "format")


@functools.cache
def _native(symbol: str) -> Callable[..., int] | None:
    """``nvdcp_delta_encode`` / ``nvdcp_delta_apply`` of the native library (one pass over the
    bytes instead of numpy's four to six; the same bytes), None when it is not built."""
    fn = load_function(_FORMAT_DIR, "_crc32c_batch", symbol)
    if fn is None:
        return None
    extra = [ctypes.c_void_p] if symbol == "nvdcp_delta_encode" else []
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, *extra]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def _native_width(kind: int, element_size: int) -> int:
    """The element width the native functions work in: whole elements for ``ZIGZAG_DIFF``,
    bytes for ``XOR``."""
    return element_size if kind == ZIGZAG_DIFF else 1


def _native_fits(*arrays: np.ndarray, element_size: int) -> bool:
    return all(a.flags.c_contiguous for a in arrays) and not arrays[0].size % element_size


def delta_np(raw: np.ndarray, base: np.ndarray, kind: int, element_size: int) -> tuple[np.ndarray, bool]:
    """The delta of ``raw`` against ``base`` (flat uint8 arrays of one size), a new uint8 array,
    and whether any byte of it is nonzero (False: ``raw`` equals ``base``)."""
    fn = _native("nvdcp_delta_encode")
    if fn is None or not _native_fits(raw, base, element_size=element_size):
        out = encode_numpy(raw, base, kind, element_size)
        return out, bool(out.any())
    out = np.empty(raw.size, dtype=np.uint8)
    width = _native_width(kind, element_size)
    changed = fn(raw.ctypes.data, base.ctypes.data, raw.size // width, width, kind, out.ctypes.data)
    assert changed >= 0, (kind, element_size)
    return out, bool(changed)


@functools.cache
def _native_split() -> Callable[..., int] | None:
    """``nvdcp_delta_split_many`` of the native library, None when it is not built."""
    fn = load_function(_FORMAT_DIR, "_crc32c_batch", "nvdcp_delta_split_many")
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def delta_split(raws: Sequence[np.ndarray], bases: Sequence[np.ndarray], keeps: Sequence[np.ndarray | None],
                kind: int, element_size: int, planes: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The deltas of ``raws`` against ``bases`` (flat uint8 arrays, pairwise of one size), split
    into ``planes`` (``(n_planes, n)`` uint8; ``n_planes`` 1 or ``element_size``): array ``i``'s
    delta at ``planes[p, offsets[i] : offsets[i] + raws[i].size // n_planes]``, as
    :func:`encode_np` then a byte-plane split make it. Each raw array is also copied to
    ``keeps[i]`` (None: not kept), which may be its own base's memory (each base byte is read
    before it is overwritten) but no other array's. One native pass over each array where the
    library is built (no difference in fresh memory, no second pass to keep it). Returns which
    deltas are not all zero (bool per array)."""
    n_planes = planes.shape[0]
    fn = _native_split()
    if fn is None or not all(_native_fits(r, b, element_size=element_size) for r, b in zip(raws, bases)):
        return _delta_split_numpy(raws, bases, keeps, kind, element_size, planes, offsets)
    count = len(raws)
    srcs = np.fromiter((r.ctypes.data for r in raws), dtype=np.int64, count=count)
    base_at = np.fromiter((b.ctypes.data for b in bases), dtype=np.int64, count=count)
    keep_at = np.fromiter((0 if k is None else k.ctypes.data for k in keeps), dtype=np.int64, count=count)
    ns = np.fromiter((r.size // n_planes for r in raws), dtype=np.int64, count=count)
    at = np.ascontiguousarray(offsets, dtype=np.int64)
    changed = np.zeros(count, dtype=np.uint8)
    done = fn(srcs.ctypes.data, base_at.ctypes.data, keep_at.ctypes.data, ns.ctypes.data, count, n_planes, kind,
              _native_width(kind, element_size), planes.ctypes.data, at.ctypes.data, planes.shape[1],
              changed.ctypes.data)
    assert done == 0, (kind, element_size, n_planes)
    return changed.astype(bool)


def _delta_split_numpy(raws: Sequence[np.ndarray], bases: Sequence[np.ndarray], keeps: Sequence[np.ndarray | None],
                       kind: int, element_size: int, planes: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """:func:`delta_split` one array at a time (without the native library)."""
    n_planes = planes.shape[0]
    changed = np.zeros(len(raws), dtype=bool)
    for i, (raw, base, keep) in enumerate(zip(raws, bases, keeps)):
        diff, changed[i] = delta_np(raw, base, kind, element_size)
        if keep is not None:
            keep[:] = raw
        n = raw.size // n_planes
        planes[:, int(offsets[i]) : int(offsets[i]) + n] = diff.reshape(n, n_planes).T
    return changed


def encode_np(raw: np.ndarray, base: np.ndarray, kind: int, element_size: int) -> np.ndarray:
    """The delta of ``raw`` against ``base`` (flat uint8 arrays of one size): a new uint8 array."""
    return delta_np(raw, base, kind, element_size)[0]


def encode_numpy(raw: np.ndarray, base: np.ndarray, kind: int, element_size: int) -> np.ndarray:
    """:func:`encode_np` in numpy (without the native library; the reference its tests compare with)."""
    if kind == XOR:
        return np.bitwise_xor(raw, base)
    it = _NP_INT[element_size]
    b, a = raw.view(it), base.view(it)
    out = np.empty_like(b)
    sign = np.empty(min(_STEP, b.size), dtype=it)
    for i in range(0, b.size, _STEP):
        d, s = out[i : i + _STEP], sign[: min(_STEP, b.size - i)]
        np.subtract(b[i : i + _STEP], a[i : i + _STEP], out=d)  # wraps modulo 2^width, as intended
        np.right_shift(d, 8 * element_size - 1, out=s)
        np.left_shift(d, 1, out=d)
        np.bitwise_xor(d, s, out=d)
    return out.view(np.uint8)


def apply_np(value: np.ndarray, delta: np.ndarray, kind: int, element_size: int) -> None:
    """``value`` (the base's bytes) becomes the item's bytes: the inverse of :func:`encode_np`."""
    fn = _native("nvdcp_delta_apply")
    if fn is None or not _native_fits(value, delta, element_size=element_size):
        apply_numpy(value, delta, kind, element_size)
        return
    width = _native_width(kind, element_size)
    done = fn(value.ctypes.data, delta.ctypes.data, value.size // width, width, kind)
    assert done == 0, (kind, element_size)


def apply_numpy(value: np.ndarray, delta: np.ndarray, kind: int, element_size: int) -> None:
    """:func:`apply_np` in numpy (without the native library; the reference its tests compare with)."""
    if kind == XOR:
        np.bitwise_xor(value, delta, out=value)
        return
    it, ut = _NP_INT[element_size], _NP_UINT[element_size]
    z, v = delta.view(ut), value.view(it)
    half = np.empty(min(_STEP, z.size), dtype=ut)
    sign = np.empty(min(_STEP, z.size), dtype=ut)
    for i in range(0, z.size, _STEP):
        n = min(_STEP, z.size - i)
        h, s = half[:n], sign[:n]
        np.right_shift(z[i : i + n], 1, out=h)
        np.bitwise_and(z[i : i + n], 1, out=s)
        si = s.view(it)
        np.negative(si, out=si)
        np.bitwise_xor(h.view(it), si, out=si)
        np.add(v[i : i + n], si, out=v[i : i + n])


# -- torch (the GPU path) -------------------------------------------------------------------------
def _logical_shift_right_1(z: torch.Tensor, element_size: int) -> torch.Tensor:
    # torch has no unsigned 32/64-bit shifts: an arithmetic shift with the sign bit masked off
    return (z >> 1) & ((1 << (8 * element_size - 1)) - 1)


def encode_torch(raw: torch.Tensor, base: torch.Tensor, kind: int, element_size: int) -> torch.Tensor:
    """As :func:`encode_np`, for uint8 tensors on one device (a new tensor)."""
    if kind == XOR:
        return torch.bitwise_xor(raw, base)
    it = _TORCH_INT[element_size]
    d = raw.view(it) - base.view(it)
    z = (d << 1) ^ (d >> (8 * element_size - 1))
    return z.view(torch.uint8)


def encode_into_base_torch(raw: torch.Tensor, base: torch.Tensor, kind: int, element_size: int) -> torch.Tensor:
    """As :func:`encode_torch`, written over ``base`` (a scratch copy of the base's bytes, e.g.
    the GPU encoder's upload of it) with one temporary instead of four; returns ``base``."""
    difference_into_base_torch(raw, base, kind, element_size)
    return finish_in_place_torch(base, kind, element_size)


def difference_into_base_torch(raw: torch.Tensor, base: torch.Tensor, kind: int, element_size: int) -> None:
    """The first step of :func:`encode_into_base_torch`: ``base`` becomes ``raw`` XOR ``base``
    (``XOR``) or ``raw - base`` (``ZIGZAG_DIFF``). After it ``raw`` is no longer read: a caller
    holding it in a temporary can free it before :func:`finish_in_place_torch` allocates."""
    if kind == XOR:
        base.bitwise_xor_(raw)
        return
    d = base.view(_TORCH_INT[element_size])
    torch.sub(raw.view(d.dtype), d, out=d)


def finish_in_place_torch(delta: torch.Tensor, kind: int, element_size: int) -> torch.Tensor:
    """The second step of :func:`encode_into_base_torch`: zigzag-code a difference in place
    (nothing to do for ``XOR``); returns ``delta``."""
    if kind == XOR:
        return delta
    d = delta.view(_TORCH_INT[element_size])
    sign = d >> (8 * element_size - 1)
    d.bitwise_left_shift_(1).bitwise_xor_(sign)
    return delta


def to_difference_torch(delta: torch.Tensor, kind: int, element_size: int) -> None:
    """Turn a decoded ``ZIGZAG_DIFF`` delta (uint8) into the plain difference, in place, so that
    the differences of a chain add up (XOR deltas are left as they are: they XOR up)."""
    if kind == XOR:
        return
    z = delta.view(_TORCH_INT[element_size])
    z.copy_(_logical_shift_right_1(z, element_size) ^ -(z & 1))


def accumulate_torch(acc: torch.Tensor, level: torch.Tensor, kind: int, element_size: int, is_delta: bool) -> None:
    """Fold one more level of a chain into ``acc`` (uint8, in place). ``acc`` holds the sum (or
    XOR) of the levels above, already as differences (:func:`to_difference_torch`); ``level``
    is the next level's decoded bytes: a delta of the same kind, or the bytes saved whole at the
    bottom of the chain. XOR and modular addition are both commutative, so folding top-down
    gives what applying the deltas bottom-up gives."""
    if kind == XOR:
        acc.bitwise_xor_(level)
        return
    it = _TORCH_INT[element_size]
    if is_delta:
        to_difference_torch(level, kind, element_size)
    acc.view(it).add_(level.view(it))


__all__ = [
    "KINDS", "XOR", "ZIGZAG_DIFF", "accumulate_torch", "apply_np", "apply_numpy", "delta_np", "difference_into_base_torch",
    "encode_into_base_torch",
    "delta_split", "encode_np", "encode_numpy", "encode_torch", "finish_in_place_torch", "kind_for",
    "to_difference_torch",
]

"""CRC32C of many chunks at once: the checksum of every stored chunk (docs/FORMAT.md).

:func:`checksum_ranges` computes the CRC32C of many byte ranges of one buffer in one call of the
optional native library ``_crc32c_batch`` (built by setup.py; SSE4.2, three interleaved lanes per
range, on several threads, the GIL released). Without it, the ``crc32c`` package computes them
one by one on this thread, which measured faster than a thread pool over it (the package holds
the GIL between calls).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from operator import add
from typing import Any

import crc32c
import numpy as np

from nvdcp._native import load_function
from nvdcp.cores import usable_cores

logger = logging.getLogger(__name__)

#: At most this many ranges of at most ``FEW_RANGES_BYTES`` in all (a small record's chunks) are
#: checksummed by the ``crc32c`` package on this thread: the native call's setup (array checks,
#: argument conversion, its threads) cost 4x the package's loop there (17 vs 4 us for 4 chunks
#: of 1-5 KiB, CPU machine).
FEW_RANGES = 8
FEW_RANGES_BYTES = 256 << 10


@functools.cache
def _native() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    fn = load_function(os.path.dirname(__file__), "_crc32c_batch", "nvdcp_crc32c_ranges")
    if fn is None:
        logger.debug("nvdcp.format._crc32c_batch is not available: chunk checksums use the crc32c package")
        return None
    # Plain addresses, not typed pointers: numpy's ``ctypes.data_as`` costs more than the CRC of
    # a small record (32 us a call before, most of it in argument conversion).
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _default_threads() -> int:
    """The cores this rank may use (:func:`nvdcp.cores.usable_cores`), at most 16: the
    checksums are memory-bound well before that, and may run next to training."""
    return min(16, usable_cores())


def native_available() -> bool:
    """Whether the batched native CRC32C is built here."""
    return _native() is not None


def checksum_ranges(buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, threads: int | None = None) -> np.ndarray:
    """CRC32C of ``buf[offsets[i] : offsets[i] + lengths[i]]`` for every ``i`` (uint32 array).

    ``buf`` is a contiguous uint8 array (pinned or not); every range must lie inside it.
    """
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if offsets.shape != lengths.shape or offsets.ndim != 1:
        raise ValueError("offsets and lengths must be 1-D arrays of one length")
    if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
        raise ValueError("buf must be a contiguous 1-D uint8 array")
    n = len(offsets)
    if n <= FEW_RANGES:
        offs, lens = offsets.tolist(), lengths.tolist()
        if sum(lens) <= FEW_RANGES_BYTES:
            if n and (min(offs) < 0 or min(lens) < 0 or max(map(add, offs, lens)) > buf.size):
                raise ValueError(f"a range lies outside the {buf.size}-byte buffer")
            view = buf.data
            return np.array([crc32c.crc32c(view[o : o + k]) for o, k in zip(offs, lens)], dtype=np.uint32)
    if n and (min(offsets.min(), lengths.min()) < 0 or int((offsets + lengths).max()) > buf.size):
        raise ValueError(f"a range lies outside the {buf.size}-byte buffer")
    out = np.empty(n, dtype=np.uint32)
    fn = _native()
    if fn is not None and n:
        fn(buf.ctypes.data, offsets.ctypes.data, lengths.ctypes.data, n, out.ctypes.data, threads or _default_threads())
        return out
    view = buf.data
    for i, (off, n) in enumerate(zip(offsets.tolist(), lengths.tolist())):
        out[i] = crc32c.crc32c(view[off : off + n])
    return out


# -- on the device ------------------------------------------------------------------------------
def device_checksums_available() -> bool:
    """Whether :func:`checksum_ranges_device` runs here (Triton and a CUDA device; see
    :func:`nvdcp.gpu.crc32c.device_crc_available`)."""
    from nvdcp.gpu.crc32c import device_crc_available

    return device_crc_available()


def checksum_ranges_device(buf: Any, offsets: Any, lengths: Any, expected: Any = None) -> tuple[Any, Any]:
    """:func:`checksum_ranges` of a CUDA uint8 tensor, computed on its device by a Triton kernel
    (the same values, bit for bit): ``(crcs, bad)``, see :func:`nvdcp.gpu.crc32c.checksum_ranges_device`.
    Queued on the current stream; nothing waits."""
    from nvdcp.gpu.crc32c import checksum_ranges_device as on_device

    return on_device(buf, offsets, lengths, expected)

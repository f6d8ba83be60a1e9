"""zstd-coded blocks decoded straight into their elements, one native call for many blocks.

A CPU load decodes each block's plane frames and interleaves the planes into the destination
(nvdcp/pipeline/cpu_batch.py). Through zstd's batch API (``multi_decompress_to_buffer``) the
frames land in fresh buffers first: on the CPU machine, decoding 100 MB of bf16 top-plane frames
took 0.145 s of CPU on 2 threads for 0.085 s of wall time, half of it the kernel zero-filling
those buffers' pages, and the interleave then read them back from memory. One thread decoding
each frame into a reused 64 KiB scratch took 0.062 s (CPU machine, 2026-12-07; the probe and the
loads it sped up: docs/BENCHMARKS.md, "Forty-second session").

:func:`block_decoder` hands ``nvdcp.codecs._zstd_batch`` (C++, optional) the addresses of the
zstd decoding functions the `zstandard` package's cffi backend carries, and of the plane merge
kernels in ``nvdcp.format._crc32c_batch``; each block's frames are decoded into a per-thread
scratch and merged (or applied, for a delta level) while they are in cache. It returns None where
either library or the cffi backend is missing, or with ``NVDCP_ZSTD_BLOCKS=0``; callers then use
the codecs' ``decode_ranges``. The frames and the result are the same either way.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import numpy as np

from nvdcp._native import load_function

ENV_VAR = "NVDCP_ZSTD_BLOCKS"
_ZSTD_FUNCTIONS = ("ZSTD_createDCtx", "ZSTD_freeDCtx", "ZSTD_decompressDCtx", "ZSTD_isError",
                   "ZSTD_findFrameCompressedSize", "ZSTD_getFrameContentSize")
_CODECS_DIR = os.path.dirname(__file__)
_FORMAT_DIR = os.path.join(os.path.dirname(_CODECS_DIR), "format")


class BlockDecoder:
    """Decodes blocks whose compressed planes are zstd frames (see the module doc)."""

    def __init__(self, decode: Any, functions: np.ndarray) -> None:
        self._decode = decode
        self._functions = functions  # kept alive: the native call reads the addresses

    def decode(self, chunks: np.ndarray, stored: np.ndarray, coded: np.ndarray, ns: np.ndarray, dsts: np.ndarray,
               width: int, kind: int = -1, element_width: int = 1, threads: int = 1) -> None:
        """Decode ``len(ns)`` blocks of ``width`` planes: plane ``p`` of block ``i`` is chunk
        ``i * width + p`` (``stored[c]`` bytes at address ``chunks[c]``; where ``coded[c]``, a
        zstd frame declaring ``ns[i]`` bytes of content, with any bytes after it not read, as
        zstd's batch API takes it; else those ``ns[i]`` bytes raw). Block ``i``'s elements go to
        address ``dsts[i]``; with ``kind`` >= 0 they are applied there as a delta of that kind over
        ``element_width``-byte elements (:func:`~nvdcp.transform.delta.apply_np`'s kinds).

        Raises:
            ValueError: a block does not decode to its size (blocks before or after it may have
                been written), or the kind or width is unknown.
        """
        count = len(ns)
        chunks = np.ascontiguousarray(chunks, dtype=np.int64)
        stored = np.ascontiguousarray(stored, dtype=np.int64)
        coded = np.ascontiguousarray(coded, dtype=np.uint8)
        ns = np.ascontiguousarray(ns, dtype=np.int64)
        dsts = np.ascontiguousarray(dsts, dtype=np.int64)
        if not len(chunks) == len(stored) == len(coded) == count * width or len(dsts) != count:
            raise ValueError(f"{count} blocks of {width} planes need {count * width} chunks and {count} destinations")
        if (ns < 0).any() or (stored < 0).any():
            raise ValueError("negative block or chunk sizes")
        status = self._decode(self._functions.ctypes.data, chunks.ctypes.data, stored.ctypes.data, coded.ctypes.data,
                              ns.ctypes.data, dsts.ctypes.data, count, width, kind, element_width, max(1, threads))
        if status < 0:
            raise ValueError(f"cannot decode {width}-plane blocks as delta kind {kind} over {element_width}-byte "
                             "elements (an unknown kind or width, or no zstd context could be made)")
        if status > 0:
            raise ValueError(f"block {status - 1} of {count}: a zstd frame or raw chunk is not its plane's size")


@functools.cache
def block_decoder() -> BlockDecoder | None:
    """The shared :class:`BlockDecoder`, or None where it cannot run here (see the module doc)."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return None
    try:
        from zstandard import _cffi  # type: ignore[attr-defined]
    except ImportError:
        return None
    ffi, lib = _cffi.ffi, _cffi.lib
    if not all(hasattr(lib, name) for name in _ZSTD_FUNCTIONS):
        return None
    decode = load_function(_CODECS_DIR, "_zstd_batch", "nvdcp_zstd_decode_blocks")
    found = [load_function(_FORMAT_DIR, "_crc32c_batch", name) for name in ("nvdcp_merge_planes", "nvdcp_merge_apply_many")]
    merges = [fn for fn in found if fn is not None]
    if decode is None or len(merges) < len(found):
        return None
    decode.restype = ctypes.c_int64
    decode.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    addresses = [int(ffi.cast("uintptr_t", ffi.addressof(lib, name))) for name in _ZSTD_FUNCTIONS]
    addresses += [ctypes.cast(fn, ctypes.c_void_p).value or 0 for fn in merges]
    return BlockDecoder(decode, np.array(addresses, dtype=np.uint64))

"""zstd frames for near-iid bytes: the match search skipped, the literals Huffman-coded.

The sign+exponent plane of a float tensor, and every plane of a delta, is a stream of nearly
independent bytes: zstd's gain there is all in the Huffman-coded literals, and the matches its
search finds are short ones that cost more than they save (``SPARSE_PLANE_HASH_LOG`` in
:mod:`nvdcp.codecs.zstd`). zstd can step over the search while still Huffman-coding literals: the
fast strategy with a large acceleration (``targetLength``) and ``literalCompressionMode`` forced
on (zstd turns literal compression off with acceleration unless told otherwise). The `zstandard`
package's C binding does not expose that parameter; its cffi backend exposes the whole zstd API,
and this module uses it. On the CPU machine's small-tensor state (21,032 top-plane chunks,
222 MB) it compressed 2.955x in 0.29 s on one thread, against 2.942x in 0.39 s for the C
binding with the hash table cut to 64 entries (2026-12-05).

The frames are ordinary zstd frames (content size recorded, no checksum): every decoder, nvCOMP's
included, reads them; only the encoder's choices differ. :func:`literals_compressor` returns None
where the cffi backend is missing (``pip install zstandard[cffi]``), and callers use the C binding.
A batch of ranges goes to ``nvdcp.codecs._zstd_batch`` (C++, optional): one ctypes call that
spreads the ranges over threads and packs the frames back to back, given the addresses of the
zstd functions the cffi backend carries. Without it, ranges are compressed one call at a time.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import Any

import numpy as np

from nvdcp._native import load_function
from nvdcp.codecs.base import Buffer, PackedStreams

#: zstd's fast strategy looks for a match only every this many bytes after a miss: in effect no
#: search at all (literal-only frames were no smaller and no faster; measured as above).
ACCELERATION = 1024
#: Hash table size (log2 entries) for what little search is left: the smallest zstd allows.
HASH_LOG = 6
#: Shortest match zstd may take, at its largest setting: only long repeats are worth a sequence.
MIN_MATCH = 7

_FUNCTIONS = ("ZSTD_createCCtx", "ZSTD_freeCCtx", "ZSTD_CCtx_setParameter", "ZSTD_compress2", "ZSTD_isError")


def _backend() -> tuple[Any, Any] | None:
    """The `zstandard` cffi backend's ``(ffi, lib)``, or None where it cannot load."""
    try:
        from zstandard import _cffi  # type: ignore[attr-defined]
    except ImportError:
        return None
    lib = _cffi.lib
    if not all(hasattr(lib, name) for name in (*_FUNCTIONS, "ZSTD_c_literalCompressionMode", "ZSTD_compressBound")):
        return None
    return _cffi.ffi, lib


class LiteralsCompressor:
    """zstd level 1, fast strategy, search strided away, literals Huffman-coded (see module doc).

    Thread-safe: each thread gets its own zstd context.
    """

    def __init__(self, ffi: Any, lib: Any, batch: Any) -> None:
        self._ffi, self._lib, self._batch = ffi, lib, batch
        pairs = [
            (lib.ZSTD_c_compressionLevel, 1), (lib.ZSTD_c_strategy, lib.ZSTD_fast),
            (lib.ZSTD_c_hashLog, HASH_LOG), (lib.ZSTD_c_minMatch, MIN_MATCH),
            (lib.ZSTD_c_targetLength, ACCELERATION), (lib.ZSTD_c_literalCompressionMode, lib.ZSTD_ps_enable),
            (lib.ZSTD_c_contentSizeFlag, 1), (lib.ZSTD_c_checksumFlag, 0),
        ]
        self._params = np.array(pairs, dtype=np.int32)
        self._functions = np.array(
            [int(ffi.cast("uintptr_t", ffi.addressof(lib, name))) for name in _FUNCTIONS], dtype=np.uint64
        )
        self._local = threading.local()

    def _context(self) -> Any:
        context = getattr(self._local, "context", None)
        if context is None:
            ffi, lib = self._ffi, self._lib
            context = ffi.gc(lib.ZSTD_createCCtx(), lib.ZSTD_freeCCtx)
            if context == ffi.NULL:
                raise MemoryError("zstd could not create a compression context")
            for key, value in self._params.tolist():
                self._check(lib.ZSTD_CCtx_setParameter(context, key, value), "setting a parameter")
            self._local.context = context
        return context

    def _check(self, code: int, what: str) -> int:
        if self._lib.ZSTD_isError(code):
            raise RuntimeError(f"zstd failed {what}: {self._ffi.string(self._lib.ZSTD_getErrorName(code)).decode()}")
        return code

    def compress(self, chunk: Buffer) -> bytes:
        """One frame of ``chunk``."""
        ffi, lib = self._ffi, self._lib
        src = ffi.from_buffer(chunk)
        capacity = lib.ZSTD_compressBound(len(src))
        out = ffi.new("char[]", capacity)
        n = self._check(lib.ZSTD_compress2(self._context(), out, capacity, src, len(src)), "compressing a chunk")
        return ffi.buffer(out, n)[:]

    def compress_ranges(self, buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, threads: int) -> PackedStreams:
        """One frame per range of ``buf`` (uint8, contiguous), packed back to back.

        Raises:
            ValueError: ``buf`` is not contiguous, or a range lies outside it.
        """
        lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        if not buf.flags.c_contiguous or buf.dtype != np.uint8:
            raise ValueError("zstd ranges need a contiguous uint8 buffer")
        if len(lengths) and ((offsets < 0).any() or (lengths < 0).any() or (offsets + lengths > buf.size).any()):
            raise ValueError(f"a zstd range lies outside its {buf.size}-byte buffer")
        if self._batch is None:
            frames = [self.compress(buf[o : o + n].data) for o, n in zip(offsets.tolist(), lengths.tolist())]
            data = np.frombuffer(b"".join(frames), dtype=np.uint8)
            return PackedStreams(data, np.fromiter(map(len, frames), dtype=np.int64, count=len(frames)))
        caps = _compress_bound(lengths)
        dst_off = np.zeros(len(caps), dtype=np.int64)
        np.cumsum(caps[:-1], out=dst_off[1:])
        dst = np.empty(int(caps.sum()), dtype=np.uint8)
        out_len = np.empty(len(lengths), dtype=np.int64)
        total = self._batch(
            self._functions.ctypes.data, self._params.ctypes.data, len(self._params), buf.ctypes.data,
            offsets.ctypes.data, lengths.ctypes.data, dst.ctypes.data, dst_off.ctypes.data, caps.ctypes.data,
            out_len.ctypes.data, len(lengths), max(1, threads),
        )
        if total < 0:
            raise RuntimeError("zstd failed on a batch of ranges" if total == -2 else "zstd refused its parameters")
        return PackedStreams(dst[:total], out_len)


def _compress_bound(lengths: np.ndarray) -> np.ndarray:
    """``ZSTD_COMPRESSBOUND`` of each length (zstd.h), in int64."""
    small = np.where(lengths < (128 << 10), ((128 << 10) - lengths) >> 11, 0)
    return lengths + (lengths >> 8) + small


def _batch_function() -> Any:
    fn = load_function(os.path.dirname(__file__), "_zstd_batch", "nvdcp_zstd_compress_ranges")
    if fn is not None:
        fn.restype = ctypes.c_int64
        fn.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
        ]
    return fn


@functools.cache
def literals_compressor() -> LiteralsCompressor | None:
    """The shared :class:`LiteralsCompressor`, or None without the cffi backend (or with
    ``NVDCP_ZSTD_LITERALS=0``, which keeps the C binding's search-based frames)."""
    if os.environ.get("NVDCP_ZSTD_LITERALS", "1") == "0":
        return None
    backend = _backend()
    if backend is None:
        return None
    return LiteralsCompressor(*backend, _batch_function())

"""GDeflate: NVIDIA's GPU-parallel Deflate variant, one RAW nvCOMP GDeflate stream per chunk.

On the CPU this codec calls ``libnvcomp_cpu.so.6`` from the ``nvidia-libnvcomp-cu12`` wheel
through ctypes (hand-written because the wheel ships no Python binding for its CPU functions;
the library loads on machines without a GPU). Its bitstream is the one nvCOMP's GPU GDeflate
reads and writes, so a chunk written by either decodes on the other (checked on the H200 in
tests/gpu). The CPU functions take a batch of chunks; we call them per chunk from a thread pool
(the call releases the GIL, as every ctypes call does).

nvCOMP's decoder throws a C++ exception on a malformed stream; reaching ctypes, that aborts the
process. Readers only pass it chunks whose CRC32C matched, so damage never gets there, but a
forged file could. ``_gdeflate_guard`` (a few lines of C++ built by setup.py when a compiler is
present) catches the exception and we raise ``ValueError``; without it we call nvCOMP directly
(docs/SECURITY.md).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import importlib.util
import logging
import os

from nvdcp._native import load_function
from nvdcp.codecs.base import Buffer, Codec
from nvdcp.errors import CodecUnavailableError

#: nvCOMP's GDeflate works on chunks of at most 64 KiB.
MAX_CHUNK_BYTES = 1 << 16
#: CPU compression level (0-12). Level 1 is the fast one (`nvdcp bench --codec gdeflate` measures it).
DEFAULT_CPU_LEVEL = 1

_SIZE_P = ctypes.POINTER(ctypes.c_size_t)
_VOID_PP = ctypes.POINTER(ctypes.c_void_p)
_DECOMPRESS = "_ZN6nvcomp8gdeflate13decompressCPUEPKPKvPKmmPKPvPmSA_"

logger = logging.getLogger(__name__)


@functools.cache
def _library() -> ctypes.CDLL:
    spec = importlib.util.find_spec("nvidia.libnvcomp")
    paths = list(spec.submodule_search_locations or []) if spec else []
    for root in paths:
        candidate = os.path.join(root, "lib64", "libnvcomp_cpu.so.6")
        if os.path.exists(candidate):
            lib = ctypes.CDLL(candidate)
            break
    else:
        raise CodecUnavailableError(
            "codec 'gdeflate' needs libnvcomp_cpu.so.6 from the nvidia-libnvcomp-cu12 wheel: "
            "pip install nvidia-libnvcomp-cu12"
        )
    # C++ symbols from include/nvcomp/native/gdeflate_cpu.h, by their Itanium-mangled names.
    compress = lib["_ZN6nvcomp8gdeflate11compressCPUEPKPKvPKmmmPKPvPmi"]
    compress.argtypes = [_VOID_PP, _SIZE_P, ctypes.c_size_t, ctypes.c_size_t, _VOID_PP, _SIZE_P, ctypes.c_int]
    compress.restype = None
    decompress = lib[_DECOMPRESS]
    decompress.argtypes = [_VOID_PP, _SIZE_P, ctypes.c_size_t, _VOID_PP, _SIZE_P, _SIZE_P]
    decompress.restype = None
    max_out = lib["_ZN6nvcomp8gdeflate32compressCPUGetMaxOutputChunkSizeEmPm"]
    max_out.argtypes = [ctypes.c_size_t, _SIZE_P]
    max_out.restype = None
    return lib


@functools.cache
def _guard() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """``nvdcp_gdeflate_decompress`` from the optional ``_gdeflate_guard`` library, or None."""
    fn = load_function(os.path.dirname(__file__), "_gdeflate_guard", "nvdcp_gdeflate_decompress")
    if fn is None:
        logger.debug("nvdcp.codecs._gdeflate_guard is not available: a malformed GDeflate stream aborts the process")
        return None
    fn.argtypes = [
        ctypes.c_void_p, _VOID_PP, _SIZE_P, ctypes.c_size_t, _VOID_PP, _SIZE_P, _SIZE_P,
        ctypes.c_char_p, ctypes.c_size_t,
    ]
    fn.restype = ctypes.c_int
    return fn


def guarded() -> bool:
    """Whether malformed GDeflate streams raise ``ValueError`` here (instead of aborting)."""
    return _guard() is not None


def _address(buf: Buffer) -> tuple[int, object]:
    """Address of a buffer's first byte, plus the object that keeps it alive."""
    if isinstance(buf, bytes):
        keep = ctypes.c_char_p(buf)
        return ctypes.cast(keep, ctypes.c_void_p).value or 0, keep
    view = memoryview(buf)
    if view.readonly:
        copy = bytes(view)
        return _address(copy)[0], copy
    arr = (ctypes.c_char * len(view)).from_buffer(view)
    return ctypes.addressof(arr), arr


class GDeflateCodec(Codec):
    name = "gdeflate"
    codec_id = 2
    nvcomp_algorithm = "GDeflate"

    def __init__(self, level: int = DEFAULT_CPU_LEVEL) -> None:
        if not 0 <= level <= 12:
            raise ValueError(f"gdeflate CPU level must be 0-12, got {level}")
        self.level = level

    @classmethod
    def check_available(cls) -> None:
        _library()  # fail here, with the install hint, rather than on the first chunk

    @staticmethod
    def available() -> bool:
        try:
            _library()
        except CodecUnavailableError:
            return False
        return True

    def _max_compressed(self, n: int) -> int:
        out = ctypes.c_size_t(0)
        _library()["_ZN6nvcomp8gdeflate32compressCPUGetMaxOutputChunkSizeEmPm"](n, ctypes.byref(out))
        return out.value

    def encode(self, chunk: Buffer) -> bytes:
        n = len(chunk)
        if n > MAX_CHUNK_BYTES:
            raise ValueError(f"gdeflate chunks are at most {MAX_CHUNK_BYTES} bytes, got {n}")
        if n == 0:
            return b""
        lib = _library()
        src_addr, keep = _address(chunk)
        out = ctypes.create_string_buffer(self._max_compressed(n))
        in_ptrs = (ctypes.c_void_p * 1)(src_addr)
        in_sizes = (ctypes.c_size_t * 1)(n)
        out_ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(out))
        out_sizes = (ctypes.c_size_t * 1)(0)
        lib["_ZN6nvcomp8gdeflate11compressCPUEPKPKvPKmmmPKPvPmi"](
            in_ptrs, in_sizes, MAX_CHUNK_BYTES, 1, out_ptrs, out_sizes, self.level
        )
        del keep
        return out.raw[: out_sizes[0]]

    def decode(self, data: Buffer, out: memoryview) -> None:
        n = len(out)
        if n == 0:
            if len(data):
                raise ValueError("gdeflate stream for an empty chunk is not empty")
            return
        if not data:
            raise ValueError("empty gdeflate stream")
        lib = _library()
        src_addr, keep = _address(data)
        dst = (ctypes.c_char * n).from_buffer(out)
        in_ptrs = (ctypes.c_void_p * 1)(src_addr)
        in_sizes = (ctypes.c_size_t * 1)(len(data))
        out_ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(dst))
        capacity = (ctypes.c_size_t * 1)(n)
        actual = (ctypes.c_size_t * 1)(0)
        guard = _guard()
        if guard is None:
            lib[_DECOMPRESS](in_ptrs, in_sizes, 1, out_ptrs, capacity, actual)
        else:
            err = ctypes.create_string_buffer(256)
            fn = ctypes.cast(lib[_DECOMPRESS], ctypes.c_void_p)
            if guard(fn, in_ptrs, in_sizes, 1, out_ptrs, capacity, actual, err, len(err)):
                raise ValueError(f"gdeflate stream does not decode: {err.value.decode(errors='replace')}")
        del keep, dst
        if actual[0] != n:
            raise ValueError(f"gdeflate stream decodes to {actual[0]} bytes, expected {n}")

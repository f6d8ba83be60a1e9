"""nvCOMP's batched C API through ctypes: one call per codec group of chunks, no host work per chunk.

nvCOMP's Python binding costs host time for every chunk: each chunk wrapped as an ``Array``
(``nv.as_arrays``) and each compressed size read back one by one (``result.buffer_sizes``), 1.5 to
3.8 µs a chunk on the H100 (benchmarks/encode_thread_probe.py): most of what a delta save's
encode thread spent beyond a full save's, since a delta compresses every plane's chunks. Here a
group's chunk pointers and sizes are computed with numpy and go to the device in one copy;
nvCOMP writes its output sizes and per-chunk statuses into one device array that comes back in
one copy. Its workspace is one device buffer per GPU, kept between calls and shared by every
stream and thread (:class:`Workspaces`): nvCOMP's Zstd asks for 1.07 GiB whatever the batch
(H200, nvCOMP 6.0), which the binding took with ``cudaMalloc`` and gave back with ``cudaFree``,
a wait for the whole device, on every call.

The library is ``libnvcomp.so.6`` of the ``nvidia-libnvcomp-cu12`` wheel, opened by the wheel's
own loader; the option structs follow its headers (nvCOMP 6.0: 64 bytes each, passed by value).
The bitstreams are those of the Python binding's codecs with the same options
(tests/gpu/test_nvcomp_batch.py compares them byte for byte).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nvdcp.codecs import codec_class
from nvdcp.errors import CodecUnavailableError, NvdcpError

#: nvCOMP's ``nvcompType_t`` for the ``data_type`` strings of :func:`~nvdcp.gpu.nvcomp_codecs.typed_data_type`.
TYPE_CODES = {"|u1": 1, "<f2": 10, "<f4": 11, "<f8": 12}
#: ``NVCOMP_TYPE_BITS``: ANS decompression reads the element type from the bitstream.
_TYPE_FROM_STREAM = 0xFF
#: The C API's name of each algorithm (``nvcompBatched<name>CompressAsync``).
_C_NAMES = {"Zstd": "Zstd", "GDeflate": "Gdeflate", "ANS": "ANS", "Bitcomp": "Bitcomp"}


class NvcompCallError(NvdcpError, RuntimeError):
    """nvCOMP refused a batched call (its status code and message are named)."""


class _Opts(ctypes.Structure):
    """Any of nvCOMP 6's option structs: 64 bytes, filled from :func:`struct.pack` output."""

    _fields_ = [("raw", ctypes.c_ubyte * 64)]

    @classmethod
    def of(cls, fmt: str, *values: Any) -> _Opts:
        opts = cls()
        packed = struct.pack(fmt, *values) if fmt else b""
        ctypes.memmove(ctypes.addressof(opts), packed, len(packed))
        return opts


@functools.cache
def library() -> ctypes.CDLL:
    """``libnvcomp.so.6`` from the ``nvidia-libnvcomp-cu12`` wheel (loads without a GPU)."""
    try:
        from nvidia.libnvcomp.load import load_library
    except ImportError as exc:
        raise CodecUnavailableError("nvCOMP's GPU codecs need the nvidia-libnvcomp-cu12 wheel: "
                                    "pip install nvidia-libnvcomp-cu12") from exc
    lib = load_library()
    if lib is None:
        raise CodecUnavailableError("libnvcomp.so.6 from nvidia-libnvcomp-cu12 could not be loaded")
    lib.nvcompGetStatusString.restype = ctypes.c_char_p
    lib.nvcompGetStatusString.argtypes = [ctypes.c_int]
    return lib


def library_version() -> int:
    """nvCOMP's version number (6000 for 6.0.0)."""
    props = (ctypes.c_uint32 * 2)()
    _check(library().nvcompGetProperties(props), "nvcompGetProperties")
    return int(props[0])


def _check(status: int, call: str) -> None:
    if status != 0:
        message = library().nvcompGetStatusString(status).decode(errors="replace")
        raise NvcompCallError(f"nvCOMP {call} failed: status {status} ({message})")


def _function(name: str, argtypes: list[Any]) -> Any:
    fn = getattr(library(), name)
    fn.restype = ctypes.c_int
    fn.argtypes = argtypes
    return fn


_P, _N = ctypes.c_void_p, ctypes.c_size_t
_SIZE_OUT = ctypes.POINTER(ctypes.c_size_t)
#: More chunks than any call carries (the search of :meth:`BatchedCodec.chunks_within` stops here).
_MAX_CALL_CHUNKS = 1 << 20


def side_streams_on() -> bool:
    """Whether a bucket's or a pass's codec groups after the first run on side streams (the
    default); ``NVDCP_SIDE_STREAMS=0`` queues them all on one stream, for A/B runs."""
    return os.environ.get("NVDCP_SIDE_STREAMS", "1") != "0"


class Workspaces:
    """nvCOMP's temporary workspace: one device buffer per GPU, grown to the largest request,
    shared by every stream and thread. Calls that use it are ordered on the device (each waits
    for the event of the call before it, on whatever stream that ran), so one buffer serves
    them all: a Zstd call's workspace is 1.07 GiB, and one per stream and encoder thread would
    keep several of them. Of the codecs nvdcp calls only Zstd asks for one (GDeflate, ANS and
    Bitcomp none: their calls never wait here, and run beside a Zstd call on another stream).

    The buffer lives while a save or load holds it (:meth:`held`) and is dropped when the last
    one ends: its memory then stays in torch's allocator cache, so the next save reuses it
    without a ``cudaMalloc``, while an allocation of the training job that would otherwise run
    out of memory gets it back (torch frees unused cached blocks and retries)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: dict[int, torch.Tensor] = {}
        self._last: dict[int, torch.cuda.Event] = {}
        self._holders = 0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Keep the workspaces between the calls of the block (one save's or load's); the last
        holder to leave drops them."""
        with self._lock:
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0:
                    self._buffers.clear()
                    self._last.clear()

    @contextlib.contextmanager
    def use(self, device: torch.device, nbytes: int, stream: torch.cuda.Stream) -> Iterator[torch.Tensor | None]:
        """The workspace of ``device`` (at least ``nbytes``; None for none) for work queued on
        ``stream`` inside the block; the next user's stream waits for that work."""
        if nbytes == 0:
            yield None
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            last = self._last.get(index)
            if last is not None:
                stream.wait_event(last)
            buffer = self._buffers.get(index)
            if buffer is None or buffer.numel() < nbytes:
                with torch.cuda.stream(stream):  # after every earlier user: the old memory is free to reuse
                    self._buffers[index] = buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            buffer.record_stream(stream)
            yield buffer
            done = torch.cuda.Event()
            done.record(stream)
            self._last[index] = done

    def release(self) -> None:
        """Drop every workspace (torch's allocator frees them once the work queued on them ran)."""
        with self._lock:
            self._buffers.clear()
            self._last.clear()

    def nbytes(self) -> int:
        """Bytes held, over all devices."""
        with self._lock:
            return sum(b.numel() for b in self._buffers.values())


#: The process's nvCOMP workspaces (freed by :func:`nvdcp.release_resources`).
WORKSPACES = Workspaces()


@dataclass
class BatchResult:
    """nvCOMP's output size and status for each chunk of one call, on their way to pinned host
    memory; read them after :meth:`sizes` (which waits for the call and the copy)."""

    host: torch.Tensor  # (2, n) int64: sizes, then the statuses as int32 in the second row's bytes
    done: Any  # event recorded after the copy
    count: int

    def sizes(self) -> np.ndarray:
        """Each chunk's output bytes (int64), once the call has run."""
        self.done.synchronize()
        return self.host[0].numpy()

    def failed(self) -> np.ndarray:
        """Indices of the chunks whose status is not ``nvcompSuccess`` (after :meth:`sizes`)."""
        return np.flatnonzero(self.host[1].numpy().view(np.int32)[: self.count])

    def status_text(self, chunk: int) -> str:
        status = int(self.host[1].numpy().view(np.int32)[chunk])
        return f"status {status} ({library().nvcompGetStatusString(status).decode(errors='replace')})"


class BatchedCodec:
    """One of our codec ids with its nvCOMP options, compressing or decompressing many chunks of
    device buffers per call. Calls are queued on the CUDA stream passed to them; ctypes releases
    the GIL for each."""

    def __init__(self, name: str, data_type: str | None, chunk_bytes: int, gdeflate_type: int = 0) -> None:
        algorithm = codec_class(name).nvcomp_algorithm
        if algorithm is None:
            raise ValueError(f"codec {name!r} does not run through nvCOMP")
        self.name = name
        self.chunk_bytes = chunk_bytes
        c = _C_NAMES[algorithm]
        type_code = TYPE_CODES[data_type] if data_type is not None else 0
        self._compress_opts, self._decompress_opts = _options(algorithm, type_code, gdeflate_type)
        opts = _Opts
        self._compress = _function(f"nvcompBatched{c}CompressAsync", [_P, _P, _N, _N, _P, _N, _P, _P, opts, _P, _P])
        self._compress_temp = _function(f"nvcompBatched{c}CompressGetTempSize", [_N, _N, opts, _SIZE_OUT, _N, _P])
        self._decompress = _function(f"nvcompBatched{c}DecompressAsync", [_P, _P, _P, _P, _N, _P, _N, _P, opts, _P, _P])
        self._decompress_temp = _function(f"nvcompBatched{c}DecompressGetTempSize", [_N, _N, opts, _SIZE_OUT, _N, _P])
        bound = ctypes.c_size_t()
        _check(_function(f"nvcompBatched{c}CompressGetMaxOutputChunkSize", [_N, opts, _SIZE_OUT])(
            chunk_bytes, self._compress_opts, ctypes.byref(bound)), f"{c} GetMaxOutputChunkSize")
        #: upper bound of one compressed chunk, rounded up to 16 bytes (never below a raw chunk)
        self.max_output = max(chunk_bytes, -(-int(bound.value) // 16) * 16)
        self._within: dict[int, int] = {}  # chunks_within's answers

    def _check_sizes(self, sizes: np.ndarray) -> None:
        """nvCOMP is told every chunk holds at most ``chunk_bytes``: a larger one would be
        undefined behaviour on the device, so it is refused here."""
        if len(sizes) and int(sizes.max()) > self.chunk_bytes:
            i = int(np.argmax(sizes))
            raise ValueError(f"{self.name}: chunk {i} of the batch has {int(sizes[i])} bytes, more than the "
                             f"codec's chunk size of {self.chunk_bytes}")

    def compress_temp_bytes(self, count: int, total_bytes: int, stream: int = 0) -> int:
        """Workspace bytes nvCOMP needs to compress ``count`` chunks of ``total_bytes`` in all."""
        temp = ctypes.c_size_t()
        _check(self._compress_temp(count, self.chunk_bytes, self._compress_opts, ctypes.byref(temp),
                                   max(total_bytes, 1), stream), f"{self.name} compress temp size")
        return int(temp.value)

    def decompress_temp_bytes(self, count: int, total_bytes: int, stream: int = 0) -> int:
        """Workspace bytes nvCOMP needs to decompress ``count`` chunks of ``total_bytes`` in all."""
        temp = ctypes.c_size_t()
        _check(self._decompress_temp(count, self.chunk_bytes, self._decompress_opts, ctypes.byref(temp),
                                     max(total_bytes, 1), stream), f"{self.name} decompress temp size")
        return int(temp.value)

    def compress(self, src: torch.Tensor, src_offsets: np.ndarray, sizes: np.ndarray, dst: torch.Tensor,
                 dst_offsets: np.ndarray, stream: torch.cuda.Stream) -> BatchResult:
        """Queue on ``stream`` the compression of chunk ``i`` (``sizes[i]`` bytes at byte
        ``src_offsets[i]`` of flat uint8 ``src``) into ``dst`` at ``dst_offsets[i]``, each with
        room for :attr:`max_output` bytes. The compressed sizes come back in the result."""
        n = len(sizes)
        self._check_sizes(sizes)
        if n == 0:
            return _no_chunks()
        with torch.cuda.stream(stream):
            table = _device_table(src.device, src.data_ptr() + src_offsets, sizes, dst.data_ptr() + dst_offsets)
            out = torch.empty((2, n), dtype=torch.int64, device=src.device)
            temp_bytes = self.compress_temp_bytes(n, int(sizes.sum()), stream.cuda_stream)
            with WORKSPACES.use(src.device, temp_bytes, stream) as temp:
                status = self._compress(table[0].data_ptr(), table[1].data_ptr(), self.chunk_bytes, n, _ptr(temp),
                                        temp_bytes, table[2].data_ptr(), out[0].data_ptr(), self._compress_opts,
                                        out[1].data_ptr(), stream.cuda_stream)
            _check(status, f"{self.name} compress")
            return _result_to_host(out, stream, n)

    def chunks_within(self, temp_limit: int) -> int:
        """The most chunks one decompress call may carry with a workspace of at most
        ``temp_limit`` bytes (0: not even one). nvCOMP's Zstd asks for about 0.2 MiB a 64 KiB
        chunk (795 MiB for 4,096 on an H200), so a load under a GPU bound splits its calls."""
        known = self._within.get(temp_limit)
        if known is not None:
            return known
        lo, hi = 0, 1
        while hi < _MAX_CALL_CHUNKS and self.decompress_temp_bytes(hi, hi * self.chunk_bytes) <= temp_limit:
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # decompress_temp_bytes(lo) fits; hi does not, or is past the cap
            mid = (lo + hi) // 2
            if self.decompress_temp_bytes(mid, mid * self.chunk_bytes) <= temp_limit:
                lo = mid
            else:
                hi = mid
        self._within[temp_limit] = lo
        return lo

    def decompress(self, src: torch.Tensor, src_offsets: np.ndarray, sizes: np.ndarray, dst: torch.Tensor,
                   dst_offsets: np.ndarray, capacities: np.ndarray, stream: torch.cuda.Stream,
                   temp_limit: int | None = None) -> BatchResult:
        """Queue on ``stream`` the decompression of chunk ``i`` (``sizes[i]`` bytes at
        ``src_offsets[i]`` of ``src``) into ``dst`` at ``dst_offsets[i]`` (room for
        ``capacities[i]`` bytes). The decompressed sizes and statuses come back in the result.

        ``temp_limit``: the most workspace bytes to use (a user's GPU bound): chunks that would
        need more go in several calls, one after another on ``stream``.

        Raises:
            ValueError: ``temp_limit`` is below what one chunk needs.
        """
        n = len(sizes)
        self._check_sizes(capacities)
        if n == 0:
            return _no_chunks()
        per_call = n
        if temp_limit is not None and self.decompress_temp_bytes(n, int(capacities.sum())) > temp_limit:
            per_call = min(n, self.chunks_within(temp_limit))
            if per_call == 0:
                need = self.decompress_temp_bytes(1, self.chunk_bytes)
                raise ValueError(f"{self.name}: nvCOMP's decompression workspace for one chunk of {self.chunk_bytes} "
                                 f"bytes is {need} bytes, more than the {temp_limit} the GPU bound leaves it")
        with torch.cuda.stream(stream):
            table = _device_table(src.device, src.data_ptr() + src_offsets, sizes, capacities,
                                  dst.data_ptr() + dst_offsets)
            out = torch.empty((2, n), dtype=torch.int64, device=src.device)
            # split: room for any call of per_call chunks (none holds more than chunk_bytes each)
            total = int(capacities.sum()) if per_call == n else per_call * self.chunk_bytes
            temp_bytes = self.decompress_temp_bytes(per_call, total, stream.cuda_stream)
            with WORKSPACES.use(src.device, temp_bytes, stream) as work:
                for first in range(0, n, per_call):
                    count = min(per_call, n - first)
                    # the call's rows of the table and of the outputs (statuses: int32 in row 1's bytes)
                    at8 = 8 * first
                    status = self._decompress(table[0].data_ptr() + at8, table[1].data_ptr() + at8,
                                              table[2].data_ptr() + at8, out[0].data_ptr() + at8, count, _ptr(work),
                                              temp_bytes, table[3].data_ptr() + at8, self._decompress_opts,
                                              out[1].data_ptr() + 4 * first, stream.cuda_stream)
                    _check(status, f"{self.name} decompress")
            return _result_to_host(out, stream, n)


def _options(algorithm: str, type_code: int, gdeflate_type: int) -> tuple[_Opts, _Opts]:
    """The compress and decompress option structs (nvCOMP 6.0's field order)."""
    if algorithm == "GDeflate":
        return _Opts.of("<i", gdeflate_type), _Opts.of("")
    if algorithm == "ANS":  # rANS, element type, then sub-chunk count, states per lane, histogram: defaults
        return _Opts.of("<ii", 0, type_code), _Opts.of("<ii", 0, _TYPE_FROM_STREAM)
    if algorithm == "Bitcomp":  # default algorithm, element type, delta 0.0, lossless
        return _Opts.of("<iidi", 0, type_code, 0.0, 0), _Opts.of("")
    return _Opts.of(""), _Opts.of("")  # Zstd: no options in nvCOMP 6


class _Done:
    """An event that has already happened (a call with no chunks queues nothing)."""

    def synchronize(self) -> None:
        pass


def _no_chunks() -> BatchResult:
    return BatchResult(torch.zeros((2, 0), dtype=torch.int64), _Done(), 0)


def _ptr(buffer: torch.Tensor | None) -> int | None:
    return buffer.data_ptr() if buffer is not None else None


def _device_table(device: torch.device, *rows: np.ndarray) -> torch.Tensor:
    """``rows`` (int64 each) as one device tensor, sent up in one copy from pinned memory (the
    copy is queued on the current stream; torch's pinned cache keeps the buffer until it ran)."""
    host = torch.empty((len(rows), len(rows[0])), dtype=torch.int64, pin_memory=True)
    view = host.numpy()
    for i, row in enumerate(rows):
        view[i] = row
    return host.to(device, non_blocking=True)


def _result_to_host(out: torch.Tensor, stream: torch.cuda.Stream, n: int) -> BatchResult:
    host = torch.empty(out.shape, dtype=torch.int64, pin_memory=True)
    host.copy_(out, non_blocking=True)
    done = torch.cuda.Event()
    done.record(stream)
    return BatchResult(host, done, n)

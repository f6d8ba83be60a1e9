"""Zstandard: each chunk is one standard zstd frame (RFC 8878), as nvCOMP's RAW Zstd writes them.

The python ``zstandard`` binding releases the GIL while it works, so a thread pool scales
across cores. The frame records its content size, which decode checks against the chunk size.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import zstandard

from nvdcp.codecs.base import Buffer, Codec, DecodedStreams, useful_threads
from nvdcp.codecs.zstd_literals import LiteralsCompressor, literals_compressor

#: Level 1 with its large-input parameters (min_match 7, fast strategy). On the sign+exponent
#: plane of bf16 weights it compressed 2.75x at ~0.3 GB/s a core, against 2.43x for level 3
#: and 2.45x for level 9 (the project's 2-core CPU machine, a level sweep run once and not kept; `nvdcp bench` measures
#: the chosen level): on near-iid bytes,
#: short matches cost more than the Huffman-coded literals they replace.
DEFAULT_LEVEL = 1
#: Hash table size (log2 entries) for float sign+exponent planes (:meth:`ZstdCodec.for_sparse_planes`):
#: the smallest zstd allows. On those near-iid bytes the matches a larger table finds are short
#: ones that cost more than the Huffman-coded literals they replace: level 1 with 64 entries
#: instead of its 16,384 compressed randn fp32 top planes 2.98x instead of 2.77x, 2.4x faster,
#: and the frames decoded 1.6x faster; the `make demo` model's weights and AdamW moments 2.73x
#: instead of 2.63x, 2.5x faster (64 KiB chunks, one thread, CPU machine, 2026-12-01). The frames
#: are ordinary zstd frames: only the encoder's search changes, every decoder reads them.
SPARSE_PLANE_HASH_LOG = 6


class ZstdCodec(Codec):
    name = "zstd"
    codec_id = 1
    nvcomp_algorithm = "Zstd"

    def __init__(self, level: int = DEFAULT_LEVEL, hash_log: int | None = None, literals: bool = False) -> None:
        self.level = level
        self.hash_log = hash_log
        # zstandard's (de)compressor objects are not thread-safe: one per thread.
        self._local = threading.local()
        self._sparse: ZstdCodec | None = None
        self._float: ZstdCodec | None = None
        # ``literals``: frames without the match search (nvdcp.codecs.zstd_literals), where
        # zstd's cffi backend is there; its settings are level 1's
        self._literals: LiteralsCompressor | None = (
            literals_compressor() if literals and level == DEFAULT_LEVEL else None
        )

    def for_sparse_planes(self) -> ZstdCodec:
        """This codec tuned for a delta's difference planes (see ``SPARSE_PLANE_HASH_LOG``): the
        search stays, since their runs of zero bytes are matches worth 2-20x over Huffman-coded
        literals alone (measured on XOR planes of stepped fp32 and bf16 weights, 2026-12-05)."""
        if self.hash_log is not None:
            return self
        if self._sparse is None:
            self._sparse = ZstdCodec(self.level, SPARSE_PLANE_HASH_LOG)
        return self._sparse

    def for_float_planes(self) -> ZstdCodec:
        """This codec tuned for float sign+exponent planes: frames without the match search
        (nvdcp.codecs.zstd_literals), else the sparse-plane variant."""
        if self.hash_log is not None:
            return self
        if self._float is None:
            self._float = ZstdCodec(self.level, SPARSE_PLANE_HASH_LOG, literals=True)
            if self._float._literals is None:
                self._float = self.for_sparse_planes()
        return self._float

    def _compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "c", None)
        if c is None:
            # from_level() without a size hint keeps the large-input parameters; passing
            # level= lets zstd retune for 64 KiB inputs, which measured worse here.
            extra = {} if self.hash_log is None else {"hash_log": self.hash_log}
            params = zstandard.ZstdCompressionParameters.from_level(
                self.level, write_content_size=True, **extra
            )
            c = self._local.c = zstandard.ZstdCompressor(compression_params=params)
        return c

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = zstandard.ZstdDecompressor()
        return d

    def encode(self, chunk: Buffer) -> bytes:
        if self._literals is not None:
            return self._literals.compress(chunk)
        return self._compressor().compress(chunk)

    def encode_ranges(self, buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, threads: int = 1) -> Sequence[Buffer]:
        """All ranges in one call of zstd's batch API (``multi_compress_to_buffer``: the same
        frames as :meth:`encode`, compressed without the GIL, on ``threads`` threads): a small
        item's plane costs a few microseconds of Python per :meth:`encode` call otherwise."""
        if not len(offsets):
            return []
        threads = useful_threads(threads, int(lengths.sum()))
        if self._literals is not None:
            return self._literals.compress_ranges(buf, offsets, lengths, threads)
        segments = np.empty((len(offsets), 2), dtype="<u8")
        segments[:, 0] = offsets
        segments[:, 1] = lengths
        batch = zstandard.BufferWithSegments(buf.data, segments.tobytes())
        return self._compressor().multi_compress_to_buffer(batch, threads=threads)  # type: ignore[return-value]

    def decode_ranges(self, buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, raw_lengths: np.ndarray,
                      threads: int = 1) -> DecodedStreams:
        """All frames in one call of zstd's batch API (``multi_decompress_to_buffer``, without
        the GIL); every frame must declare its content size, and it must be ``raw_lengths[i]``.
        The frames stay where zstd decoded them (one buffer per thread, each segment at its
        documented ``offset`` in its buffer): joining them into one array cost as much as a
        third of the decompression."""
        if not len(offsets):
            return DecodedStreams(np.empty(0, dtype=np.int64), None)
        _require_frames(buf, offsets, lengths)
        segments = np.empty((len(offsets), 2), dtype="<u8")
        segments[:, 0] = offsets
        segments[:, 1] = lengths
        frames = zstandard.BufferWithSegments(buf.data, segments.tobytes())
        threads = useful_threads(threads, int(raw_lengths.sum()))
        try:
            decoded: Any = self._decompressor().multi_decompress_to_buffer(frames, threads=threads)
        except zstandard.ZstdError as exc:
            raise ValueError(f"zstd frame does not decode: {exc}") from exc
        n = len(offsets)
        sizes = np.fromiter(map(len, decoded), dtype=np.int64, count=n)
        if not np.array_equal(sizes, raw_lengths):
            raise ValueError("a zstd frame decodes to another size than its chunk's")
        # Each thread's frames lie back to back in one buffer, the first at offset 0 (no frame
        # is empty): a frame at offset 0 starts the next buffer.
        at = np.fromiter((segment.offset for segment in decoded), dtype=np.int64, count=n)
        firsts = np.flatnonzero(at == 0)
        bases = np.fromiter((np.frombuffer(decoded[i], dtype=np.uint8).ctypes.data for i in firsts.tolist()),
                            dtype=np.int64, count=len(firsts))
        buffer_of = np.cumsum(at == 0) - 1
        return DecodedStreams(bases[buffer_of] + at, decoded)

    def decode(self, data: Buffer, out: memoryview) -> None:
        try:
            raw = self._decompressor().decompress(data, max_output_size=len(out))
        except zstandard.ZstdError as exc:
            raise ValueError(f"zstd frame does not decode: {exc}") from exc
        if len(raw) != len(out):
            raise ValueError(f"zstd frame decodes to {len(raw)} bytes, expected {len(out)}")
        out[:] = raw


_FRAME_MAGIC = np.frombuffer((0xFD2FB528).to_bytes(4, "little"), dtype=np.uint8)


def _require_frames(buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
    """Every range starts with a zstd frame's magic number. zstandard's batch decoder aborted the
    process ("double free or corruption") on a range that starts with a skippable frame (0.24,
    2026-12-07): a crafted checkpoint must get a ValueError instead."""
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if (lengths < 4).any() or (offsets < 0).any() or (offsets + lengths > buf.size).any():
        raise ValueError("a zstd range is shorter than a frame header or lies outside its buffer")
    heads = buf[offsets[:, None] + np.arange(4)]
    if not (heads == _FRAME_MAGIC).all():
        raise ValueError("a zstd range does not start with a zstd frame")

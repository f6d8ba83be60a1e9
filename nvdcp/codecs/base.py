"""The codec contract: pure functions over byte buffers, no I/O, no DCP.

A codec compresses one *chunk* (at most the container's chunk size, 64 KiB by default) into a
self-contained bitstream and back. Chunks are independent so that a CPU thread pool and an nvCOMP
batched call can both work on many at once, and so a GPU-written chunk decodes on the CPU and the
reverse, wherever the codec has both implementations.

The numeric ``codec_id`` is what the container stores. An id names one frozen bitstream: a
changed bitstream gets a new id, never a new meaning for an old one (golden files in
``tests/golden`` pin them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nvdcp.errors import CodecUnavailableError

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class DecodedStreams:
    """What :meth:`Codec.decode_ranges` returns: stream ``i`` decoded at address
    ``addresses[i]`` (its ``raw_lengths[i]`` bytes), in memory that ``owner`` keeps alive. Where
    each stream lies is the codec's business: a batch decoder's own output buffers are used as
    they are, not copied into one array."""

    addresses: np.ndarray  # int64
    owner: Any

    @classmethod
    def back_to_back(cls, out: np.ndarray, raw_lengths: np.ndarray) -> DecodedStreams:
        """Streams decoded one after the other into ``out`` (contiguous uint8)."""
        starts = np.zeros(len(raw_lengths), dtype=np.int64)
        np.cumsum(raw_lengths[:-1], out=starts[1:])
        return cls(out.ctypes.data + starts, out)

    def stream(self, i: int, length: int) -> np.ndarray:
        """Stream ``i``'s bytes (``length`` of them) as a uint8 array viewing them."""
        import ctypes

        return np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(int(self.addresses[i])))


@dataclass(frozen=True)
class PackedStreams(Sequence[memoryview]):
    """What a batch encoder may return from :meth:`Codec.encode_ranges`: the streams back to
    back in ``data`` (uint8), stream ``i`` being ``lengths[i]`` bytes. A caller that gathers the
    streams into one buffer anyway takes ``data`` as it is."""

    data: np.ndarray
    lengths: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> memoryview:  # type: ignore[override]
        start = int(self.lengths[:i].sum())
        return self.data.data[start : start + int(self.lengths[i])]

    def __iter__(self) -> Iterator[memoryview]:
        view = self.data.data
        start = 0
        for n in self.lengths.tolist():
            yield view[start : start + n]
            start += n


#: Bytes of work below which a batch call runs on the calling thread alone: starting a thread
#: (and, in zstd's batch API, a context for it) costs 0.1-0.2 ms, about what 1 MiB takes to
#: compress. A delta save's plane probes (4 KiB samples) ran 5x slower on two threads than on
#: one (CPU machine, 2026-12-06), as the CRC32C batch found before (``_crc32c_batch.cpp``).
THREAD_MIN_BYTES = 1 << 20


def useful_threads(threads: int, nbytes: int) -> int:
    """How many of ``threads`` a batch of ``nbytes`` is worth: one per ``THREAD_MIN_BYTES``, at least one."""
    return max(1, min(threads, nbytes // THREAD_MIN_BYTES))


class Codec(ABC):
    """One compression algorithm with a stable id and bitstream.

    The class attributes are the codec's identity; :mod:`nvdcp.codecs` builds its registry from
    them. Every codec has a class, whether or not it has a CPU implementation.
    """

    #: User-facing name, e.g. ``"zstd"``.
    name: str
    #: The id the container stores (0-255). Frozen: a changed bitstream gets a new id.
    codec_id: int
    #: True when chunks can be encoded and decoded without a GPU.
    cpu_decodable: bool = True
    #: nvCOMP's name of the algorithm (``nvidia.nvcomp.Codec(algorithm=...)``); None when the
    #: GPU path does not run nvCOMP for this codec (``none`` is a plain copy).
    nvcomp_algorithm: str | None = None
    #: True when nvCOMP gets a ``data_type`` from the element dtype (see ``nvcomp_data_types``).
    typed: bool = False
    #: Typed codecs: the float ``data_type``s nvCOMP uses for elements of that width
    #: (``"<f2"``, ``"<f4"``, ``"<f8"``); everything else goes as ``"|u1"``.
    nvcomp_data_types: tuple[str, ...] = ()

    @classmethod  # noqa: B027  (a hook with a default: most codecs always run)
    def check_available(cls) -> None:
        """Raise :class:`~nvdcp.errors.CodecUnavailableError` when this machine cannot run the
        CPU implementation (no implementation, or its library is missing)."""

    def for_sparse_planes(self) -> Codec:
        """The instance to encode sparse planes with (a delta's difference planes: mostly zero
        bytes and short runs): a variant tuned for them that writes the same bitstream format,
        or ``self``."""
        return self

    def for_float_planes(self) -> Codec:
        """The instance to encode float sign+exponent planes with (near-iid bytes of low
        entropy, where repeats are rare): by default the sparse-plane variant."""
        return self.for_sparse_planes()

    @abstractmethod
    def encode(self, chunk: Buffer) -> bytes:
        """Compress one chunk into a self-contained bitstream."""

    def encode_ranges(self, buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, threads: int = 1) -> Sequence[Buffer]:
        """Compress ``buf[offsets[i] : offsets[i] + lengths[i]]`` for every ``i`` (``buf``: a
        contiguous uint8 array; every range non-empty and inside it): one stream per range, in
        order, each what :meth:`encode` returns for it. ``threads``: how many threads a codec
        that batches natively may use. This default calls :meth:`encode` per range."""
        view = buf.data
        return [self.encode(view[o : o + n]) for o, n in zip(offsets.tolist(), lengths.tolist())]

    def decode_ranges(self, buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, raw_lengths: np.ndarray,
                      threads: int = 1) -> DecodedStreams:
        """Decode the streams ``buf[offsets[i] : offsets[i] + lengths[i]]`` (stream ``i`` to
        exactly ``raw_lengths[i]`` bytes). Raises ``ValueError`` as :meth:`decode` does. This
        default calls :meth:`decode` per stream, back to back into one array."""
        out = np.empty(int(raw_lengths.sum()), dtype=np.uint8)
        view, dst = buf.data, out.data
        at = 0
        for o, n, r in zip(offsets.tolist(), lengths.tolist(), raw_lengths.tolist()):
            self.decode(view[o : o + n], dst[at : at + r])
            at += r
        return DecodedStreams.back_to_back(out, raw_lengths)

    @abstractmethod
    def decode(self, data: Buffer, out: memoryview) -> None:
        """Decompress ``data`` into ``out``, which has exactly the chunk's uncompressed size.

        Raises ``ValueError`` (any subclass) when ``data`` is not a valid bitstream or does not
        decode to exactly ``len(out)`` bytes; the container layer turns that into an error naming
        the file, item and chunk.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, id={self.codec_id})"


class GpuOnlyCodec(Codec):
    """A codec whose only implementation is nvCOMP's GPU library: no CPU encoder or decoder."""

    cpu_decodable = False

    @classmethod
    def _unavailable(cls) -> CodecUnavailableError:
        return CodecUnavailableError(
            f"codec {cls.name!r} has no CPU implementation; it needs an NVIDIA GPU with nvCOMP"
        )

    @classmethod
    def check_available(cls) -> None:
        raise cls._unavailable()

    def encode(self, chunk: Buffer) -> bytes:
        raise self._unavailable()

    def decode(self, data: Buffer, out: memoryview) -> None:
        raise self._unavailable()

"""The codec contract: pure functions over byte buffers, no I/O, no DCP.

A codec compresses one *chunk* (at most the container's chunk size, 64 KiB by default) into a
self-contained bitstream and back. Chunks are independent so that a CPU thread pool and an nvCOMP
batched call can both work on many at once, and so a GPU-written chunk decodes on the CPU and the
reverse, wherever the codec has both implementations.

The numeric ``codec_id`` is what the container stores; it and the bitstream are frozen once
released (golden files in ``tests/golden`` pin them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Executor

Buffer = bytes | bytearray | memoryview


class Codec(ABC):
    """One compression algorithm with a stable id and bitstream.

    Subclasses set ``name`` (user-facing, e.g. ``"zstd"``), ``codec_id`` (stored, 0-255), and
    ``version`` (bumped only if the bitstream ever changes; readers refuse newer versions).
    """

    name: str
    codec_id: int
    version: int = 1
    #: True when chunks can be decoded without a GPU.
    cpu_decodable: bool = True
    #: True when this machine can encode with it (without a GPU: has a CPU encoder).
    cpu_encodable: bool = True

    @abstractmethod
    def encode(self, chunk: Buffer) -> bytes:
        """Compress one chunk into a self-contained bitstream."""

    @abstractmethod
    def decode(self, data: Buffer, out: memoryview) -> None:
        """Decompress ``data`` into ``out``, which has exactly the chunk's uncompressed size.

        Raises ``ValueError`` (any subclass) when ``data`` is not a valid bitstream or does not
        decode to exactly ``len(out)`` bytes; the container layer turns that into an error naming
        the file, item and chunk.
        """

    def encode_batch(self, chunks: Sequence[Buffer], pool: Executor | None = None) -> list[bytes]:
        """Compress many chunks; the default fans single-chunk calls out over ``pool``.

        Codecs whose library has a native batched call override this.
        """
        if pool is None or len(chunks) < 4:
            return [self.encode(c) for c in chunks]
        return list(pool.map(self.encode, chunks))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, id={self.codec_id}, v{self.version})"

"""Identity codec: stores chunks as they are (still checksummed by the container)."""

from __future__ import annotations

from nvdcp.codecs.base import Buffer, Codec


class NoneCodec(Codec):
    name = "none"
    codec_id = 0
    # nvcomp_algorithm stays None: the GPU path copies raw chunks itself.

    def encode(self, chunk: Buffer) -> bytes:
        return bytes(chunk)

    def decode(self, data: Buffer, out: memoryview) -> None:
        if len(data) != len(out):
            raise ValueError(f"raw chunk holds {len(data)} bytes, expected {len(out)}")
        out[:] = data

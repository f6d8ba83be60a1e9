"""nvCOMP codecs for our codec ids: RAW bitstreams over independent chunks, batched calls
(:mod:`nvdcp.gpu.nvcomp_batch`)."""

from __future__ import annotations

import torch

from nvdcp.codecs import codec_class
from nvdcp.gpu.nvcomp_batch import BatchedCodec

# Each codec's nvCOMP algorithm, and whether it is typed, are attributes of its class in
# nvdcp.codecs. Zstd and GDeflate RAW chunks are the bitstreams the CPU codecs read and write
# (checked both ways on the H200: tests/gpu/test_gpu_path.py).

#: nvCOMP float ``data_type`` for elements of each float dtype.
_FLOAT_DATA_TYPES = {torch.float16: "<f2", torch.bfloat16: "<f2", torch.float32: "<f4", torch.float64: "<f8"}


def typed_data_type(name: str, dtype: torch.dtype | None) -> str | None:
    """The nvCOMP ``data_type`` of the typed codecs for elements of ``dtype``."""
    cls = codec_class(name)
    if not cls.typed:
        return None
    data_type = _FLOAT_DATA_TYPES.get(dtype) if dtype is not None else None
    return data_type if data_type in cls.nvcomp_data_types else "|u1"


class CodecCache:
    """Batched nvCOMP codecs (:class:`~nvdcp.gpu.nvcomp_batch.BatchedCodec`) for one chunk size,
    created on first use. The codecs hold no stream: each call names the one it is queued on,
    so one cache serves every stream and thread of its owner."""

    def __init__(self, chunk_bytes: int, gdeflate_type: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.gdeflate_type = gdeflate_type
        self._codecs: dict[tuple[str, str | None], BatchedCodec] = {}

    def get(self, name: str, data_type: str | None) -> BatchedCodec:
        """The codec ``name`` for elements of nvCOMP ``data_type`` (its ``max_output`` bounds one chunk)."""
        key = (name, data_type)
        codec = self._codecs.get(key)
        if codec is None:
            codec = self._codecs[key] = BatchedCodec(name, data_type, self.chunk_bytes, self.gdeflate_type)
        return codec

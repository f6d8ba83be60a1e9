"""nvCOMP codecs for our codec ids: RAW bitstreams over independent chunks, batched calls."""

from __future__ import annotations

from typing import Any

import torch

from nvdcp.codecs import codec_class

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


def make_codec(name: str, data_type: str | None, device_index: int, stream: int,
               chunk_bytes: int, gdeflate_type: int) -> Any:
    """An ``nvidia.nvcomp.Codec`` for one of our codec ids, bound to ``stream``.

    Callers cache these per stream (see :class:`CodecCache`); a codec bound to a stream must
    not be shared across threads.
    """
    algorithm = codec_class(name).nvcomp_algorithm
    if algorithm is None:
        raise ValueError(f"codec {name!r} does not run through nvCOMP")
    import nvidia.nvcomp as nv

    options: dict[str, Any] = {}
    if name == "gdeflate":
        options["algorithm_type"] = gdeflate_type
    if data_type is not None:
        options["data_type"] = data_type
    return nv.Codec(
        algorithm=algorithm, bitstream_kind=nv.BitstreamKind.RAW, uncomp_chunk_size=chunk_bytes,
        device_id=device_index, cuda_stream=stream, **options,
    )


def max_compressed_chunk(codec: Any, chunk_bytes: int, device_index: int) -> int:
    """Upper bound of one compressed chunk, rounded up to 16 bytes (and never below a raw chunk)."""
    import nvidia.nvcomp as nv

    probe = nv.as_array(torch.empty(chunk_bytes, dtype=torch.uint8, device=torch.device("cuda", device_index)))
    cap = int(codec.get_max_comp_buffer_size(probe))
    return max(chunk_bytes, -(-cap // 16) * 16)


class CodecCache:
    """nvCOMP codecs and their chunk bounds for one stream, created on first use."""

    def __init__(self, device_index: int, stream: torch.cuda.Stream, chunk_bytes: int, gdeflate_type: int) -> None:
        self.device_index = device_index
        self.stream = stream
        self.chunk_bytes = chunk_bytes
        self.gdeflate_type = gdeflate_type
        self._codecs: dict[tuple[str, str | None], tuple[Any, int]] = {}

    def get(self, name: str, data_type: str | None) -> tuple[Any, int]:
        """``(codec, max compressed chunk bytes)`` for ``name`` with ``data_type``."""
        key = (name, data_type)
        if key not in self._codecs:
            codec = make_codec(name, data_type, self.device_index, self.stream.cuda_stream,
                               self.chunk_bytes, self.gdeflate_type)
            self._codecs[key] = (codec, max_compressed_chunk(codec, self.chunk_bytes, self.device_index))
        return self._codecs[key]

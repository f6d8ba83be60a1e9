"""nvCOMP codecs for our codec ids: RAW bitstreams over independent chunks, batched calls."""

from __future__ import annotations

import functools
from typing import Any

import torch

#: Our codec name -> nvCOMP algorithm. Zstd and GDeflate RAW chunks are the bitstreams the CPU
#: codecs read and write (checked both ways on the H200: tests/gpu/test_gpu_interop.py).
ALGORITHMS = {"zstd": "Zstd", "gdeflate": "GDeflate", "ans": "ANS", "bitcomp": "Bitcomp"}


def typed_data_type(name: str, dtype: torch.dtype | None) -> str | None:
    """The nvCOMP ``data_type`` of the typed codecs for elements of ``dtype``."""
    if name not in ("ans", "bitcomp"):
        return None
    if dtype in (torch.float16, torch.bfloat16):
        return "<f2"
    if dtype == torch.float32:
        return "<f4"
    if name == "bitcomp" and dtype == torch.float64:
        return "<f8"
    return "|u1"


@functools.cache
def make_codec(name: str, data_type: str | None, device_index: int, stream: int,
               chunk_bytes: int, gdeflate_type: int) -> Any:
    """One cached ``nvidia.nvcomp.Codec`` per (codec, data type, device, stream)."""
    import nvidia.nvcomp as nv

    options: dict[str, Any] = {}
    if name == "gdeflate":
        options["algorithm_type"] = gdeflate_type
    if data_type is not None:
        options["data_type"] = data_type
    return nv.Codec(
        algorithm=ALGORITHMS[name], bitstream_kind=nv.BitstreamKind.RAW, uncomp_chunk_size=chunk_bytes,
        device_id=device_index, cuda_stream=stream, **options,
    )


@functools.cache
def max_compressed_chunk(codec: Any, chunk_bytes: int) -> int:
    """Upper bound of one compressed chunk, rounded up to 16 bytes (and never below a raw chunk)."""
    import nvidia.nvcomp as nv

    probe = nv.as_array(torch.empty(chunk_bytes, dtype=torch.uint8))
    cap = int(codec.get_max_comp_buffer_size(probe))
    return max(chunk_bytes, -(-cap // 16) * 16)

"""Bitcomp: nvCOMP's GPU codec for numerical data, one RAW Bitcomp stream per chunk.

GPU-only: no CPU encoder or decoder exists (nvCOMP ships none), so this class carries the
codec's identity and raises :class:`~nvdcp.errors.CodecUnavailableError` when asked to run.
Typed: nvCOMP gets ``<f2`` for float16/bfloat16, ``<f4`` for float32 and ``<f8`` for float64
elements, ``|u1`` else.
"""

from __future__ import annotations

from nvdcp.codecs.base import GpuOnlyCodec


class BitcompCodec(GpuOnlyCodec):
    name = "bitcomp"
    codec_id = 17
    nvcomp_algorithm = "Bitcomp"
    typed = True
    nvcomp_data_types = ("<f2", "<f4", "<f8")

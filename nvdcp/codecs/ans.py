"""ANS (asymmetric numeral systems): nvCOMP's GPU entropy coder, one RAW ANS stream per chunk.

GPU-only: no CPU encoder or decoder exists (nvCOMP ships none), so this class carries the
codec's identity and raises :class:`~nvdcp.errors.CodecUnavailableError` when asked to run.
Typed: nvCOMP gets ``<f2`` for float16/bfloat16 and ``<f4`` for float32 elements, ``|u1`` else.
"""

from __future__ import annotations

from nvdcp.codecs.base import GpuOnlyCodec


class AnsCodec(GpuOnlyCodec):
    name = "ans"
    codec_id = 16
    nvcomp_algorithm = "ANS"
    typed = True
    nvcomp_data_types = ("<f2", "<f4")

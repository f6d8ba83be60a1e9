"""Which transform and which codec each plane of an item gets."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from nvdcp.codecs import GPU_ONLY, codec_id
from nvdcp.format.header import TRANSFORM_BYTEPLANES, TRANSFORM_NONE
from nvdcp.transform.byteplanes import compressible_planes

#: What ``codec="auto"`` means on the CPU path: zstd frames decode everywhere (the CPU here, and
#: nvCOMP on a GPU) and zstd level 1 was the fastest codec that met the ratio targets on the
#: CPU reference workload (the CPU rows of benchmarks/results/codec_bench_2026-11-29_h200.json).
CPU_AUTO_CODEC = "zstd"
#: What ``codec="auto"`` means for tensors on a GPU: GDeflate (algorithm type 0) compressed
#: sign+exponent planes 2.92-3.05x at 40-45 GB/s of plane on the H200, against 2.52-2.55x at
#: 3-8 GB/s for nvCOMP's Zstd (benchmarks/results/gpu_probe_2026-11-29_h200.json), and its chunks
#: decode on the CPU through libnvcomp_cpu, so GPU-written checkpoints load anywhere.
GPU_AUTO_CODEC = "gdeflate"


@dataclass(frozen=True)
class Layout:
    """How one item is stored: a transform and one codec name per plane."""

    transform: int
    plane_codecs: tuple[str, ...]

    @property
    def descriptor_codec(self) -> str:
        """The codec named in the item's ``.metadata`` descriptor: the one doing the work."""
        return next((c for c in self.plane_codecs if c != "none"), "none")


def validate_codec_choice(codec: str) -> str:
    """Check a user's ``codec=`` argument; returns it unchanged."""
    if codec != "auto":
        codec_id(codec)  # raises UnknownCodecError (a ValueError) naming the known codecs
    return codec


@functools.cache  # called per tensor on paths that block training; a handful of distinct arguments
def choose_layout(dtype: torch.dtype | None, codec: str, auto_codec: str = CPU_AUTO_CODEC) -> Layout:
    """Pick the layout for an item of ``dtype`` (``None`` for BYTE_IO items).

    ``codec`` is the user's choice (a name or ``"auto"``); ``auto_codec`` is what auto resolves
    to on this path. Typed GPU codecs (ANS, Bitcomp) see whole elements, so they get no planes;
    byte items always use a CPU-decodable codec.
    """
    chosen = auto_codec if codec == "auto" else codec
    if chosen == "none":
        return Layout(TRANSFORM_NONE, ("none",))
    if dtype is None:
        return Layout(TRANSFORM_NONE, (chosen if chosen not in GPU_ONLY else CPU_AUTO_CODEC,))
    if chosen in GPU_ONLY:
        return Layout(TRANSFORM_NONE, (chosen,))
    planes = compressible_planes(dtype)
    if len(planes) == 1:
        return Layout(TRANSFORM_NONE, (chosen,))
    return Layout(TRANSFORM_BYTEPLANES, tuple(chosen if pays else "none" for pays in planes))


@functools.cache
def choose_delta_layout(dtype: torch.dtype, codec: str, auto_codec: str = CPU_AUTO_CODEC) -> Layout | None:
    """The layout of a delta item (the XOR of a tensor with its base), or None when the codec
    choice rules deltas out (``"none"``: nothing would be compressed).

    After the XOR every plane is worth compressing: the bytes that did not change are zero,
    mantissa planes included. Typed GPU codecs (ANS, Bitcomp) model float values, which an XOR
    is not: deltas use the path's auto codec then (CPU-decodable either way).
    """
    chosen = auto_codec if codec in ("auto", *GPU_ONLY) else codec
    if chosen == "none":
        return None
    size = torch.empty((), dtype=dtype).element_size()
    if size == 1:
        return Layout(TRANSFORM_NONE, (chosen,))
    return Layout(TRANSFORM_BYTEPLANES, (chosen,) * size)

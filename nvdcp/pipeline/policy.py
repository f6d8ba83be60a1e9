"""Which transform and which codec each plane of an item gets."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
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


#: A delta plane is given Zstd on the GPU when it stored at least this many times smaller than
#: raw in the item's last delta, else GDeflate. GDeflate's high-throughput mode (algorithm type
#: 0) codes every byte with at least one bit: planes that are nearly all zero (a delta's high
#: bytes; every byte of a bf16 weight that barely moved) stop at 7.75x under it, where Zstd
#: stores them 100-3,000x smaller; on planes that still carry entropy GDeflate stores 10-30% less
#: than Zstd (3.8x vs 2.9x, 5.4x vs 4.5x). Measured on the reference GPT's deltas on the H200:
#: benchmarks/results/delta_codec_probe_2026-12-01_h200_session8.json.
ZSTD_PLANE_ABOVE_RATIO = 7.0
#: Codecs the GPU's auto choice gives delta planes (both decode on the CPU).
DELTA_PLANE_CODECS = ("gdeflate", "zstd")


@functools.cache
def choose_delta_layout(dtype: torch.dtype, codec: str, auto_codec: str = CPU_AUTO_CODEC,
                        hint: tuple[str, ...] | None = None) -> Layout | None:
    """The layout of a delta item (its difference from its base), or None when the codec
    choice rules deltas out (``"none"``: nothing would be compressed).

    After the difference every plane is worth compressing: the bytes that did not change are
    zero, mantissa planes included. Typed GPU codecs (ANS, Bitcomp) model float values, which a
    difference is not: deltas use the path's auto codec then (CPU-decodable either way).

    With ``codec="auto"`` on the GPU (``auto_codec`` GDeflate) each plane's codec is chosen by
    how it compressed last time (``hint``, from :func:`next_delta_plane_codecs`); without a
    hint the top plane, which only changes where a value's exponent or sign did, gets Zstd and
    the others GDeflate (see :data:`ZSTD_PLANE_ABOVE_RATIO`).
    """
    chosen = auto_codec if codec in ("auto", *GPU_ONLY) else codec
    if chosen == "none":
        return None
    size = torch.empty((), dtype=dtype).element_size()
    if codec == "auto" and auto_codec == GPU_AUTO_CODEC:
        if hint is None or len(hint) != size or not set(hint) <= set(DELTA_PLANE_CODECS):
            hint = (GPU_AUTO_CODEC,) * (size - 1) + ("zstd",)
        return Layout(TRANSFORM_NONE if size == 1 else TRANSFORM_BYTEPLANES, hint)
    if size == 1:
        return Layout(TRANSFORM_NONE, (chosen,))
    return Layout(TRANSFORM_BYTEPLANES, (chosen,) * size)


def next_delta_plane_codecs(raw_nbytes: int, n_planes: int, chunk_sizes: np.ndarray) -> tuple[str, ...]:
    """The plane codecs an item's next delta gets on the GPU, from its last delta record: Zstd
    for planes stored :data:`ZSTD_PLANE_ABOVE_RATIO` times smaller than raw or more, GDeflate for
    the rest. ``chunk_sizes``: the record's stored chunk sizes in record order (block-major:
    chunk i is plane ``i % n_planes``, docs/FORMAT.md); ``raw_nbytes``: the item's size."""
    if raw_nbytes <= 0 or n_planes < 1 or not len(chunk_sizes) or len(chunk_sizes) % n_planes:
        return ()
    stored = np.asarray(chunk_sizes, dtype=np.int64).reshape(-1, n_planes).sum(axis=0)
    plane_bytes = raw_nbytes / n_planes
    return tuple("zstd" if plane_bytes >= ZSTD_PLANE_ABOVE_RATIO * max(1, int(s)) else GPU_AUTO_CODEC for s in stored)

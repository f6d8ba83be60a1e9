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
#: raw in the item's last delta under GDeflate (which caps there), else GDeflate. GDeflate's
#: high-throughput mode (algorithm type 0) codes every byte with at least one bit: planes that are
#: nearly all zero (a delta's high bytes; every byte of a bf16 weight that barely moved) stop at
#: 7.75x under it, where Zstd stores them 100-3,000x smaller; on planes that still carry entropy
#: GDeflate stores 10-30% less than Zstd (3.8x vs 2.9x, 5.4x vs 4.5x). Measured on the reference
#: GPT's deltas on the H200: benchmarks/results/delta_codec_probe_2026-12-01_h200_session8.json.
ZSTD_PLANE_ABOVE_RATIO = 7.0
#: A plane keeps Zstd while its last Zstd delta stored it at least this many times smaller.
#: nvCOMP's Zstd compresses far slower than GDeflate where a plane is only moderately sparse
#: (3.4-7 GB/s at 2.7-4.5x, 20-29 GB/s at 100x and more; GDeflate 27-42 GB/s throughout,
#: delta_codec_probe_2026-12-01_h200_session8.json), and it was what kept a GPU delta save above
#: a full one: a CUDA trace of an fp32 delta save had Zstd's kernels at 57 of 83 ms of kernel
#: time, a full save's kernels 19 ms (delta_bench_2026-12-02_h200_session10_trace.json). Below
#: this ratio GDeflate's 7.75x costs at most raw/7.75 - raw/20 = 8% of the plane more.
ZSTD_KEEP_RATIO = 20.0
#: A plane whose Zstd delta stored less than :data:`ZSTD_KEEP_RATIO` gets GDeflate for this many
#: deltas before Zstd is tried again (GDeflate's capped ratio cannot tell how far a plane would go).
ZSTD_RETRY_AFTER = 4
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


def next_delta_plane_codecs(raw_nbytes: int, n_planes: int, chunk_sizes: np.ndarray,
                            used: tuple[str, ...] | None = None, waits: tuple[int, ...] | None = None,
                            ) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The plane codecs an item's next delta gets on the GPU, from its last delta record, and
    each plane's deltas left before Zstd is tried again.

    Per plane: stored with Zstd (``used``) at :data:`ZSTD_KEEP_RATIO` or more: Zstd again; with
    Zstd below it: GDeflate for :data:`ZSTD_RETRY_AFTER` deltas; otherwise Zstd once its wait is
    over and it stored :data:`ZSTD_PLANE_ABOVE_RATIO` times smaller than raw or more (GDeflate's
    cap is near), else GDeflate. ``chunk_sizes``: the record's stored chunk sizes in record order
    (block-major: chunk i is plane ``i % n_planes``, docs/FORMAT.md); ``raw_nbytes``: the item's
    size; ``waits``: what the previous call returned for the item. ``((), ())`` when the record
    cannot be read that way."""
    if raw_nbytes <= 0 or n_planes < 1 or not len(chunk_sizes) or len(chunk_sizes) % n_planes:
        return (), ()
    stored = np.asarray(chunk_sizes, dtype=np.int64).reshape(-1, n_planes).sum(axis=0).tolist()
    plane_bytes = raw_nbytes / n_planes
    used = used if used is not None and len(used) == n_planes else (GPU_AUTO_CODEC,) * n_planes
    waits = waits if waits is not None and len(waits) == n_planes else (0,) * n_planes
    codecs, left = [], []
    for s, codec, wait in zip(stored, used, waits):
        ratio = plane_bytes / max(1, s)
        if codec == "zstd":
            keep = ratio >= ZSTD_KEEP_RATIO
            codecs.append("zstd" if keep else GPU_AUTO_CODEC)
            left.append(0 if keep else ZSTD_RETRY_AFTER)
        elif wait > 0:
            codecs.append(GPU_AUTO_CODEC)
            left.append(wait - 1)
        else:
            codecs.append("zstd" if ratio >= ZSTD_PLANE_ABOVE_RATIO else GPU_AUTO_CODEC)
            left.append(0)
    return tuple(codecs), tuple(left)

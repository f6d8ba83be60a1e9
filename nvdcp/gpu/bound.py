"""One number bounds a GPU save's memory: its scratch and nvCOMP's workspaces together.

``GpuConfig(gpu_memory_bytes=N)`` is the most GPU memory a save adds: the buckets' scratch
(planes, compressed chunks, the bases of deltas) of every encoder writing at once, and the
workspace nvCOMP asks for beside them (one per GPU, shared by those encoders:
:class:`~nvdcp.gpu.nvcomp_batch.Workspaces`). nvCOMP's Zstd asks for 1.07 GiB and more, the more
chunks a call carries (``python -m benchmarks.nvcomp_call_probe --workspaces``), more than a small
bound holds: a delta's top planes, which the auto choice gives Zstd, then get GDeflate (a
plane of 100-3,000x under Zstd stores 7.75x under GDeflate type 0: the save stays within its
bound and loads as any other). A save whose codec was set to ``"zstd"`` by the user is refused
with a ``ValueError`` instead. Left at ``None``, the bound is the default scratch with the
workspaces beside it (``GpuConfig.gpu_budget``).

Loads (:func:`load_bound`): nvCOMP's Zstd decompression workspace grows with the chunks of a call
(about 0.2 MiB a 64 KiB chunk: 49 MiB for 256, 795 MiB for 4,096 on an H200), so under a user's
bound a quarter of it is set aside for the workspace and decode calls that would need more are
split (:meth:`~nvdcp.gpu.nvcomp_batch.BatchedCodec.decompress`); the passes' scratch is the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nvdcp.gpu.config import GpuConfig
from nvdcp.gpu.nvcomp_codecs import CodecCache, typed_data_type
from nvdcp.pipeline.policy import GPU_AUTO_CODEC, Layout

#: The least scratch a save leaves each of its concurrent encoders (``GpuConfig``'s own floor).
MIN_SCRATCH_BYTES = 16 << 20
#: The share of a user's load bound set aside for nvCOMP's decompression workspace: a pass of
#: Zstd chunks then decodes in one or two calls (a chunk's workspace is about 1.5x its slots).
LOAD_WORKSPACE_SHARE = 4


def load_bound(gpu: GpuConfig, device: torch.device) -> tuple[int, int | None]:
    """A load's GPU scratch on ``device`` and the most workspace its decode calls may use
    (None: what nvCOMP asks for, beside the scratch; the default when no bound is set)."""
    if gpu.gpu_memory_bytes is None:
        return gpu.gpu_budget(device, load=True), None
    workspace = gpu.gpu_memory_bytes // LOAD_WORKSPACE_SHARE
    return gpu.gpu_memory_bytes - workspace, workspace


@dataclass(frozen=True)
class SaveBound:
    """A user's bound on a save's GPU memory, as one encoder sees it.

    Args:
        device_bytes: ``GpuConfig.gpu_memory_bytes``: scratch of every encoder plus workspaces.
        shares: encoders of the save writing at once on the device (each gets an equal scratch).
        zstd_is_auto: the save's codec is ``"auto"``, so any Zstd plane was nvdcp's choice (a
            delta's top plane) and may become GDeflate.
    """

    device_bytes: int
    shares: int = 1
    zstd_is_auto: bool = True


def codec_keys(jobs: Sequence[Any]) -> set[tuple[str, str | None]]:
    """The nvCOMP codecs (name, element type) the jobs' layouts call."""
    layouts = {(job.layout.plane_codecs, job.dtype) for job in jobs}
    return {(name, typed_data_type(name, dtype)) for names, dtype in layouts for name in names if name != "none"}


#: Codecs whose compression workspace grows with the chunks of a call (nvCOMP's Zstd; GDeflate,
#: ANS and Bitcomp ask for none): buckets holding their chunks stay within the slot bound that
#: :func:`workspace_bytes` is sized for.
WORKSPACE_CODECS = frozenset({"zstd"})


def workspace_bytes(codecs: CodecCache, keys: Iterable[tuple[str, str | None]], max_chunks: int) -> int:
    """Workspace bytes the codecs ``keys`` ask for, compressing calls of up to ``max_chunks``
    chunks: the largest request (the calls share one buffer per GPU). Of nvCOMP's codecs only
    Zstd asks for one: 1,074 MiB for a call of one 64 KiB chunk, 1,490 MiB for 4,096 (H200)."""
    return max((codecs.get(name, data_type).compress_temp_bytes(max_chunks, max_chunks * codecs.chunk_bytes)
                for name, data_type in keys), default=0)


def fit_scratch(jobs: Sequence[Any], bound: SaveBound, codecs: CodecCache, max_chunks: int) -> int:
    """The scratch bytes each encoder of the save may use within ``bound``, once the workspaces
    of the jobs' codecs are set aside. When Zstd's does not fit, jobs with auto-chosen Zstd
    planes are given GDeflate for them (their ``layout`` is replaced).

    Raises:
        ValueError: the workspaces leave less than :data:`MIN_SCRATCH_BYTES` per encoder and
            nothing can be swapped (``codec="zstd"`` set by the user, or another codec's).
    """
    keys = codec_keys(jobs)
    floor = bound.shares * MIN_SCRATCH_BYTES
    reserve = workspace_bytes(codecs, keys, max_chunks)
    if bound.device_bytes - reserve >= floor:
        return (bound.device_bytes - reserve) // bound.shares
    if bound.zstd_is_auto and any(name == "zstd" for name, _ in keys):
        for job in jobs:
            if "zstd" in job.layout.plane_codecs:
                job.layout = without_zstd(job.layout)
        keys = codec_keys(jobs)
        reserve = workspace_bytes(codecs, keys, max_chunks)
        if bound.device_bytes - reserve >= floor:
            return (bound.device_bytes - reserve) // bound.shares
    names = ", ".join(sorted({name for name, _ in keys}))
    raise ValueError(
        f"GpuConfig(gpu_memory_bytes={bound.device_bytes}) is too small for this save: nvCOMP's workspace for "
        f"{names} takes {reserve >> 20} MiB of it, leaving less than {MIN_SCRATCH_BYTES >> 20} MiB of scratch for "
        f"each of its {bound.shares} concurrent encodes; raise gpu_memory_bytes or use codec='auto' or 'gdeflate'"
    )


def without_zstd(layout: Layout) -> Layout:
    """``layout`` with GDeflate where it had Zstd (both decode on the CPU)."""
    return Layout(layout.transform, tuple(GPU_AUTO_CODEC if name == "zstd" else name for name in layout.plane_codecs))

"""The GPU bounds' decisions (nvdcp.gpu.bound), saves and loads, on any machine.

nvCOMP's workspace query needs a GPU, so here a stand-in answers it with the sizes measured on
the H100 and H200 (Zstd 1,074 MiB plus about 0.1 MiB a chunk; GDeflate none). The real query
runs in tests/gpu/test_delta_gpu.py (the bound held under 128 MiB, the refusal).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from nvdcp.gpu.bound import MIN_SCRATCH_BYTES, SaveBound, codec_keys, fit_scratch, load_bound, without_zstd
from nvdcp.gpu.config import GpuConfig
from nvdcp.pipeline.policy import TRANSFORM_BYTEPLANES, Layout

MiB = 1 << 20


@dataclass
class _Job:
    layout: Layout
    dtype: torch.dtype = torch.float32


class _Workspace:
    def __init__(self, name: str) -> None:
        self.name = name

    def compress_temp_bytes(self, count: int, total_bytes: int) -> int:
        return 1074 * MiB + count * (MiB // 10) if self.name == "zstd" else 0


class _Codecs:
    """Stands in for CodecCache: only the workspace query the bound makes."""

    chunk_bytes = 64 << 10

    def get(self, name: str, data_type: str | None) -> _Workspace:
        return _Workspace(name)


DELTA = Layout(TRANSFORM_BYTEPLANES, ("gdeflate", "gdeflate", "gdeflate", "zstd"))
WHOLE = Layout(TRANSFORM_BYTEPLANES, ("gdeflate", "none", "none", "none"))


def test_a_bound_that_holds_zstds_workspace_keeps_zstd_and_gives_the_rest_as_scratch() -> None:
    jobs = [_Job(DELTA), _Job(WHOLE)]
    reserve = 1074 * MiB + 256 * (MiB // 10)
    scratch = fit_scratch(jobs, SaveBound(reserve + 200 * MiB, shares=2), _Codecs(), 256)
    assert scratch == 100 * MiB
    assert jobs[0].layout == DELTA


def test_a_bound_below_zstds_workspace_gives_auto_zstd_planes_gdeflate() -> None:
    jobs = [_Job(DELTA), _Job(WHOLE)]
    scratch = fit_scratch(jobs, SaveBound(128 * MiB), _Codecs(), 256)
    assert scratch == 128 * MiB  # GDeflate asks for no workspace
    assert jobs[0].layout == without_zstd(DELTA) and "zstd" not in jobs[0].layout.plane_codecs
    assert jobs[1].layout == WHOLE
    assert codec_keys(jobs) == {("gdeflate", None)}


def test_zstd_set_by_the_user_is_refused_under_a_bound_below_its_workspace() -> None:
    jobs = [_Job(Layout(TRANSFORM_BYTEPLANES, ("zstd",) * 4))]
    with pytest.raises(ValueError, match=r"gpu_memory_bytes=134217728.*zstd.*1099 MiB"):
        fit_scratch(jobs, SaveBound(128 * MiB, zstd_is_auto=False), _Codecs(), 256)
    assert jobs[0].layout.plane_codecs == ("zstd",) * 4  # nothing swapped


def test_each_concurrent_encode_needs_its_floor_of_scratch() -> None:
    reserve = 1074 * MiB + 256 * (MiB // 10)
    jobs = [_Job(DELTA)]
    # room for the workspace and one encode's floor, not four: Zstd is given up
    assert fit_scratch(jobs, SaveBound(reserve + MIN_SCRATCH_BYTES, shares=4), _Codecs(), 256) \
        == (reserve + MIN_SCRATCH_BYTES) // 4
    assert "zstd" not in jobs[0].layout.plane_codecs


def test_a_load_under_a_bound_keeps_a_quarter_of_it_for_the_decompression_workspace() -> None:
    scratch, workspace = load_bound(GpuConfig(gpu_memory_bytes=100 * MiB), torch.device("cuda", 0))
    assert workspace == 25 * MiB and scratch + workspace == 100 * MiB

"""The plane kernel's split (nvdcp/gpu/merge.py) against the torch copies it replaces in
GpuEncoder._split_planes, and the small-tensor records it makes against the CPU encoder's.

Run on the H200 device machine (DEVELOPERS.md); skipped without CUDA and Triton.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvdcp.gpu import encoder as encoder_module
from nvdcp.gpu.encoder import GpuEncoder, GpuJob, _Bucket, _Segment
from nvdcp.gpu.merge import split_available
from nvdcp.pipeline.policy import choose_layout

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


def _bucket(seed: int, c: int) -> tuple[list[GpuJob], _Bucket]:
    """Plain jobs of every plane count, one block or several, with and without a tail, empty
    rows between their slots, a job over the kernel's size bound and a job split over two
    segments (both split by torch)."""
    rng = np.random.default_rng(seed)
    shapes = [
        (torch.float32, 7), (torch.float32, c), (torch.float32, 3 * c + 5), (torch.bfloat16, 1),
        (torch.bfloat16, 2 * c), (torch.uint8, c + 1), (torch.float64, 100), (torch.complex128, 33),
        (torch.float32, (encoder_module.FUSED_SPLIT_MAX_BYTES // 4) + c),  # over the bound
        (torch.float32, 4 * c),  # split over two segments below
    ]
    jobs = []
    for dtype, elements in shapes:
        size = torch.empty((), dtype=dtype).element_size()
        data = torch.from_numpy(rng.integers(0, 256, size=elements * size, dtype=np.uint8)).to(CUDA)
        jobs.append(GpuJob(str(dtype), data, choose_layout(dtype, "zstd"), dtype, 0, (elements,)))
    bucket = _Bucket()
    for j, job in enumerate(jobs):
        blocks = -(-job.elements // c)
        parts = [(0, blocks)] if j != len(jobs) - 1 else [(0, 2), (2, 2)]
        for first, n in parts:
            bucket.slots += 1  # an untouched row between segments
            bucket.segments.append(_Segment(j, first, n, bucket.slots))
            bucket.slots += n * job.n_planes
    return jobs, bucket


@pytest.mark.skipif(not torch.cuda.is_available() or not split_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("c", [1024, 65536])
def test_kernel_split_writes_what_the_torch_copies_write(seed: int, c: int, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs, bucket = _bucket(seed, c)
    encoder = object.__new__(GpuEncoder)
    encoder.chunk_bytes = c
    fill = torch.randint(0, 256, (bucket.slots, c), dtype=torch.uint8, device=CUDA)
    got, want = fill.clone(), fill.clone()
    encoder._split_planes(jobs, bucket, got)
    monkeypatch.setattr(encoder_module, "split_available", lambda: False)
    encoder._split_planes(jobs, bucket, want)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert not torch.equal(got, fill)

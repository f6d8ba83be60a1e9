"""The plane kernel's split (nvdcp/gpu/merge.py) against the torch copies it replaces in
GpuEncoder._split_planes: the same slot bytes for jobs of every plane count, one block or
several, with and without a tail, jobs read by address from tensors of their own dtype and shape
(as ItemEncoder.gpu_job makes them) or from flat byte views, a job split over two segments and a
job over the kernel's size bound (torch's), the kernel's slots packed at the granule. On the
device, and on the host under Triton's interpreter (no GPU needed; skipped without triton, as in
CI)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvdcp.gpu import encoder as encoder_module
from nvdcp.gpu.encoder import GpuEncoder, GpuJob, granule_for
from nvdcp.gpu.plan import Bucket, JobColumns, SlotLayout, slot_ranges
from nvdcp.pipeline.policy import choose_layout
from tests.gpu.interpreted import run_interpreted


def _tensor(rng: np.random.Generator, dtype: torch.dtype, elements: int, device: torch.device, typed: bool) -> torch.Tensor:
    """Random bytes as ``elements`` elements of ``dtype``: a tensor of that dtype (2-D where it
    divides) when ``typed``, else its flat uint8 view."""
    size = torch.empty((), dtype=dtype).element_size()
    flat = torch.from_numpy(rng.integers(0, 256, size=elements * size, dtype=np.uint8)).to(device)
    if not typed:
        return flat
    t = flat.view(dtype)
    return t.view(-1, 8) if elements % 8 == 0 else t


def _bucket(seed: int, c: int, device: torch.device) -> tuple[list[GpuJob], Bucket]:
    rng = np.random.default_rng(seed)
    shapes = [
        (torch.float32, 7), (torch.float32, c), (torch.float32, 3 * c + 5), (torch.bfloat16, 1),
        (torch.bfloat16, 2 * c), (torch.uint8, c + 1), (torch.float64, 100), (torch.complex128, 33),
        (torch.float32, (encoder_module.KERNEL_SPLIT_MAX_BYTES // 4) + c),  # over the bound
        (torch.float32, 4 * c),  # split over two segments below
    ]
    jobs = []
    for i, (dtype, elements) in enumerate(shapes):
        data = _tensor(rng, dtype, elements, device, typed=i % 2 == 0)
        jobs.append(GpuJob(str(dtype), data, choose_layout(dtype, "zstd"), dtype, 0, (elements,)))
    segments, slots = [], 0
    for j, job in enumerate(jobs):
        blocks = -(-job.elements // c)
        parts = [(0, blocks)] if j != len(jobs) - 1 else [(0, 2), (2, 2)]
        for first, n in parts:
            slots += 1  # an untouched row between segments
            segments.append((j, first, n, slots))
            slots += n * job.n_planes
    # an empty tensor last: its segment starts after the last slot
    jobs.append(GpuJob("empty", torch.empty(0, device=device), choose_layout(torch.float32, "zstd"), torch.float32, 0, (0,)))
    segments.append((len(jobs) - 1, 0, 0, slots))
    return jobs, Bucket.of(JobColumns.of(jobs), segments, slots)


def check_split(device: torch.device, seed: int, c: int) -> None:
    """Assert the kernel, writing the slots of the segments it takes packed at the granule
    (SlotLayout), puts in every slot the bytes the torch copies put in that slot's row (the
    kernel must run here)."""
    jobs, bucket = _bucket(seed, c, device)
    encoder = object.__new__(GpuEncoder)
    encoder.chunk_bytes = c
    assert encoder_module._kernel_splits(device)
    raw_sizes, _, _ = encoder._slot_table(bucket)
    packed = encoder_module._KernelSplit.takes(bucket)
    assert packed.any() and not packed.all()
    layout = SlotLayout.of(bucket, raw_sizes, packed, c, granule_for(c))
    rows = SlotLayout.rows(bucket.slots, c, kernel=False)
    assert layout.kernel and layout.n_rows < bucket.slots and layout.end < rows.end
    rng = np.random.default_rng(seed + 100)
    got = torch.from_numpy(rng.integers(0, 256, size=layout.end, dtype=np.uint8)).to(device)
    want = torch.from_numpy(rng.integers(0, 256, size=rows.end, dtype=np.uint8)).to(device)
    encoder._split_planes(jobs, bucket, got, layout)
    encoder._split_planes(jobs, bucket, want, rows)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    got_np, want_np = got.cpu().numpy(), want.cpu().numpy()
    for s in slot_ranges(bucket.first_slot, bucket.slot_counts).tolist():
        n = int(raw_sizes[s])
        assert np.array_equal(got_np[layout.at[s] : layout.at[s] + n], want_np[rows.at[s] : rows.at[s] + n]), s
    # packed slots follow the rows, each its bytes rounded up to the granule
    dense = layout.row_of < 0
    assert (layout.at[dense] >= layout.n_rows * c).all() and (layout.at[~dense] < layout.n_rows * c).all()
    assert layout.end == layout.n_rows * c + int((-(-raw_sizes[dense] // granule_for(c)) * granule_for(c)).sum())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("c", [1024, 65536])
def test_kernel_split_writes_what_the_torch_copies_write(seed: int, c: int) -> None:
    pytest.importorskip("triton")
    check_split(torch.device("cuda", 0), seed, c)


def test_kernel_split_on_the_host_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    code = ("import torch; from tests.gpu.test_split_kernel import check_split\n"
            "for seed in range(2):\n    check_split(torch.device('cpu'), seed, 1024)\nprint('split ok')")
    done = run_interpreted(["-c", code], ("NVDCP_GPU_SPLIT",))
    assert "split ok" in done.stdout

"""GpuEncoder._plan, the packing of jobs' blocks into buckets, on the host (no GPU needed): every
block of every job placed once, in order; no bucket over its slot bound or, unless it holds a
single segment, over its budget; an item that fits an empty bucket never cut over two."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvdcp.gpu.encoder import GpuEncoder, GpuJob, granule_for
from nvdcp.pipeline.policy import choose_layout

C = 1024


def _encoder(budget: int, pinned: int) -> GpuEncoder:
    encoder = object.__new__(GpuEncoder)  # planning only: no streams, no device
    encoder.chunk_bytes, encoder.granule, encoder.bound = C, granule_for(C), None
    encoder.bucket_budget, encoder.pinned_bytes = budget, pinned
    return encoder


def _jobs(seed: int, n: int) -> list[GpuJob]:
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(n):
        dtype = (torch.float32, torch.bfloat16, torch.uint8)[i % 3]
        elements = int(rng.choice([0, 1, C - 1, C, 3 * C + 7, int(rng.integers(1, 40 * C))]))
        data = torch.empty(elements, dtype=dtype)
        jobs.append(GpuJob(i, data, choose_layout(dtype, "zstd"), dtype, 0, (elements,)))
    return jobs


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget_chunks", [64, 300, 5000])
def test_the_plan_places_every_block_once_in_order_within_the_bounds(seed: int, budget_chunks: int) -> None:
    encoder = _encoder(budget_chunks * C, 1024 * C)
    jobs = _jobs(seed, 300)
    max_slots, budget = encoder.max_slots_for(2), encoder._bucket_budget(jobs, 2)
    buckets = encoder._plan(jobs)
    whole_cost = _whole_costs(encoder, jobs)
    placed: list[tuple[int, int, int]] = []
    for bucket in buckets:
        slot = 0
        cost = 0
        for seg in bucket.segments:
            job = jobs[seg.job]
            assert seg.first_slot == slot  # segments packed back to back
            slot += seg.n_blocks * job.n_planes
            held_whole = seg.first_block == 0 and seg.n_blocks * C >= job.elements
            cost += whole_cost[seg.job] if held_whole else seg.n_blocks * encoder._block_cost(job)
            placed.append((seg.job, seg.first_block, seg.n_blocks))
        assert slot == bucket.slots and cost == bucket.cost
        assert bucket.slots <= max_slots or len(bucket.segments) == 1
        assert bucket.cost <= budget or len(bucket.segments) == 1
    expected_next = {j: 0 for j in range(len(jobs))}
    order = [j for j, _, _ in placed]
    assert order == sorted(order)  # jobs in order
    for j, first, n in placed:
        assert first == expected_next[j]
        expected_next[j] += n
    for j, job in enumerate(jobs):
        blocks = -(-job.elements // C)
        assert expected_next[j] == blocks, f"job {j}: {expected_next[j]} of {blocks} blocks placed"
        fits_empty = min(budget // encoder._block_cost(job), max_slots // job.n_planes)
        if 0 < blocks <= fits_empty:
            assert sum(1 for k, _, _ in placed if k == j) == 1, f"job {j} fits a bucket but was cut"


def _whole_costs(encoder: GpuEncoder, jobs: list[GpuJob]) -> list[int]:
    """Each job's cost held whole, one job at a time: its full blocks at the block cost; its
    last block's packed copy, gather index (and a delta's base and XOR) by that block's bytes
    rounded up to the granule, its slot and output slot whole chunks."""
    g = encoder.granule
    out = []
    for job in jobs:
        blocks, p = -(-job.elements // C), job.n_planes
        if not blocks:
            out.append(0)
            continue
        tail = job.elements - (blocks - 1) * C
        unused = C - -(-tail // g) * g
        per_byte = 3 if job.delta is not None else 1
        out.append(blocks * encoder._block_cost(job) - p * (unused * per_byte + unused // g * 8))
    return out


def test_a_small_tensor_costs_its_bytes_not_whole_chunks_where_they_are_its_bytes() -> None:
    """A 1 KiB fp32 tensor (64 KiB chunks, GPU auto layout): four whole slots and one nvCOMP
    output slot of two chunks, but a packed copy and gather index of its 1 KiB: 385 KiB of a
    bucket, not the 648 KiB of a full block; a full block still costs a full block."""
    from nvdcp.gpu.plan import JobColumns

    encoder = _encoder(1 << 30, 512 << 20)
    encoder.chunk_bytes, encoder.granule = 1 << 16, 256
    layout = choose_layout(torch.float32, "auto", "gdeflate")
    jobs = [GpuJob("small", torch.empty(256), layout, torch.float32, 0, (256,)),
            GpuJob("block", torch.empty(1 << 16), layout, torch.float32, 0, (1 << 16,))]
    whole, per_block = encoder._job_costs(jobs, JobColumns.of(jobs))
    assert per_block.tolist() == [4 * (2 * 65536 + 2048) + 2 * 65536] == [663552]
    assert whole.tolist() == [663552 - 4 * (65280 + 2040), 663552]
    assert whole[0] // 1024 == 385


def _reference_plan(encoder: GpuEncoder, jobs: list[GpuJob]) -> list[list[tuple[int, int, int, int]]]:
    """The greedy rule one job (and, for a job cut over buckets, one block range) at a time:
    what the columnar planner must reproduce, segment for segment."""
    max_slots, budget = encoder.max_slots_for(2), encoder._bucket_budget(jobs, 2)
    whole_cost = _whole_costs(encoder, jobs)
    buckets: list[list[tuple[int, int, int, int]]] = [[]]
    slots = cost = 0
    for j, job in enumerate(jobs):
        blocks, p, per_block = -(-job.elements // C), job.n_planes, encoder._block_cost(job)
        if blocks == 0:
            buckets[-1].append((j, 0, 0, slots))
            continue
        if cost + whole_cost[j] <= budget and slots + blocks * p <= max_slots:
            buckets[-1].append((j, 0, blocks, slots))
            slots, cost = slots + blocks * p, cost + whole_cost[j]
            continue
        b = 0
        fits_empty = min(budget // per_block, max_slots // p)
        while b < blocks:
            room = min((budget - cost) // per_block, (max_slots - slots) // p)
            if buckets[-1] and (room <= 0 or (b == 0 and room < blocks <= fits_empty)):
                buckets.append([])
                slots = cost = 0
                continue
            take = min(blocks - b, max(room, 1))
            buckets[-1].append((j, b, take, slots))
            slots, cost = slots + take * p, cost + (whole_cost[j] if take == blocks else take * per_block)
            b += take
    return [b for b in buckets if b]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget_chunks", [3, 64, 300, 5000])
def test_the_columnar_plan_is_the_greedy_rule_segment_for_segment(seed: int, budget_chunks: int) -> None:
    """plan_buckets places runs of jobs by binary search: the same buckets and segments as
    placing one job at a time, also with empty jobs after a bucket over its bounds (a budget
    below one block of a four-plane job) and jobs cut over many buckets."""
    encoder = _encoder(budget_chunks * C, 512 * C)
    jobs = _jobs(seed, 400)
    got = [[tuple(seg) for seg in bucket.segments] for bucket in encoder._plan(jobs)]
    assert got == _reference_plan(encoder, jobs)
    assert len(got) > 1


def test_the_plan_reads_layouts_after_the_bound_swapped_zstd_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a tight ``gpu_memory_bytes`` the budget step gives auto-chosen Zstd planes GDeflate
    (nvdcp.gpu.bound.fit_scratch replaces the jobs' layouts): the plan's columns, and so the
    slot table's codec groups, must be those of the replaced layouts, which the headers name."""
    from nvdcp.gpu.bound import without_zstd
    from nvdcp.pipeline.policy import choose_delta_layout

    encoder = _encoder(300 * C, 1024 * C)
    jobs = _jobs(0, 60)
    for job in jobs:
        job.layout = choose_delta_layout(job.dtype, "auto", "gdeflate")  # a top plane of Zstd
    budget = encoder._bucket_budget

    def swapping(js: list[GpuJob], depth: int) -> int:
        for job in js:
            job.layout = without_zstd(job.layout)
        return budget(js, depth)

    monkeypatch.setattr(encoder, "_bucket_budget", swapping)
    buckets = encoder._plan(jobs)
    for bucket in buckets:
        _, _, keys = encoder._slot_table(jobs, bucket)
        assert keys and all(name == "gdeflate" for name, _ in keys), keys

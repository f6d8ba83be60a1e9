"""GpuEncoder._plan, the packing of jobs' blocks into buckets, on the host (no GPU needed): every
block of every job placed once, in order; no bucket over its slot bound or, unless it holds a
single segment, over its budget; an item that fits an empty bucket never cut over two."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvdcp.gpu.encoder import GpuEncoder, GpuJob, granule_for
from nvdcp.gpu.nvcomp_codecs import CodecCache
from nvdcp.pipeline.policy import choose_layout

C = 1024


def _encoder(budget: int, pinned: int, kernel: bool = False) -> GpuEncoder:
    """An encoder for planning only (no streams, no device); ``kernel``: as where the plane
    kernel splits small tensors into slots packed at the granule."""
    encoder = object.__new__(GpuEncoder)
    encoder.chunk_bytes, encoder.granule, encoder.bound = C, granule_for(C), None
    encoder.bucket_budget, encoder.pinned_bytes, encoder.kernel_splits = budget, pinned, kernel
    encoder.codecs = CodecCache(C, 0)  # nvCOMP's output bounds (host calls: no GPU needed)
    return encoder


def _jobs(seed: int, n: int, codec: str = "zstd") -> list[GpuJob]:
    """Jobs of three dtypes and sizes from empty to 40 chunks a plane; ``codec="zstd"``: their
    chunks charge whole chunks of pinned memory (Zstd's workspace grows with a call's chunks);
    ``"gdeflate"``: their bytes."""
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(n):
        dtype = (torch.float32, torch.bfloat16, torch.uint8)[i % 3]
        elements = int(rng.choice([0, 1, 300, C - 1, C, 3 * C + 7, int(rng.integers(1, 40 * C))]))
        data = torch.empty(elements, dtype=dtype)
        jobs.append(GpuJob(i, data, choose_layout(dtype, codec), dtype, 0, (elements,)))
    return jobs


def _whole_charges(encoder: GpuEncoder, jobs: list[GpuJob]) -> tuple[list[int], list[int]]:
    """Each job's charges held whole, one job at a time. GPU: its full blocks at the block cost;
    its last block's packed copy, gather index (and a delta's base and XOR; and its slots, when
    the encoder's plane kernel packs them: every non-empty job here) by that block's bytes
    rounded up to the granule, its output slots as nvCOMP bounds them. Pinned: a chunk per slot when a
    Zstd plane is in the save, else its bytes rounded up to the granule per plane."""
    g = encoder.granule
    whole_chunks = any("zstd" in job.layout.plane_codecs for job in jobs)
    gpu, pinned = [], []
    for job in jobs:
        blocks, p = -(-job.elements // C), job.n_planes
        unused = C - -(-(job.elements - (blocks - 1) * C) // g) * g if blocks else 0
        per_byte = (3 if job.delta is not None else 1) + (encoder.kernel_splits and job.delta is None and job.keep is None)
        gpu.append(blocks * encoder._block_cost(job) - p * (unused * per_byte + unused // g * 8))
        pinned.append(p * blocks * C if whole_chunks else p * (blocks * C - unused))
    return gpu, pinned


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("codec", ["zstd", "gdeflate"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget_chunks", [64, 300, 5000])
def test_the_plan_places_every_block_once_in_order_within_the_bounds(seed: int, budget_chunks: int,
                                                                     codec: str, kernel: bool) -> None:
    encoder = _encoder(budget_chunks * C, 1024 * C, kernel)
    jobs = _jobs(seed, 300, codec)
    max_slots, budget = encoder.max_slots_for(2), encoder._bucket_budget(jobs, 2)
    buckets = encoder._plan(jobs)
    gpu_whole, pinned_whole = _whole_charges(encoder, jobs)
    placed: list[tuple[int, int, int]] = []
    for bucket in buckets:
        slot = cost = pinned = 0
        for seg in bucket.segments:
            job = jobs[seg.job]
            assert seg.first_slot == slot  # segments packed back to back
            slot += seg.n_blocks * job.n_planes
            held_whole = seg.first_block == 0 and seg.n_blocks * C >= job.elements
            cost += gpu_whole[seg.job] if held_whole else seg.n_blocks * encoder._block_cost(job)
            pinned += pinned_whole[seg.job] if held_whole else seg.n_blocks * job.n_planes * C
            placed.append((seg.job, seg.first_block, seg.n_blocks))
        assert slot == bucket.slots and cost == bucket.cost
        assert pinned <= max_slots * C or len(bucket.segments) == 1
        assert bucket.cost <= budget or len(bucket.segments) == 1
        if codec == "zstd":  # Zstd's workspace is sized for the slot bound
            assert bucket.slots <= max_slots or len(bucket.segments) == 1
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


def test_small_tensors_without_zstd_fill_buckets_past_the_slot_bound() -> None:
    """Small tensors whose planes use no Zstd charge the pinned budget their bytes: a bucket
    holds more of their slots than the chunk-per-slot bound would allow (fewer buckets, each a
    fixed cost of the encode thread), while their packed bytes stay within the pinned share."""
    encoder = _encoder(1 << 30, 64 * C)
    jobs = [GpuJob(i, torch.empty(256), choose_layout(torch.float32, "gdeflate"), torch.float32, 0, (256,))
            for i in range(2000)]
    max_slots = encoder.max_slots_for(2)
    buckets = encoder._plan(jobs)
    assert max(b.slots for b in buckets) > max_slots
    assert all(len(b) * 4 * 256 <= max_slots * C for b in buckets)  # 4 planes of 256 bytes each
    zstd = [GpuJob(i, torch.empty(256), choose_layout(torch.float32, "zstd"), torch.float32, 0, (256,))
            for i in range(2000)]
    assert max(b.slots for b in encoder._plan(zstd)) <= max_slots


@pytest.mark.parametrize("kernel", [False, True])
def test_a_small_tensor_costs_its_bytes_not_whole_chunks_where_they_are_its_bytes(kernel: bool) -> None:
    """A 1 KiB fp32 tensor (64 KiB chunks, GPU auto layout): one GDeflate output slot (nvCOMP's
    bound for a 64 KiB chunk, 131,360 bytes, in 514 granules), but a packed copy and gather index
    of its 1 KiB, and, where the plane kernel packs its slots, four slots of 256 bytes: 130 KiB of
    a bucket (385 KiB with four whole slots), not the 648 KiB of a full block; a full block
    still costs a full block."""
    from nvdcp.gpu.plan import JobColumns

    encoder = _encoder(1 << 30, 512 << 20, kernel)
    encoder.chunk_bytes, encoder.granule, encoder.codecs = 1 << 16, 256, CodecCache(1 << 16, 0)
    layout = choose_layout(torch.float32, "auto", "gdeflate")
    jobs = [GpuJob("small", torch.empty(256), layout, torch.float32, 0, (256,)),
            GpuJob("block", torch.empty(1 << 16), layout, torch.float32, 0, (1 << 16,))]
    gpu, pinned = encoder._charges(jobs, JobColumns.of(jobs), 1 << 29, 2)
    assert encoder.output_slot_bytes("gdeflate", None) == 514 * 256
    assert gpu.per_block.tolist() == [4 * (2 * 65536 + 2048) + 514 * 256] == [664064]
    slot_saved = 65280 if kernel else 0
    assert gpu.whole.tolist() == [664064 - 4 * (65280 + slot_saved + 2040), 664064]
    assert gpu.whole[0] // 1024 == (130 if kernel else 385)
    assert pinned.whole.tolist() == [4 * 256, 4 * 65536]  # no Zstd plane: bytes, not chunks


def _reference_plan(encoder: GpuEncoder, jobs: list[GpuJob]) -> list[list[tuple[int, int, int, int]]]:
    """The greedy rule one job (and, for a job cut over buckets, one block range) at a time:
    what the columnar planner must reproduce, segment for segment."""
    max_slots, budget = encoder.max_slots_for(2), encoder._bucket_budget(jobs, 2)
    pin_limit = max_slots * C
    gpu_whole, pinned_whole = _whole_charges(encoder, jobs)
    buckets: list[list[tuple[int, int, int, int]]] = [[]]
    slots = cost = pinned = 0
    for j, job in enumerate(jobs):
        blocks, p, per_block = -(-job.elements // C), job.n_planes, encoder._block_cost(job)
        if blocks == 0:
            buckets[-1].append((j, 0, 0, slots))
            continue
        if cost + gpu_whole[j] <= budget and pinned + pinned_whole[j] <= pin_limit:
            buckets[-1].append((j, 0, blocks, slots))
            slots, cost, pinned = slots + blocks * p, cost + gpu_whole[j], pinned + pinned_whole[j]
            continue
        b = 0
        fits_empty = min(budget // per_block, pin_limit // (p * C))
        while b < blocks:
            room = min((budget - cost) // per_block, (pin_limit - pinned) // (p * C))
            if buckets[-1] and (room <= 0 or (b == 0 and room < blocks <= fits_empty)):
                buckets.append([])
                slots = cost = pinned = 0
                continue
            take = min(blocks - b, max(room, 1))
            buckets[-1].append((j, b, take, slots))
            whole = take == blocks
            slots += take * p
            cost += gpu_whole[j] if whole else take * per_block
            pinned += pinned_whole[j] if whole else take * p * C
            b += take
    return [b for b in buckets if b]


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("codec", ["zstd", "gdeflate"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget_chunks", [3, 64, 300, 5000])
def test_the_columnar_plan_is_the_greedy_rule_segment_for_segment(seed: int, budget_chunks: int, codec: str,
                                                                  kernel: bool) -> None:
    """plan_buckets places runs of jobs by binary search: the same buckets and segments as
    placing one job at a time, also with empty jobs after a bucket over its bounds (a budget
    below one block of a four-plane job) and jobs cut over many buckets; with slots whole and
    packed."""
    encoder = _encoder(budget_chunks * C, 512 * C, kernel)
    jobs = _jobs(seed, 400, codec)
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
        _, _, keys = encoder._slot_table(bucket)
        assert keys and all(name == "gdeflate" for name, _ in keys), keys


@pytest.mark.parametrize("seed", range(4))
def test_slot_layout_puts_rows_first_and_packs_the_kernels_slots_after_them(seed: int) -> None:
    """SlotLayout.of: the slots of segments the kernel does not take are rows of a chunk in
    slot order (a segment's rows consecutive, as the torch copies write them); the kernel's
    follow, each at a granule boundary with its raw bytes rounded up to the granule; no two
    slots overlap and all lie within ``end``. Without the kernel every slot is a row."""
    from nvdcp.gpu.encoder import _KernelSplit
    from nvdcp.gpu.plan import SlotLayout, slot_ranges

    encoder = _encoder(64 * C, 1024 * C, kernel=True)
    jobs = _jobs(seed, 80, "gdeflate")
    jobs.append(GpuJob("empty", torch.empty(0), choose_layout(torch.float32, "gdeflate"), torch.float32, 0, (0,)))
    g = encoder.granule
    for bucket in encoder._plan(jobs):
        raw_sizes, _, _ = encoder._slot_table(bucket)
        packed = _KernelSplit.takes(bucket)
        layout = SlotLayout.of(bucket, raw_sizes, packed, C, g)
        covered = slot_ranges(bucket.first_slot, bucket.slot_counts)
        assert covered.tolist() == list(range(bucket.slots))
        dense = np.zeros(bucket.slots, dtype=bool)
        dense[slot_ranges(bucket.first_slot[packed], bucket.slot_counts[packed])] = True
        assert ((layout.row_of < 0) == dense).all()
        rows = np.flatnonzero(~dense)
        assert layout.row_of[rows].tolist() == list(range(len(rows))) and layout.n_rows == len(rows)
        assert (layout.at[rows] == layout.row_of[rows] * C).all()
        spans = np.where(dense, -(-raw_sizes // g) * g, C)
        order = np.argsort(layout.at, kind="stable")
        ends = layout.at[order] + spans[order]
        assert (layout.at % g == 0).all() and (ends[:-1] <= layout.at[order][1:]).all()  # no overlaps
        assert int(ends.max(initial=0)) == layout.end
        assert layout.end == layout.n_rows * C + int(spans[dense].sum())
        # each segment's first row, also for an empty job after the bucket's last slot (the
        # first packed version indexed past the end there: an IndexError on the H100)
        first = layout.first_rows(bucket)
        held = bucket.slot_counts > 0
        assert (first[held] == layout.row_of[bucket.first_slot[held]]).all()
        assert (first[bucket.first_slot == bucket.slots] == layout.n_rows).all()
        whole = SlotLayout.of(bucket, raw_sizes, None, C, g)
        assert not whole.kernel and whole.n_rows == bucket.slots and whole.end == bucket.slots * C


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_a_buckets_charge_covers_what_its_launch_allocates(seed: int, kernel: bool) -> None:
    """What GpuEncoder._launch and _to_host allocate for a bucket of plain jobs stays within
    the GPU charge the plan gave it: the slots where SlotLayout puts them, an nvCOMP output slot
    (its bound for one chunk, 2.28 chunks for GDeflate at 1 KiB) per compressed slot, the
    packed copy (each slot's bytes rounded up to the granule at most) and its gather index."""
    from nvdcp.gpu.encoder import _KernelSplit
    from nvdcp.gpu.plan import SlotLayout

    encoder = _encoder(300 * C, 1024 * C, kernel)
    g = encoder.granule
    jobs = _jobs(seed, 200, "gdeflate")
    for bucket in encoder._plan(jobs):
        raw_sizes, slot_key, keys = encoder._slot_table(bucket)
        layout = SlotLayout.of(bucket, raw_sizes, _KernelSplit.takes(bucket) if kernel else None, C, g)
        packed = int((-(-raw_sizes // g) * g).sum())
        outputs = sum(int((slot_key == k).sum()) * encoder.output_slot_bytes(*key) for k, key in enumerate(keys))
        allocated = layout.end + outputs + packed + packed // g * 8
        assert allocated <= bucket.cost, (allocated, bucket.cost)
        if kernel and bucket.slots:
            assert layout.n_rows < bucket.slots  # the kernel's slots were packed

"""How a delta load is planned and put together (nvdcp/dcp/reader.py): each item's chain is
planned from the ``.metadata`` of every level before any record is read; on the GPU path every
level of a batch is decoded at once and the levels are folded afterwards (``_combine_levels``,
run here on host tensors: the same torch calls); the window that loads delta items alongside the
items stored whole hands results out in order and starts a bounded number at a time."""

from __future__ import annotations

import random
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

import nvdcp
from nvdcp.dcp import descriptor
from nvdcp.dcp.reader import NvcompReader, _element_size, _Window
from nvdcp.pipeline.cpu import decode_item
from tests.conftest import bit_equal, weights_like
from tests.dcp.helpers import save

pytestmark = pytest.mark.timeout(120)


def _state() -> dict[str, torch.Tensor]:
    return {
        "w": weights_like((256, 300), seed=1),
        "b16": weights_like((64, 100), torch.bfloat16, seed=2),
        "ids": torch.arange(5000, dtype=torch.int64),
        "fixed": weights_like((40, 40), seed=3),  # changes only in the second step
    }


def _train(sd: dict[str, torch.Tensor], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    sd["w"].add_(torch.randn(sd["w"].shape, generator=g) * 1e-4)
    sd["b16"].add_((torch.randn(sd["b16"].shape, generator=g) * 1e-3).bfloat16())
    sd["ids"][step * 7 : step * 7 + 5] += 1
    if step == 2:
        sd["fixed"].add_(1e-3)


def _chain(root: Path, n: int = 3) -> tuple[list[Path], list[dict[str, torch.Tensor]]]:
    """``n`` saves, each a delta against the one before (bases of a 3-deep chain)."""
    policy = nvdcp.DeltaPolicy(full_every=8)
    sd = _state()
    paths, wants = [], []
    for step in range(n):
        if step:
            _train(sd, step)
        paths.append(root / f"s{step}")
        save(sd, paths[-1], delta=policy)
        wants.append({k: v.clone() for k, v in sd.items()})
    return paths, wants


def _reader(path: Path) -> NvcompReader:
    reader = NvcompReader(path)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    return reader


def _deltas(reader: NvcompReader) -> list[MetadataIndex]:
    assert reader.metadata is not None
    return [ix for ix, info in reader.metadata.storage_data.items() if descriptor.is_delta(info)]


def _decoded_as_stored(levels: list[tuple[NvcompReader, list[MetadataIndex]]]) -> list[list[tuple[Any, ...]]]:
    """Each level's records decoded as stored (a delta's bytes not combined), as host tensors."""
    out = []
    for reader, items in levels:
        rows = []
        for index in items:
            name, offset, length = reader.record_of(index)
            record = memoryview(reader.storage.read_range(name, offset, length))
            size = _element_size(reader.expected(index)[0])
            header, raw = decode_item(record, reader.where(index), reader._codec_pool(), size)
            rows.append((index, header, torch.from_numpy(np.array(raw, dtype=np.uint8))))
        out.append(rows)
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def test_levels_follow_each_items_chain_from_the_metadata(tmp_path: Path) -> None:
    paths, _ = _chain(tmp_path)
    reader = _reader(paths[2])
    deltas = _deltas(reader)
    assert {ix.fqn for ix in deltas} >= {"w", "b16", "fixed"}
    depths = reader._chain_depths(deltas)
    # walk the chain by hand: an item's depth is how many levels in a row store it as a delta
    for index in deltas:
        depth, level = 0, reader
        while level is not None and descriptor.is_delta(level._record(index)):
            depth, level = depth + 1, level.base
        assert depths[index] == depth, index.fqn
    fixed = next(ix for ix in deltas if ix.fqn == "fixed")
    assert depths[fixed] == 2  # unchanged from s0 to s1 is still a delta (of zeros) there
    levels = reader._levels(deltas, depths)
    assert [Path(r.path) for r, _ in levels] == paths[::-1][: len(levels)]
    assert len(levels) == 1 + max(depths.values())
    for k, (_, items) in enumerate(levels):
        assert items == [ix for ix in deltas if depths[ix] >= k]


def test_levels_decoded_apart_and_combined_rebuild_the_saved_tensors(tmp_path: Path) -> None:
    paths, wants = _chain(tmp_path)
    reader = _reader(paths[2])
    deltas = _deltas(reader)
    levels = reader._levels(deltas, reader._chain_depths(deltas))
    combined = reader._combine_levels(levels, _decoded_as_stored(levels))
    assert [ix for ix, _, _ in combined] == deltas
    for index, header, raw in combined:
        assert header.is_delta
        assert bit_equal(raw, _raw(wants[2][index.fqn])), index.fqn


def test_combine_refuses_a_base_level_that_is_another_items(tmp_path: Path) -> None:
    paths, _ = _chain(tmp_path, n=2)
    reader = _reader(paths[1])
    deltas = _deltas(reader)
    levels = reader._levels(deltas, reader._chain_depths(deltas))
    decoded = _decoded_as_stored(levels)
    base = decoded[1]
    w = next(i for i, row in enumerate(base) if row[0].fqn == "w")
    b16 = next(i for i, row in enumerate(base) if row[0].fqn == "b16")
    # "w"'s base level now carries "b16"'s header and bytes
    base[w] = (base[w][0], base[b16][1], base[b16][2])
    with pytest.raises(nvdcp.BaseMismatchError, match="not the base of this delta") as info:
        reader._combine_levels(levels, decoded)
    assert "'w'" in str(info.value)


def test_chain_planning_names_a_base_missing_an_item(tmp_path: Path) -> None:
    paths, _ = _chain(tmp_path, n=2)
    reader = _reader(paths[1])
    deltas = _deltas(reader)
    assert reader.base is not None and reader.base.metadata is not None
    w = next(ix for ix in deltas if ix.fqn == "w")
    del reader.base.metadata.storage_data[w]
    with pytest.raises(nvdcp.BaseMismatchError, match="holds no item") as info:
        reader._chain_depths(deltas)
    assert "w" in str(info.value)


def test_window_starts_a_bounded_number_and_hands_results_out_in_order() -> None:
    futures: list[Future[list[tuple[int, None, None]]]] = [Future() for _ in range(5)]
    started: list[int] = []

    def unit(k: int) -> Any:
        def start() -> Future[list[tuple[int, None, None]]]:
            started.append(k)
            return futures[k]
        return start

    window = _Window([unit(k) for k in range(5)], 2)
    assert started == [0, 1]
    futures[1].set_result([(1, None, None)])
    # the first unit is not done: only the other stream's items come out
    assert list(window.interleave(iter(["a", "b"]))) == ["a", "b"]
    assert started == [0, 1]
    futures[0].set_result([(0, None, None)])
    out = window.interleave(iter(["c", "d"]))
    assert next(out) == "c"
    assert next(out) == (0, None, None)  # finished units come out between the other items
    assert started == [0, 1, 2]  # one handed out, one more started
    assert next(out) == (1, None, None)
    assert started == [0, 1, 2, 3]
    assert list(out) == ["d"]
    for k in (2, 3, 4):
        futures[k].set_result([(k, None, None)])
    assert [r[0] for r in window.rest()] == [2, 3, 4]
    assert started == [0, 1, 2, 3, 4]


def test_window_cancel_drops_what_has_not_started() -> None:
    futures: list[Future[list[Any]]] = [Future() for _ in range(4)]
    started: list[int] = []

    def unit(k: int) -> Any:
        return lambda: started.append(k) or futures[k]

    window = _Window([unit(k) for k in range(4)], 2)
    window.cancel()
    assert started == [0, 1]
    assert futures[0].cancelled() and futures[1].cancelled()
    assert list(window.rest()) == []  # nothing left to start or hand out
    assert started == [0, 1]


def test_gpu_batches_give_every_decode_thread_work_within_the_budget() -> None:
    from nvdcp.dcp.reader import MAX_GPU_BATCH_ITEMS, MIN_GPU_BATCH_BYTES, _batched

    a, b = torch.device("cuda", 0), torch.device("cuda", 1)
    mib = 1 << 20
    # 1 GiB in 64 MiB items on one device, a 1 GiB budget: one batch before; now one per thread
    rows = [(k, a, 64 * mib) for k in range(16)]
    batches = _batched(rows, {a: 1 << 30}, 4)  # type: ignore[arg-type]
    assert [len(items) for _, items in batches] == [4, 4, 4, 4]
    assert [ix for _, items in batches for ix in items] == list(range(16))  # order kept
    # the budget still bounds a batch
    assert [len(items) for _, items in _batched(rows, {a: 128 * mib}, 4)] == [2] * 8  # type: ignore[arg-type]
    # small loads are not cut below MIN_GPU_BATCH_BYTES
    tiny = [(k, a, mib) for k in range(2 * MIN_GPU_BATCH_BYTES // mib)]
    assert [len(items) for _, items in _batched(tiny, {a: 1 << 30}, 4)] == [MIN_GPU_BATCH_BYTES // mib] * 2  # type: ignore[arg-type]
    # an item over the limit is a batch alone; devices are batched apart
    mixed = [(0, a, 10 * mib), (1, b, 10 * mib), (2, a, 900 * mib), (3, a, 10 * mib), (4, b, 10 * mib)]
    got = _batched(mixed, {a: 256 * mib, b: 256 * mib}, 4)  # type: ignore[arg-type]
    assert sorted((str(d), items) for d, items in got) == [("cuda:0", [0]), ("cuda:0", [2]), ("cuda:0", [3]), ("cuda:1", [1, 4])]
    # at most MAX_GPU_BATCH_ITEMS items per batch, split evenly
    many = [(k, a, 1) for k in range(MAX_GPU_BATCH_ITEMS + 5)]
    assert [len(items) for _, items in _batched(many, {a: 1 << 30}, 4)] == [2051, 2050]  # type: ignore[arg-type]


def test_gpu_batches_beyond_one_per_thread_come_in_even_rounds() -> None:
    """More batches than threads: a multiple of the threads, of even items and bytes, so no
    batch decodes alone at the end (20,000 small items were 4 full batches and a tail)."""
    from nvdcp.dcp.reader import MAX_GPU_BATCH_ITEMS, _batched

    a = torch.device("cuda", 0)
    sizes = [4096 << (k % 9) for k in range(4 * MAX_GPU_BATCH_ITEMS + 3616)]
    rows = [(k, a, size) for k, size in enumerate(sizes)]
    batches = _batched(rows, {a: 1 << 30}, 4)  # type: ignore[arg-type]
    assert len(batches) == 8
    assert [ix for _, items in batches for ix in items] == list(range(len(rows)))
    counts = [len(items) for _, items in batches]
    assert max(counts) <= MAX_GPU_BATCH_ITEMS and max(counts) - min(counts) <= 0.1 * max(counts)
    nbytes = [sum(sizes[ix] for ix in items) for _, items in batches]
    assert max(nbytes) <= 1 << 30 and max(nbytes) - min(nbytes) <= 0.1 * max(nbytes)
    # a budget that needs 6 batches gets 8 (two rounds of 4 threads), none over the budget
    tight = _batched(rows, {a: sum(sizes) // 6 + 1}, 4)  # type: ignore[arg-type]
    assert len(tight) == 8


def _batched_per_item(items: list[Any], budget: dict[Any, int], threads: int) -> list[Any]:
    """The per-item loop :func:`nvdcp.dcp.reader._batched` replaced (session 20): the reference."""
    from nvdcp.dcp.reader import MAX_GPU_BATCH_ITEMS, _batch_share

    totals: dict[Any, list[int]] = {}
    for _, device, size in items:
        total = totals.setdefault(device, [0, 0])
        total[0] += size
        total[1] += 1
    shares = {device: _batch_share(nbytes, count, budget[device], threads) for device, (nbytes, count) in totals.items()}
    batches: list[Any] = []
    open_: dict[Any, list[Any]] = {}
    for index, device, size in items:
        state = open_.setdefault(device, [[], 0, 0, 0])
        members, used, before, cut = state
        wanted, byte_goal, item_cap = shares[device]
        if members and (used + size > budget[device] or len(members) >= MAX_GPU_BATCH_ITEMS or cut + 1 < wanted and (
                len(members) >= item_cap or before + used + size / 2 > (cut + 1) * byte_goal)):
            batches.append((device, members))
            state[:] = members, used, before, cut = [], 0, before + used, cut + 1
        members.append(index)
        state[1] = used + size
    return batches + [(device, state[0]) for device, state in open_.items() if state[0]]


@pytest.mark.parametrize("seed", range(40))
def test_gpu_batches_cut_as_the_per_item_loop_did(seed: int) -> None:
    """The batch cuts found with running sums equal the per-item loop's, batch for batch and in
    the same order, over random sizes (some past the budget), devices, budgets and threads."""
    from nvdcp.dcp.reader import _batched

    rng = random.Random(seed)
    devices = [torch.device("cuda", d) for d in range(rng.choice([1, 1, 2, 3]))]
    n = rng.choice([0, 1, 2, 7, 300, 5000, 9000])
    top = rng.choice([1 << 12, 1 << 20, 64 << 20, 1 << 30])
    items = [(k, rng.choice(devices), rng.randint(0, top)) for k in range(n)]
    budget = {d: rng.choice([1 << 20, 32 << 20, 256 << 20, 4 << 30]) for d in devices}
    threads = rng.choice([1, 2, 4])
    assert _batched(items, budget, threads) == _batched_per_item(items, budget, threads)

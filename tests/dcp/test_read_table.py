"""The load plan's items by position (nvdcp/dcp/read_table.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import nvdcp
from nvdcp.dcp.read_table import ReadTable, group_requests


def _req(fqn: str, offset: tuple[int, ...], dest: str) -> ReadItem:
    return ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(dest, offset), dest_offsets=torch.Size(offset),
                    storage_index=MetadataIndex(fqn, offset), storage_offsets=torch.Size([0] * len(offset)),
                    lengths=torch.Size([1] * len(offset)))


def _table(infos: list[_StorageInfo]) -> ReadTable:
    keys = [MetadataIndex(f"t{i}", [0]) for i in range(len(infos))]
    return ReadTable(keys, [[_req(k.fqn, (0,), k.fqn)] for k in keys], infos, [False] * len(keys), [False] * len(keys))


def test_one_request_per_item_keeps_plan_order() -> None:
    items = [_req("b", (0,), "b"), _req("a", (0,), "a"), _req("a", (4,), "a")]
    keys, reqs = group_requests(items)
    assert keys == [MetadataIndex("b", [0]), MetadataIndex("a", [0]), MetadataIndex("a", [4])]
    assert [r for group in reqs for r in group] == items


def test_requests_of_one_stored_chunk_are_grouped() -> None:
    """A resharded load reads one stored chunk into several tensors: one item, all its requests."""
    items = [_req("a", (0,), "x"), _req("b", (0,), "y"), _req("a", (0,), "z")]
    keys, reqs = group_requests(items)
    assert keys == [MetadataIndex("a", [0]), MetadataIndex("b", [0])]
    assert [[r.dest_index.fqn for r in group] for group in reqs] == [["x", "z"], ["y"]]


def test_requests_of_finds_the_key_and_an_equal_copy() -> None:
    table = _table([_StorageInfo("f", 0, 1, ("nvdcp.zstd/1",))] * 3)
    assert table.requests_of(table.keys[1]) is table.reqs[1]
    assert table.requests_of(MetadataIndex("t2", [0])) is table.reqs[2]  # another object, equal


def test_file_order_and_places() -> None:
    infos = [_StorageInfo("b", 0, 5, None), _StorageInfo("a", 9, 3, None), _StorageInfo("a", 2, 7, None)]
    table = _table(infos)
    assert table.in_file_order([0, 1, 2]) == [2, 1, 0]
    assert table.in_file_order([0, 1]) == [1, 0]
    assert table.places([2, 0]) == [("a", 2, 7), ("b", 0, 5)]


def test_lengths_are_sane_refuses_negative_and_foreign_values() -> None:
    assert _table([_StorageInfo("a", 0, 3, None)]).lengths_are_sane()
    assert not _table([_StorageInfo("a", 0, 3, None), _StorageInfo("a", -1, 3, None)]).lengths_are_sane()
    assert not _table([_StorageInfo("a", 0, 3.0, None)]).lengths_are_sane()  # type: ignore[arg-type]


def test_a_load_of_a_few_items_of_many_looks_them_up_directly(tmp_path: Path) -> None:
    """A plan reading a small share of the records (a rank of a large resharded load) looks its
    records up without keying all of them; the items load bit-exact either way."""
    state = {f"w{i}": torch.randn(16, 8) for i in range(40)}
    dcp.save(state, storage_writer=nvdcp.NvcompWriter(tmp_path), no_dist=True)
    few = {k: torch.zeros(16, 8) for k in ("w3", "w31")}
    reader = nvdcp.NvcompReader(tmp_path)
    dcp.load(few, storage_reader=reader, no_dist=True)
    assert reader._record_keys is None  # the direct path: no dictionary over every record
    assert all(torch.equal(few[k], state[k]) for k in few)
    everything = {k: torch.zeros(16, 8) for k in state}
    dcp.load(everything, storage_reader=reader, no_dist=True)
    assert reader._record_keys is not None and all(torch.equal(everything[k], state[k]) for k in state)


def test_an_unknown_codec_is_named_at_the_first_item_of_the_plan(tmp_path: Path) -> None:
    state = {f"w{i}": torch.randn(4) for i in range(5)}
    dcp.save(state, storage_writer=nvdcp.NvcompWriter(tmp_path), no_dist=True)
    reader = nvdcp.NvcompReader(tmp_path)
    md = reader.read_metadata()
    for info in md.storage_data.values():
        info.transform_descriptors = ("nvdcp.bogus/1",)
    reader.set_up_storage_reader(md, True)
    planner = DefaultLoadPlanner()
    planner.set_up_planner({k: torch.zeros(4) for k in state}, md, True)
    plan = planner.create_local_plan()
    with pytest.raises(nvdcp.UnknownCodecError, match=f"item {plan.items[0].storage_index.fqn!r}.*unknown codec 'bogus'"):
        reader.read_data(plan, planner)


def test_a_plan_index_of_another_kind_is_refused_by_name(tmp_path: Path) -> None:
    """A custom planner's storage index that is no MetadataIndex: a clear error naming it."""
    dcp.save({"w": torch.randn(4)}, storage_writer=nvdcp.NvcompWriter(tmp_path), no_dist=True)
    reader = nvdcp.NvcompReader(tmp_path)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    odd = dataclasses.replace(_req("w", (0,), "w"), storage_index="w")  # type: ignore[arg-type]
    with pytest.raises(nvdcp.CorruptCheckpointError, match="item 'w': no storage record"):
        reader.read_data(LoadPlan([odd]), DefaultLoadPlanner())

"""A rank's write results come back in plan order, whatever thread wrote what (writer._in_plan_order)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from nvdcp.dcp.writer import _in_plan_order


def _items(n: int) -> list[WriteItem]:
    return [WriteItem(index=MetadataIndex(f"t{i}", torch.Size([0])), type=WriteItemType.TENSOR) for i in range(n)]


def test_results_sorted_by_their_items_objects() -> None:
    items = _items(5)
    results = [WriteResult(index=items[i].index, size_in_bytes=i, storage_data=None) for i in (3, 0, 4, 1, 2)]
    assert [r.size_in_bytes for r in _in_plan_order(results, items)] == [0, 1, 2, 3, 4]


def test_results_with_equal_copies_of_the_indexes_sorted_by_value() -> None:
    items = _items(4)
    results = [WriteResult(index=MetadataIndex(f"t{i}", torch.Size([0])), size_in_bytes=i, storage_data=None)
               for i in (2, 3, 1, 0)]
    assert [r.size_in_bytes for r in _in_plan_order(results, items)] == [0, 1, 2, 3]

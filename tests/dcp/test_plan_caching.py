"""Saves through a planner that caches plans (``DefaultSavePlanner(enable_plan_caching=True)``).

From the second save on, torch hands ``write_data`` the final plan of the save that filled its
cache, that save's file prefix included. Written as it comes, each save would reuse the first
save's data file names, overwriting the files of the checkpoint already in the location in place
(a crash midway would leave it pointing at half-written files). The writer names such a save's
files itself; a delta save through such a planner is refused before anything is written.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner

import nvdcp
from nvdcp.testing import clear_plan_caches
from tests._dist import run_ranks
from tests.conftest import bit_equal
from tests.dcp.helpers import data_files, failure_of

pytestmark = pytest.mark.skipif(
    "enable_plan_caching" not in inspect.signature(DefaultSavePlanner).parameters,
    reason="this torch's DefaultSavePlanner has no plan caching",
)


@pytest.fixture(autouse=True)
def _fresh_plan_caches() -> object:
    clear_plan_caches()  # torch keeps them per class, for the whole process
    yield
    clear_plan_caches()


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g).bfloat16()}


def _caching() -> DefaultSavePlanner:
    return DefaultSavePlanner(enable_plan_caching=True)  # type: ignore[call-arg]


def _loads(path: Path | str, expected: dict[str, torch.Tensor]) -> None:
    out = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(out, storage_reader=nvdcp.NvcompReader(path))
    for k, v in expected.items():
        assert bit_equal(out[k], v), k


def test_each_save_writes_data_files_of_its_own(tmp_path: Path) -> None:
    saved: list[tuple[Path, dict[str, torch.Tensor], set[str]]] = []
    for step, where in enumerate(["a", "b", "b"]):
        path = tmp_path / where
        state = _state(step)
        dcp.save(state, storage_writer=nvdcp.NvcompWriter(path, sync_files=False), planner=_caching())
        saved.append((path, state, set(data_files(path))))
    assert SavePlanner._cached_final_save_plan, "torch's plan cache was not used"
    names = [files for _, _, files in saved]
    assert names[0].isdisjoint(names[1]) and names[1].isdisjoint(names[2]) and names[0].isdisjoint(names[2])
    assert set(data_files(tmp_path / "b")) == names[2]  # the second save's files went with the third's commit
    _loads(tmp_path / "a", saved[0][1])
    _loads(tmp_path / "b", saved[2][1])


def test_a_delta_save_through_a_cached_plan_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    first, second = _state(1), _state(2)
    dcp.save(first, storage_writer=nvdcp.NvcompWriter(tmp_path / "base", sync_files=False), planner=_caching())
    dcp.save(first, storage_writer=nvdcp.NvcompWriter(tmp_path / "d", sync_files=False, on_identical_save="ignore"),
             planner=_caching())
    before = {name: (tmp_path / "d" / name).read_bytes() for name in os.listdir(tmp_path / "d")}
    writer = nvdcp.NvcompWriter(tmp_path / "d", sync_files=False, base=tmp_path / "base")
    with pytest.raises(CheckpointException) as raised:
        dcp.save(second, storage_writer=writer, planner=_caching())
    error = failure_of(raised.value)
    assert isinstance(error, ValueError) and "enable_plan_caching=False" in str(error), error
    after = {name: (tmp_path / "d" / name).read_bytes() for name in os.listdir(tmp_path / "d")
             if not name.startswith(".metadata.pending")}
    assert after == before
    _loads(tmp_path / "d", first)


def test_a_plan_cached_by_a_stock_save_is_not_taken_for_this_ones(tmp_path: Path) -> None:
    """torch keys its cache by the planner's class: a stock save's final plan (its own kind of
    file prefix) comes back to the next save with the same state, whoever writes it."""
    state = _state(3)
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "stock"), planner=_caching())
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "stock2"), planner=_caching())
    dcp.save(state, storage_writer=nvdcp.NvcompWriter(tmp_path / "n", sync_files=False), planner=_caching())
    assert len(data_files(tmp_path / "n")) == 1
    _loads(tmp_path / "n", state)


def _two_saves(rank: int, world: int, root: str) -> None:
    files: list[set[str]] = []
    for step in range(3):
        state = {k: v + rank for k, v in _state(step).items()}
        sharded = {f"r{rank}.{k}": v for k, v in state.items()}
        dcp.save(sharded, storage_writer=nvdcp.NvcompWriter(root, sync_files=False, thread_count=1),
                 planner=_caching())
        dist.barrier()
        files.append({n for n in data_files(root) if n.startswith(f"__{rank}_")})
        dist.barrier()
    assert files[0].isdisjoint(files[1]) and files[1].isdisjoint(files[2]), files
    for r in range(world):
        _loads(root, {f"r{r}.{k}": v + r for k, v in _state(2).items()})
    dist.barrier()


@pytest.mark.timeout(180)
def test_two_ranks_saving_through_cached_plans_into_one_location(tmp_path: Path) -> None:
    run_ranks(2, _two_saves, str(tmp_path / "ckpt"))
    assert len(data_files(tmp_path / "ckpt")) == 2  # each rank's file of the last save, no other

"""Real gloo processes: a DTensor-sharded save on 2 ranks loads bit-exactly on 3 (and 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import nvdcp
from tests._dist import run_ranks


def _full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {
        "w": (torch.randn(101, 64, generator=g) * 0.02),
        "w16": (torch.randn(37, 33, generator=g) * 0.02).bfloat16(),
        "ids": torch.arange(1000, dtype=torch.int64),
        "col": torch.randn(8, 50, generator=g),
    }


def _sharded(world: int) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (world,))
    full = _full_state()
    return {
        "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
        "w16": distribute_tensor(full["w16"], mesh, [Shard(0)]),
        "ids": distribute_tensor(full["ids"], mesh, [Shard(0)]),
        "col": distribute_tensor(full["col"], mesh, [Shard(1)]),
    }


def _save(rank: int, world: int, path: str) -> None:
    dcp.save(_sharded(world), storage_writer=nvdcp.NvcompWriter(path, thread_count=2))


def _load_and_check(rank: int, world: int, path: str) -> None:
    sd = _sharded(world)
    for t in sd.values():
        t.to_local().zero_()
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(path))
    full = _full_state()
    for k, v in sd.items():
        got = v.full_tensor()
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.bfloat16 else got,
                           full[k].view(torch.uint8) if got.dtype == torch.bfloat16 else full[k]), k
    dist.barrier()


@pytest.mark.timeout(180)
def test_two_rank_save_loads_on_three_and_one(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save, path)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert ".metadata" in names and sum(n.endswith(".nvdcp") for n in names) == 4
    run_ranks(3, _load_and_check, path)
    run_ranks(1, _load_and_check, path)

"""Real gloo processes: a chain of DTensor-sharded delta saves on 2 ranks loads bit-exactly
resharded on 3 ranks and on 1."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import nvdcp
from nvdcp.dcp import descriptor
from tests._dist import run_ranks

STEPS = 3


def _full_state(step: int) -> dict[str, torch.Tensor]:
    """The full (unsharded) state after ``step`` small updates: the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    out = {
        "w": torch.randn(101, 64, generator=g) * 0.02,
        "w16": (torch.randn(37, 33, generator=g) * 0.02).bfloat16(),
        "ids": torch.arange(1000, dtype=torch.int64),
        "col": torch.randn(8, 50, generator=g),
    }
    for s in range(1, step + 1):
        g = torch.Generator().manual_seed(s)
        out["w"] += torch.randn(101, 64, generator=g) * 1e-5
        out["w16"] += (torch.randn(37, 33, generator=g) * 1e-4).bfloat16()
        out["ids"][s * 13 : s * 13 + 4] += 1
        out["col"][:, s] += 1e-5
    return out


def _sharded(world: int, step: int) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (world,))
    full = _full_state(step)
    return {
        "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
        "w16": distribute_tensor(full["w16"], mesh, [Shard(0)]),
        "ids": distribute_tensor(full["ids"], mesh, [Shard(0)]),
        "col": distribute_tensor(full["col"], mesh, [Shard(1)]),
    }


def _save_chain(rank: int, world: int, root: str) -> None:
    policy = nvdcp.DeltaPolicy(full_every=STEPS + 1)  # one per rank, as in a training job
    for step in range(STEPS):
        dcp.save(_sharded(world, step), storage_writer=nvdcp.NvcompWriter(f"{root}/s{step}", thread_count=2, delta=policy))


def _load_and_check(rank: int, world: int, root: str) -> None:
    for step in range(STEPS):
        sd = _sharded(world, 0)
        for t in sd.values():
            t.to_local().fill_(7)
        dcp.load(sd, storage_reader=nvdcp.NvcompReader(f"{root}/s{step}"))
        full = _full_state(step)
        for k, v in sd.items():
            got = v.full_tensor()
            assert torch.equal(got.view(torch.uint8), full[k].view(torch.uint8)), (step, k)
    dist.barrier()


@pytest.mark.timeout(180)
def test_two_rank_delta_chain_loads_on_three_and_one(tmp_path: Path) -> None:
    root = str(tmp_path)
    run_ranks(2, _save_chain, root)
    depths, deltas = [], []
    for step in range(STEPS):
        md = pickle.loads((tmp_path / f"s{step}" / ".metadata").read_bytes())
        record = getattr(md, "nvdcp_delta", None)
        depths.append(0 if record is None else record["depth"])
        deltas.append({(ix.fqn, ix.offset[0] if ix.offset else 0) for ix, info in md.storage_data.items()
                       if descriptor.is_delta(info)})
        assert sum(n.endswith(".nvdcp") for n in (p.name for p in (tmp_path / f"s{step}").iterdir())) == 4
    assert depths == [0, 1, 2]
    assert deltas[0] == set()
    # both ranks' shards of the row-sharded tensors are deltas
    for step in (1, 2):
        assert {("w", 0), ("w", 51), ("ids", 0), ("ids", 500)} <= deltas[step], deltas[step]
    run_ranks(3, _load_and_check, root)
    run_ranks(1, _load_and_check, root)

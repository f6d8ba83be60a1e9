"""Real gloo processes (as torch's test_file_system_checkpoint_cpu.py / test_dtensor_resharding.py
do with stock DCP): 2 ranks save DTensors (Shard(0), Shard(1), Replicate, uneven), a ShardedTensor
and byte items with stock ``FileSystemWriter`` and with ``NvcompWriter`` built stock-style
(positional arguments); 3 ranks load the stock, the nvdcp and a mixed checkpoint with
``NvcompReader`` into other placements, a ShardedTensor of another sharding spec, and a plain
tensor (a sharded tensor switched to a full one), bit-exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, zeros

import nvdcp
from tests._dist import run_ranks
from tests.dcp.test_stock_read import make_mixed


def _globals() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "row": torch.randn(17, 8, generator=g),
        "col": torch.randn(6, 11, generator=g).bfloat16(),
        "rep": torch.arange(16, dtype=torch.float32).view(4, 4),
        "ids": torch.randint(0, 1 << 50, (1001,), generator=g),
        "st": torch.randn(10, 20, generator=g),
    }


def _chunk_spec(world: int, dim: int) -> ChunkShardingSpec:
    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(world)])


def _fill(st: Any, full: torch.Tensor) -> Any:
    for shard in st.local_shards():
        (o0, o1), (s0, s1) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.copy_(full[o0 : o0 + s0, o1 : o1 + s1])
    return st


def _check_st(st: Any, full: torch.Tensor) -> None:
    for shard in st.local_shards():
        (o0, o1), (s0, s1) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        assert torch.equal(shard.tensor, full[o0 : o0 + s0, o1 : o1 + s1])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _save(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    full = _globals()
    sd: dict[str, Any] = {
        "row": distribute_tensor(full["row"], mesh, [Shard(0)]),
        "col": distribute_tensor(full["col"], mesh, [Shard(1)]),
        "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
        "ids": distribute_tensor(full["ids"], mesh, [Shard(0)]),
        "st": _fill(sharded_tensor.empty(_chunk_spec(world, 0), 10, 20), full["st"]),
        "bytes": {"lst": [1], "s": "string"},
    }
    dcp.save(sd, storage_writer=FileSystemWriter(f"{root}/stock", thread_count=2))
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(f"{root}/nv", True, True, 2))  # stock-style, positional


def _load(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    full = _globals()
    uneven = EnumerableShardingSpec([
        ShardMetadata([0, 0], [3, 20], "rank:2/cpu"),
        ShardMetadata([3, 0], [6, 20], "rank:0/cpu"),
        ShardMetadata([9, 0], [1, 20], "rank:1/cpu"),
    ])
    for name, st_target in (("stock", "uneven"), ("nv", "plain"), ("mixed", "by column")):
        sd: dict[str, Any] = {
            "row": zeros(17, 8, device_mesh=mesh, placements=[Shard(1)]),
            "col": zeros(6, 11, dtype=torch.bfloat16, device_mesh=mesh, placements=[Shard(0)]),
            "rep": zeros(4, 4, device_mesh=mesh, placements=[Shard(0)]),  # 2, 2 and an empty shard
            "ids": zeros(1001, dtype=torch.int64, device_mesh=mesh, placements=[Replicate()]),
            "st": {"uneven": lambda: sharded_tensor.zeros(uneven, 10, 20),
                   "plain": lambda: torch.zeros(10, 20),
                   "by column": lambda: sharded_tensor.zeros(_chunk_spec(world, 1), 10, 20)}[st_target](),
            "bytes": {"lst": [2], "s": "other"},
        }
        dcp.load(sd, storage_reader=nvdcp.NvcompReader(f"{root}/{name}"))
        for key in ("row", "col", "rep", "ids"):
            assert _same(sd[key].full_tensor(), full[key]), (name, key)
        if isinstance(sd["st"], sharded_tensor.ShardedTensor):  # a torch.Tensor subclass too
            _check_st(sd["st"], full["st"])
        else:
            assert torch.equal(sd["st"], full["st"]), name
        assert sd["bytes"] == {"lst": [1], "s": "string"}, name


@pytest.mark.timeout(240)
def test_two_rank_saves_load_resharded_on_three(tmp_path: Path) -> None:
    root = str(tmp_path)
    run_ranks(2, _save, root)
    assert not nvdcp.is_nvdcp_checkpoint(tmp_path / "stock") and nvdcp.is_nvdcp_checkpoint(tmp_path / "nv")
    assert sum(p.suffix == ".nvdcp" for p in (tmp_path / "nv").iterdir()) == 4  # 2 ranks x thread_count 2
    make_mixed(tmp_path / "nv", tmp_path / "stock", tmp_path / "mixed", {"row", "st", "bytes.s", "rep"})
    run_ranks(3, _load, root)

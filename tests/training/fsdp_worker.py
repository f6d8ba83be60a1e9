"""Rank functions for the multi-process training tests (module level: spawn pickles them).

A tiny FSDP2 model whose parameters shard unevenly: ``mid`` has 10 rows (3,3,3,1 on 4 ranks;
4,4,2 on 3) and ``head`` 3 rows, so on 4 ranks the last rank holds empty shards. The global batch
of a step is fixed (12 samples, split across ranks), so every world size sees the same data and
a run's losses depend only on the state it starts from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import nvdcp
from nvdcp.dcp.stager import NvcompStager

GLOBAL_BATCH = 12


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 16)
        self.mid = nn.Linear(16, 10)
        self.head = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.embed(x).mean(1)))
        return F.cross_entropy(self.head(h), y)


def build(world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.mid, mesh=mesh)
    fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def train(model: nn.Module, optim: torch.optim.Optimizer, first: int, last: int, rank: int, world: int) -> list[float]:
    """Steps ``first..last`` (1-based); returns the global mean loss of each."""
    per = GLOBAL_BATCH // world
    losses = []
    for step in range(first, last + 1):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 37, (GLOBAL_BATCH, 5), generator=g)
        y = torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)
        loss = model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return losses


def state(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "trainer": {"step": step}}


def full_state(sd: dict[str, Any]) -> dict[str, Any]:
    """Every entry flattened, DTensors gathered (a collective): comparable across world sizes."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(sd)
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() if isinstance(v, torch.Tensor)
            else v for k, v in flat.items()}


def mismatches(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    bad = [k for k in want.keys() ^ got.keys()]
    for k, w in want.items():
        g = got.get(k)
        if isinstance(w, torch.Tensor):
            same = isinstance(g, torch.Tensor) and g.dtype == w.dtype and g.shape == w.shape and torch.equal(
                g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))
        else:
            same = g == w
        if not same:
            bad.append(k)
    return sorted(set(bad))


def load(path: str, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    sd = state(model, optim, -1)
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(path))
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return sd


def save_reference(sd: dict[str, Any], path: Path, rank: int) -> None:
    full = full_state(sd)
    if rank == 0:
        torch.save(full, path)


def check_against(model: nn.Module, optim: torch.optim.Optimizer, loaded: dict[str, Any], ref: Path,
                  step: int) -> list[str]:
    """Entries where what dcp.load returned, or what the model then holds, differs from the
    saved reference (empty: bit-exact)."""
    want = torch.load(ref, weights_only=False)
    bad = mismatches(full_state(loaded), want)
    bad += [f"after set_state_dict: {k}" for k in mismatches(full_state(state(model, optim, step)), want)]
    return bad


def dump(root: Path, run: str, rank: int, **record: Any) -> None:
    if rank == 0:
        (root / f"{run}.json").write_text(json.dumps(record))


def local_rows(sd: dict[str, Any]) -> dict[str, int]:
    return {k: v.to_local().shape[0] for k, v in sd["model"].items() if isinstance(v, DTensor) and v.dim()}


def async_save(sd: dict[str, Any], path: str, group: Any, mode: AsyncCheckpointerType,
               stager: NvcompStager | None = None) -> Any:
    return dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(path), process_group=group,
                          async_checkpointer_type=mode, async_stager=stager)


def stop_checkpoint_process(group: Any) -> None:
    """End torch's PROCESS-mode checkpoint process on every rank together, before the ranks exit.

    Left to interpreter shutdown, the background processes (which share a gloo group) can be
    killed one at a time, and gloo aborts the survivor mid-connection.
    """
    from torch.distributed.checkpoint import _async_process_executor as executor

    dist.barrier(group=group)
    proc = executor._CHECKPOINT_PROCESS
    if proc is not None:
        proc.__del__()  # sends TERMINATE and joins
        executor._CHECKPOINT_PROCESS = None
    dist.barrier(group=group)


# -- the runs ------------------------------------------------------------------------------
def run_a(rank: int, world: int, d: str) -> None:
    """4 ranks: 3 steps, async save ``a3`` (THREAD, the writer as stager), 3 more steps at once."""
    root = Path(d)
    group = dist.new_group(backend="gloo")
    model, optim = build(world, seed=0)
    train(model, optim, 1, 3, rank, world)
    sd = state(model, optim, 3)
    rows = [None] * world
    dist.all_gather_object(rows, local_rows(sd))
    save_reference(sd, root / "ref_a3.pt", rank)
    fut = async_save(sd, str(root / "a3"), group, AsyncCheckpointerType.THREAD)
    losses = train(model, optim, 4, 6, rank, world)  # overlaps the upload, changes every tensor
    fut.result()
    dump(root, "a", rank, losses=losses, local_rows=rows)


def run_b(rank: int, world: int, d: str) -> None:
    """2 ranks: load ``a3`` (4 -> 2), train 4..6, async save ``b6`` (THREAD, a CPU-compressing
    stager), train 7..9, async save ``b9`` (PROCESS), train on."""
    root = Path(d)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # for the PROCESS-mode checkpoint process
    group = dist.new_group(backend="gloo")
    model, optim = build(world, seed=1)
    checks = check_against(model, optim, load(str(root / "a3"), model, optim), root / "ref_a3.pt", 3)
    losses_4_6 = train(model, optim, 4, 6, rank, world)
    stager = NvcompStager(cpu_mode="compress")
    sd = state(model, optim, 6)
    save_reference(sd, root / "ref_b6.pt", rank)
    fut = async_save(sd, str(root / "b6"), group, AsyncCheckpointerType.THREAD, stager)
    losses_7_9 = train(model, optim, 7, 9, rank, world)
    fut.result()
    stats = stager.last_stats
    assert stats is not None
    sd = state(model, optim, 9)
    save_reference(sd, root / "ref_b9.pt", rank)
    fut = async_save(sd, str(root / "b9"), group, AsyncCheckpointerType.PROCESS)
    train(model, optim, 10, 10, rank, world)
    fut.result()
    stager.close()
    stop_checkpoint_process(group)
    dump(root, "b", rank, checks=checks, losses_4_6=losses_4_6, losses_7_9=losses_7_9,
         stats={"shards": stats.shards, "compressed": stats.compressed_shards, "ratio": stats.ratio})


def run_c(rank: int, world: int, d: str) -> None:
    """2 ranks, a restart: resume from ``b6`` and train 7..9; load ``b9`` (the PROCESS-mode save)."""
    root = Path(d)
    model, optim = build(world, seed=2)
    checks = check_against(model, optim, load(str(root / "b6"), model, optim), root / "ref_b6.pt", 6)
    losses = train(model, optim, 7, 9, rank, world)
    fresh, fresh_optim = build(world, seed=3)
    checks_b9 = check_against(fresh, fresh_optim, load(str(root / "b9"), fresh, fresh_optim), root / "ref_b9.pt", 9)
    dump(root, "c", rank, checks=checks, checks_b9=checks_b9, losses=losses)


def run_d(rank: int, world: int, d: str) -> None:
    """3 ranks: load ``b6`` (2 -> 3), train 7..9."""
    root = Path(d)
    model, optim = build(world, seed=4)
    checks = check_against(model, optim, load(str(root / "b6"), model, optim), root / "ref_b6.pt", 6)
    dump(root, "d", rank, checks=checks, losses=train(model, optim, 7, 9, rank, world))


def run_e(rank: int, world: int, d: str) -> None:
    """1 rank: load ``a3`` (4 -> 1), train 4..6."""
    root = Path(d)
    model, optim = build(world, seed=5)
    checks = check_against(model, optim, load(str(root / "a3"), model, optim), root / "ref_a3.pt", 3)
    dump(root, "e", rank, checks=checks, losses=train(model, optim, 4, 6, rank, world))

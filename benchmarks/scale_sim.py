"""Coordinator and ``.metadata`` at scale, by simulation: nvdcp against stock DCP for N ranks.

    python -m benchmarks.scale_sim [--ranks 64 1024 4096 16384] [--items-per-rank 873]
                                   [--max-items 4000000] [--dir /tmp/nvdcp-scale-sim] [--seaweedfs]

No process group and no tensor data: one process builds what DCP's coordinator holds for an
FSDP2 save of a 7B llama-like model (32 layers, hidden 4096, MLP 11008, vocab 32000: 291
parameters, fp32, each with Adam's ``exp_avg`` and ``exp_avg_sq``, every one sharded on dim 0
over all N ranks as FSDP2 does (``torch.chunk``), so each rank holds a shard of all 873; plus
each parameter's replicated 0-d ``step`` and the ``param_groups`` byte items, which DCP's dedup
leaves on one rank), and drives the storage writer's and reader's own steps through it:

* each rank's local ``SavePlan`` (torch's planner dataclasses), passed through ``pickle`` as DCP's
  gather does (so objects are shared as on a real coordinator, and ``.metadata`` pickles as big);
* DCP's ``create_default_global_save_plan`` (builds ``Metadata``; DCP's cost, the same for both,
  reported apart), then ``writer.prepare_global_plan`` [timed];
* each rank's ``WriteResult`` list as its ``write_data`` returns it (stock: ``_StorageInfo``;
  nvdcp: ``descriptor.storage_info``), gathered through ``pickle``; nvdcp's data files made as
  sparse files of the recorded sizes, so its commit check sees a whole checkpoint;
* ``writer.finish(metadata, results)`` [timed]: for nvdcp the commit check (every data file there
  and whole), the atomic ``.metadata`` write, cleanup and the save report;
* in a fresh process: ``reader.read_metadata()``, ``set_up_storage_reader`` [timed], and one
  rank's load planning (``DefaultLoadPlanner`` on its shards, ``reader.prepare_local_plan``).

Each (side, writer, N) runs in its own subprocess. Memory is resident set size: "peak" is the
highest RSS during the timed steps (``/proc/self/clear_refs`` resets the high-water mark before
them), "live" the RSS before them (what DCP itself holds: plans, metadata, results). Where
N x items-per-rank exceeds ``--max-items``, items per rank are cut (to the first parameters of
the model) so the run fits this machine's memory; the table says so.

``--seaweedfs`` also times the commit check alone (``SaveGuard.check_data_files``) against a
SeaweedFS S3 server on loopback (``nvdcp.testing.seaweedfs``), with one small object per rank.

Writes benchmarks/results/scale_sim_<date>.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import random
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

RANKS = (64, 1024, 4096, 16384)
#: Times each load worker makes its rank's plan (the first is reported; the minimum too).
PLAN_REPEATS = 3
#: Sharded entries per rank of the full model: 291 parameters x (param, exp_avg, exp_avg_sq).
FULL_MODEL_ITEMS = 873
PARAM_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize",
                    "capturable", "differentiable", "fused", "decoupled_weight_decay", "params")
TORCH_SAVE_OVERHEAD = 1152  # bytes torch.save adds around a small tensor (stock's item length)
NVDCP_ITEM_OVERHEAD = 96  # nvdcp item header (its length only matters to integer widths)
NVDCP_FILE_HEADER = 256


# -- the model -----------------------------------------------------------------------------------
def llama_params(layers: int = 32, hidden: int = 4096, mlp: int = 11008, vocab: int = 32000) -> list[tuple[str, tuple[int, ...]]]:
    params = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        params += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.k_proj.weight", (hidden, hidden)),
            (p + "self_attn.v_proj.weight", (hidden, hidden)), (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (mlp, hidden)), (p + "mlp.up_proj.weight", (mlp, hidden)),
            (p + "mlp.down_proj.weight", (hidden, mlp)),
            (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    params += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return params


def model_entries(items_per_rank: int) -> tuple[list[tuple[str, tuple[int, ...]]], list[str]]:
    """The sharded entries (fqn, global shape), ``items_per_rank`` of them, in state-dict order
    (a parameter, then its two Adam moments), and the replicated ``step`` fqns of their params."""
    layers = max(32, math.ceil((items_per_rank - 9) / 27))
    sharded: list[tuple[str, tuple[int, ...]]] = []
    steps: list[str] = []
    for fqn, shape in llama_params(layers):
        if len(sharded) >= items_per_rank:
            break
        steps.append(f"optim.state.{fqn}.step")
        for name in (f"model.{fqn}", f"optim.state.{fqn}.exp_avg", f"optim.state.{fqn}.exp_avg_sq"):
            sharded.append((name, shape))
    return sharded[:items_per_rank], steps


def shard(dim0: int, ranks: int, rank: int) -> tuple[int, int]:
    """FSDP2's dim-0 shard (``torch.chunk``): offset and rows of ``rank``; empty shards sit at the end."""
    rows = -(-dim0 // ranks)
    offset = min(rank * rows, dim0)
    return offset, max(0, min(rows, dim0 - offset))


# -- plans and results ---------------------------------------------------------------------------
def local_plan(
    rank: int, ranks: int, sharded: list[tuple[str, tuple[int, ...]]], steps: list[str], deduped: bool = True
) -> Any:
    """Rank ``rank``'s SavePlan: its shard of every entry, and the replicated items (steps,
    param_groups, and a tensor's empty shard, which every rank past its rows holds at the same
    offset). ``deduped``: as after DCP's dedup, each replicated item kept by one rank."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import (
        BytesIOWriteData,
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    items = []
    for fqn, shape in sharded:
        offset, rows = shard(shape[0], ranks, rank)
        if deduped and rows == 0 and rank > 0 and shard(shape[0], ranks, rank - 1)[1] == 0:
            continue  # an empty shard another rank already holds (dedup keeps one)
        offsets = torch.Size((offset,) + (0,) * (len(shape) - 1))
        items.append(WriteItem(
            index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size((rows, *shape[1:]))),
                properties=TensorProperties(dtype=torch.float32), size=torch.Size(shape),
            ),
        ))
    for i, fqn in enumerate(steps):
        if not deduped or i % ranks == rank:
            items.append(WriteItem(
                index=MetadataIndex(fqn, torch.Size(())), type=WriteItemType.TENSOR,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(()), sizes=torch.Size(())),
                    properties=TensorProperties(dtype=torch.float32), size=torch.Size(()),
                ),
            ))
    if not deduped or rank == 0:
        for key in PARAM_GROUP_KEYS:
            items.append(WriteItem(index=MetadataIndex(f"optim.param_groups.0.{key}"), type=WriteItemType.BYTE_IO,
                                   bytes_io_data=BytesIOWriteData(nbytes=64)))
    return SavePlan(items)


def item_nbytes(item: Any) -> int:
    if item.tensor_data is None:
        return 64
    return math.prod(item.tensor_data.chunk.sizes) * 4


def rank_results(writer: str, plan: Any) -> list[Any]:
    """What rank ``plan``'s ``write_data`` returns: one WriteResult per item, one data file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    from nvdcp.dcp import commit, descriptor

    item_record = getattr(commit, "ItemRecord", None)  # nvdcp's records carry the item's digest
    digests = random.Random(plan.storage_data.prefix)
    results = []
    if writer == "stock":
        name, offset, codec, overhead = f"{plan.storage_data.prefix}0.distcp", 0, None, TORCH_SAVE_OVERHEAD
    else:
        name, offset, codec, overhead = f"{plan.storage_data.prefix}0.nvdcp", NVDCP_FILE_HEADER, "zstd", NVDCP_ITEM_OVERHEAD
    for item in plan.items:
        length = item_nbytes(item) + overhead
        info: Any = _StorageInfo(name, offset, length)
        if codec is not None:
            info = descriptor.storage_info(name, offset, length, codec)
            if item_record is not None:
                info = item_record(info, digests.getrandbits(32))
        results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
        offset += length
    return results


def gathered(obj: Any) -> Any:
    """``obj`` as the coordinator gets it from a collective: pickled on one rank, unpickled here."""
    return pickle.loads(pickle.dumps(obj))


# -- measurement ---------------------------------------------------------------------------------
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) << 10 if m else 0


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Meter:
    """Wall time per step; RSS before and highest RSS during a group of steps."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self.memory: dict[str, dict[str, int]] = {}

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + time.process_time() - c0

    @contextmanager
    def memory_of(self, name: str) -> Iterator[None]:
        gc.collect()
        live = _status("VmRSS")
        exact = reset_peak()
        yield
        peak = _status("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
        self.memory[name] = {"live_bytes": live, "peak_bytes": peak, "delta_bytes": peak - live}


def timed_method(meter: Meter, cls: type, name: str, label: str) -> None:
    """Time every call of ``cls.name`` into ``label`` (a step inside a timed step)."""
    original = getattr(cls, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with meter.step(label):
            return original(*args, **kwargs)

    setattr(cls, name, wrapper)


# -- workers (one subprocess each) ---------------------------------------------------------------
def make_writer(kind: str, path: str) -> Any:
    if kind == "stock":
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1)
    import nvdcp

    return nvdcp.NvcompWriter(path, sync_files=True, thread_count=1, codec="zstd")


def save_worker(writer_kind: str, ranks: int, items: int, path: str, profile: str | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

    from nvdcp.dcp.save_guard import SaveGuard
    from nvdcp.report import Report

    meter = Meter()
    sharded, steps = model_entries(items)
    shutil.rmtree(path, ignore_errors=True)
    writer = make_writer(writer_kind, path)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    gc.disable()  # building the inputs only (the timed steps run with the collector on)
    with meter.step("setup_plans"):
        plans = [gathered(writer.prepare_local_plan(local_plan(r, ranks, sharded, steps))) for r in range(ranks)]
    with meter.step("dcp_create_global_plan"):
        global_plans, metadata = create_default_global_save_plan(plans)
    del plans
    if writer_kind == "nvdcp":
        timed_method(meter, SaveGuard, "check_data_files", "commit_check")
        timed_method(meter, SaveGuard, "cleanup", "cleanup")
        timed_method(meter, Report, "from_metadata", "report")
    prof = _profiler(profile)
    gc.enable()
    with meter.memory_of("coordinator"):
        with meter.step("prepare_global_plan"), prof:
            final_plans = writer.prepare_global_plan(global_plans)
        # Off the clock: the ranks' write_data (gathered), and their data files (sparse).
        t0 = time.perf_counter()
        gc.disable()
        results = [gathered(rank_results(writer_kind, p)) for p in final_plans]
        if writer_kind == "nvdcp":
            for rank_list in results:
                if rank_list:
                    last = getattr(rank_list[-1].storage_data, "info", rank_list[-1].storage_data)
                    with open(os.path.join(path, last.relative_path), "wb") as f:
                        f.truncate(last.offset + last.length)
        gc.enable()
        gc.collect()  # the collector as a long-running coordinator has it: everything old
        off_clock = time.perf_counter() - t0
        with meter.step("finish"), prof:
            writer.finish(metadata, results)
    meter.seconds["setup_results"] = off_clock
    n_items = sum(len(r) for r in results)
    data_files = len({getattr(wr.storage_data, "info", wr.storage_data).relative_path for rank_list in results for wr in rank_list})
    _dump_profile(prof, profile)
    return {
        "side": "save", "writer": writer_kind, "ranks": ranks, "items_per_rank": items, "items": n_items,
        "data_files": data_files, "metadata_bytes": os.path.getsize(os.path.join(path, ".metadata")),
        "seconds": meter.seconds, "cpu_seconds": meter.cpu_seconds, "memory": meter.memory,
        "coordinator_s": meter.seconds["prepare_global_plan"] + meter.seconds["finish"],
    }


def _fake_dtensor(size: Any, chunk: Any) -> Any:
    """What DCP's load planner asks of a DTensor: its global size and its local chunks (an empty
    tensor, so DCP's state-dict walks pass it through as a tensor)."""
    import torch

    class FakeDTensor(torch.Tensor):
        def size(self, dim: Any = None) -> Any:  # type: ignore[override]
            return self._global_size if dim is None else self._global_size[dim]

        def __create_chunk_list__(self) -> list[Any]:
            return [self._chunk]

    global _FakeDTensor
    if _FakeDTensor is None:
        _FakeDTensor = FakeDTensor
    t = torch.Tensor._make_subclass(_FakeDTensor, torch.empty(0))
    t._global_size, t._chunk = size, chunk
    return t


_FakeDTensor: Any = None


def rank_state_dict(rank: int, ranks: int, items: int) -> dict[str, Any]:
    """The state dict rank ``rank`` loads into: its shard of every sharded entry, the steps and
    param_groups (flattened keys, as DCP's planner sees them)."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    sharded, steps = model_entries(items)
    sd: dict[str, Any] = {}
    for fqn, shape in sharded:
        offset, rows = shard(shape[0], ranks, rank)
        chunk = ChunkStorageMetadata(offsets=torch.Size((offset,) + (0,) * (len(shape) - 1)),
                                     sizes=torch.Size((rows, *shape[1:])))
        sd[fqn] = _fake_dtensor(torch.Size(shape), chunk)
    for fqn in steps:
        sd[fqn] = torch.zeros(())
    for key in PARAM_GROUP_KEYS:
        sd[f"optim.param_groups.0.{key}"] = 0
    return sd


def load_worker(reader_kind: str, ranks: int, items: int, path: str, profile: str | None) -> dict[str, Any]:
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    import nvdcp

    meter = Meter()
    rank = ranks // 2
    state_dict = rank_state_dict(rank, ranks, items)
    reader = FileSystemReader(path) if reader_kind == "stock" else nvdcp.NvcompReader(path)
    prof = _profiler(profile)
    with meter.memory_of("read_metadata"):
        with meter.step("read_metadata"), prof:
            metadata = reader.read_metadata()
        with meter.step("set_up_storage_reader"):
            reader.set_up_storage_reader(metadata, True)
    repeats: list[float] = []
    for attempt in range(PLAN_REPEATS):
        # The first plan is the one a rank makes (and pays any collector pass the reader left
        # pending); the repeats, with the same metadata, show what the machine's load adds.
        label = "rank_load_plan" if attempt == 0 else "rank_load_plan_repeat"
        t0 = time.perf_counter()
        with meter.step(label):
            planner = DefaultLoadPlanner()
            planner.set_up_planner(state_dict, metadata, False)
            plan = reader.prepare_local_plan(planner.create_local_plan())
        repeats.append(time.perf_counter() - t0)
    meter.seconds["rank_load_plan_min"] = min(repeats)
    _dump_profile(prof, profile)
    return {
        "side": "load", "writer": reader_kind, "ranks": ranks, "items_per_rank": items,
        "read_items": len(plan.items), "seconds": meter.seconds, "cpu_seconds": meter.cpu_seconds, "memory": meter.memory,
    }


def dcp_worker(ranks: int, items: int, validate: bool) -> dict[str, Any]:
    """DCP's own coordinator cost (the same under either writer): dedup of the plans as every
    rank sends them (replicated items on all), Metadata, and, if ``validate``, the overlap check
    ``DefaultSavePlanner`` runs on the global plan."""
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.default_planner import (
        _validate_global_plan,
        create_default_global_save_plan,
    )

    meter = Meter()
    sharded, steps = model_entries(items)
    with meter.step("setup_plans"):
        plans = [gathered(local_plan(r, ranks, sharded, steps, deduped=False)) for r in range(ranks)]
    with meter.memory_of("dcp"):
        with meter.step("dcp_dedup"):
            plans = dedup_save_plans(plans)
        with meter.step("dcp_create_global_plan"):
            global_plans, metadata = create_default_global_save_plan(plans)
        if validate:
            with meter.step("dcp_validate_global_plan"):
                errors = _validate_global_plan(global_plans, metadata)
            assert not errors, errors[:3]
    return {"side": "dcp", "ranks": ranks, "items_per_rank": items, "validated": validate,
            "seconds": meter.seconds, "cpu_seconds": meter.cpu_seconds, "memory": meter.memory}


def check_worker(ranks: int, url: str, endpoint: str) -> dict[str, Any]:
    """The commit check alone against S3 (credentials from the environment): one small object
    per rank, 8 records each; timed through the listing and, as before, one HEAD per file."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from nvdcp.dcp.save_guard import SaveGuard
    from nvdcp.storage import open_storage

    storage = open_storage(url, endpoint_url=endpoint)
    names = [f"__{r}_{'ab' * 6}_0.nvdcp" for r in range(ranks)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda n: storage.write_atomic(n, b"x" * 8), names))
    upload_s = time.perf_counter() - t0
    records = {(n, k): _StorageInfo(n, k, 1) for n in names for k in range(8)}
    guard = SaveGuard(storage)
    timings: dict[str, float] = {}
    for label, listing in (("listing", True), ("per_file", False)):
        if not listing:
            storage.list_sizes = lambda: None  # type: ignore[method-assign]  (the check before: a HEAD per file)
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            guard.check_data_files(records)
            best = min(best, time.perf_counter() - t0)
        timings[label] = best
    storage.delete(names)
    return {"side": "check", "ranks": ranks, "data_files": len(names), "commit_check_s": timings["listing"],
            "commit_check_per_file_s": timings["per_file"], "upload_s": upload_s}


def _profiler(path: str | None) -> Any:
    if not path:
        class _Null:
            def __enter__(self) -> None:
                return None

            def __exit__(self, *exc: Any) -> None:
                return None

        return _Null()
    import cProfile

    return cProfile.Profile()


def _dump_profile(prof: Any, path: str | None) -> None:
    if path:
        prof.dump_stats(path)


# -- driver --------------------------------------------------------------------------------------
def run_worker(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.scale_sim", *argv]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def total_items(ranks: int, items_per_rank: int) -> int:
    """Records in ``.metadata`` for this many ranks: the non-empty shards, one empty shard per
    tensor some rank has no rows of, the steps and the param_groups entries."""
    sharded, steps = model_entries(items_per_rank)
    total = len(steps) + len(PARAM_GROUP_KEYS)
    for _, shape in sharded:
        holders = -(-shape[0] // -(-shape[0] // ranks))  # ranks with rows: ceil(dim0 / rows per rank)
        total += holders + (holders < ranks)
    return total


def plan_sizes(ranks: list[int], items: int, max_items: int) -> list[tuple[int, int]]:
    """Items per rank for each rank count: ``items``, cut where the checkpoint would hold more
    than ``max_items`` records (the coordinator holds about 3.7 KB per record)."""
    out = []
    for n in ranks:
        k = items
        if total_items(n, k) > max_items:
            lo, hi = 1, items
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if total_items(n, mid) <= max_items else (lo, mid - 1)
            k = lo
        out.append((n, k))
    return out


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (ranks, writer): coordinator time and memory, .metadata size, load side."""
    by: dict[tuple[int, str, str], dict[str, Any]] = {(r["ranks"], r["side"], r.get("writer", "")): r for r in records}
    rows = []
    for (n, side, writer), rec in sorted(by.items()):
        if side != "save":
            continue
        load = by.get((n, "load", writer), {})
        mem = rec["memory"]["coordinator"]
        row = {
            "ranks": n, "writer": writer, "items/rank": rec["items_per_rank"], "items": rec["items"],
            "data files": rec["data_files"],
            "prepare_global_plan s": rec["seconds"]["prepare_global_plan"], "finish s": rec["seconds"]["finish"],
            "coordinator s": rec["coordinator_s"], "commit check s": rec["seconds"].get("commit_check"),
            "coordinator peak MiB": mem["peak_bytes"] >> 20, "finish extra MiB": mem["delta_bytes"] >> 20,
            ".metadata bytes": rec["metadata_bytes"],
            "read_metadata s": load.get("seconds", {}).get("read_metadata"),
            "read_metadata extra MiB": load.get("memory", {}).get("read_metadata", {}).get("delta_bytes", 0) >> 20 if load else None,
            "rank load plan s": load.get("seconds", {}).get("rank_load_plan"),
            "rank load plan min s": load.get("seconds", {}).get("rank_load_plan_min"),
            "dcp global plan s": rec["seconds"]["dcp_create_global_plan"],
            # CPU seconds of this process: what the machine's other load changes least
            "coordinator cpu s": rec["cpu_seconds"]["prepare_global_plan"] + rec["cpu_seconds"]["finish"],
            "read_metadata cpu s": load.get("cpu_seconds", {}).get("read_metadata"),
            "rank load plan cpu s": load.get("cpu_seconds", {}).get("rank_load_plan"),
        }
        rows.append(row)
    return rows


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    keys = ("coordinator s", "coordinator cpu s", "coordinator peak MiB", "finish extra MiB", ".metadata bytes",
            "read_metadata s", "read_metadata cpu s", "read_metadata extra MiB", "rank load plan s",
            "rank load plan min s", "rank load plan cpu s")
    for n in sorted({r["ranks"] for r in rows}):
        pair = {r["writer"]: r for r in rows if r["ranks"] == n}
        if {"stock", "nvdcp"} <= pair.keys():
            ratio = {"ranks": n}
            for k in keys:
                s, v = pair["stock"].get(k), pair["nvdcp"].get(k)
                ratio[k] = round(v / s, 3) if s and v is not None else None
            out.append(ratio)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    ap.add_argument("--items-per-rank", type=int, default=FULL_MODEL_ITEMS,
                    help=f"sharded entries per rank (default {FULL_MODEL_ITEMS}: the whole 7B model)")
    ap.add_argument("--max-items", type=int, default=3_500_000,
                    help="cut items per rank where the checkpoint would hold more records than this (memory)")
    ap.add_argument("--writers", default="stock,nvdcp")
    ap.add_argument("--dir", default="/tmp/nvdcp-scale-sim")
    ap.add_argument("--dcp", action="store_true", help="also time DCP's own dedup and global plan")
    ap.add_argument("--dcp-max-ranks", type=int, default=1024,
                    help="--dcp only up to this many ranks (its plans hold every replicated item on every rank)")
    ap.add_argument("--validate-max-ranks", type=int, default=1024,
                    help="time DCP's _validate_global_plan up to this many ranks (it is quadratic)")
    ap.add_argument("--seaweedfs", action="store_true", help="also time the commit check on SeaweedFS")
    ap.add_argument("--out", default=None, help="directory for scale_sim_<date>.json")
    ap.add_argument("--name", default="scale_sim", help="results file name before _<date>.json")
    ap.add_argument("--no-save", action="store_true", help="print only, write no JSON")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker")
    ap.add_argument("--worker", choices=("save", "load", "dcp", "check"), help=argparse.SUPPRESS)
    ap.add_argument("--writer", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--profile", help=argparse.SUPPRESS)
    ap.add_argument("--validate", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        n, k = args.ranks[0], args.items_per_rank
        if args.worker == "save":
            out = save_worker(args.writer, n, k, args.path, args.profile)
        elif args.worker == "load":
            out = load_worker(args.writer, n, k, args.path, args.profile)
        elif args.worker == "dcp":
            out = dcp_worker(n, k, args.validate)
        else:
            out = check_worker(n, args.url, args.endpoint)
        out["process_max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
        print(json.dumps(out))
        return

    writers = [w for w in args.writers.split(",") if w]  # --writers '' with --seaweedfs: the check alone
    records: list[dict[str, Any]] = []
    for n, k in plan_sizes(args.ranks, args.items_per_rank, args.max_items):
        for w in writers:
            path = os.path.join(args.dir, f"{w}_{n}")
            common = ["--ranks", str(n), "--items-per-rank", str(k), "--writer", w, "--path", path]
            for side in ("save", "load"):
                try:
                    rec = run_worker(["--worker", side, *common], args.timeout)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:  # e.g. out of memory: say so, go on
                    records.append({"side": f"{side}-failed", "writer": w, "ranks": n, "items_per_rank": k,
                                    "error": str(exc)[-2000:]})
                    print(f"{side:4} {w:5} ranks={n:6} items/rank={k:4}: FAILED {str(exc)[-300:]}", flush=True)
                    break
                records.append(rec)
                print(f"{side:4} {w:5} ranks={n:6} items/rank={k:4}: {json.dumps(rec['seconds'])}", flush=True)
            shutil.rmtree(path, ignore_errors=True)
        if args.dcp and n <= args.dcp_max_ranks:
            argv_d = ["--worker", "dcp", "--ranks", str(n), "--items-per-rank", str(k)]
            if n <= args.validate_max_ranks:
                argv_d.append("--validate")
            rec = run_worker(argv_d, args.timeout)
            records.append(rec)
            print(f"dcp        ranks={n:6} items/rank={k:4}: {json.dumps(rec['seconds'])}", flush=True)
    if args.seaweedfs:
        records += seaweedfs_checks(args.ranks, args.timeout)

    from benchmarks.common import markdown_table, write_results

    rows = summarize(records)
    cols = list(rows[0]) if rows else []
    print(markdown_table(rows, cols))
    rr = ratios(rows)
    if rr:
        print("\nnvdcp / stock:")
        print(markdown_table(rr, list(rr[0])))
    checks = [{"ranks": r["ranks"], "data files": r["data_files"], "listing s": r["commit_check_s"],
               "a HEAD per file s": r["commit_check_per_file_s"]} for r in records if r["side"] == "check"]
    if checks:
        print("\ncommit check on SeaweedFS (loopback):")
        print(markdown_table(checks, list(checks[0])))
    if not args.no_save:
        payload = {"ranks": args.ranks, "items_per_rank": args.items_per_rank, "max_items": args.max_items,
                   "rows": rows, "ratios": rr, "seaweedfs_commit_check": checks, "records": records}
        print("written", write_results(args.name, payload, args.out))


def seaweedfs_checks(ranks: list[int], timeout: float) -> list[dict[str, Any]]:
    """The commit check on a SeaweedFS server on loopback (nvdcp.testing.seaweedfs), per rank count."""
    from nvdcp.testing.seaweedfs import SeaweedFS

    out = []
    with SeaweedFS(bucket="nvdcp-scale-sim") as server:
        env = {**os.environ, **server.env}
        for n in ranks:
            url = f"s3://{server.bucket}/scale-{n}"
            rec = run_worker(["--worker", "check", "--ranks", str(n), "--url", url, "--endpoint", server.endpoint],
                             timeout, env=env)
            out.append(rec)
            print(f"check seaweedfs ranks={n}: listing {rec['commit_check_s']:.3f}s, "
                  f"a HEAD per file {rec['commit_check_per_file_s']:.3f}s", flush=True)
    return out


if __name__ == "__main__":
    main()

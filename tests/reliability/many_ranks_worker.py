"""Ranks of tests/reliability/test_many_ranks.py: the state, the phases, the zygote that forks them.

The state: four tensors DTensor-sharded on dim 0 over a 1-D mesh with row counts that do not
divide evenly (on 16 ranks ``ids`` has 10 rows and ``mask`` 3, so most ranks hold empty shards;
on 5 ranks ``b16``'s 37 rows are 8,8,8,8,5), a tensor replicated as a DTensor, a plain tensor
every rank holds the same copy of, and non-tensor leaves. Every value follows from a seed, so
each rank checks what it loaded against its own slice of the reference, without collectives.

Processes: the test starts one :func:`zygote` from the forkserver of ``nvdcp.testing.faults``
(torch already imported); it imports what DTensor needs on first use (``torch._dynamo``: ~2 s
of CPU, which 16 ranks would each pay again), freezes its heap for the gc, and then forks the
ranks of every phase. Each rank writes ``<phase>_<rank>.json`` (its shard rows, or the
traceback of what failed) after the phase's final barrier, then tears its gloo group down as
tests/_dist.py does; forked children end with ``os._exit``, so no interpreter teardown runs
with gloo threads alive.
"""

from __future__ import annotations

import ctypes
import gc
import json
import multiprocessing
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import nvdcp
from nvdcp.demo.teardown import release_dtensor_caches
from nvdcp.testing import bit_equal, random_tensor, weights_like
from nvdcp.testing.faults import Stopper, StoppingWriter, join_within
from tests._dist import free_port

#: Collectives give up after this long (a rank that died leaves its peers waiting at most this).
GLOO_TIMEOUT_S = 30

#: Sharded on dim 0: name -> (global shape, dtype, bit generator).
SHARDED: dict[str, tuple[tuple[int, ...], torch.dtype, str]] = {
    "w": ((100, 512), torch.float32, "weights"),     # 16 ranks: 7 rows x 14, 2, 0
    "b16": ((37, 96), torch.bfloat16, "weights"),    # 16 ranks: 3 x 12, 1, 0, 0, 0; 5 ranks: 8,8,8,8,5
    "ids": ((10, 64), torch.int64, "bits"),          # 16 ranks: 1 x 10, then 6 empty
    "mask": ((3, 200), torch.bool, "bits"),          # 16 ranks: 1 x 3, then 13 empty
}
REPLICATED = ("rep", (48, 64), torch.float32)        # DTensor, Replicate()
PLAIN = ("shared", (300,), torch.int32)              # a plain tensor, the same on every rank

#: Writer settings of every save: 1 KiB chunks (many per item), two data files per rank.
WRITER_KWARGS: dict[str, Any] = {"thread_count": 2, "chunk_bytes": 1024, "codec": "zstd",
                                 "codec_threads": 1, "sync_files": False}


def global_state(seed: int) -> dict[str, Any]:
    """The whole state of ``seed`` as plain tensors (what a 1-process load returns)."""
    out: dict[str, Any] = {}
    for i, (name, (shape, dtype, kind)) in enumerate(SHARDED.items()):
        s = seed * 100 + i
        out[name] = weights_like(shape, dtype, seed=s) if kind == "weights" else random_tensor(dtype, shape, seed=s)
    name, shape, dtype = REPLICATED
    out[name] = random_tensor(dtype, shape, seed=seed * 100 + 50)  # every bit pattern, NaNs included
    name, shape, dtype = PLAIN
    out[name] = random_tensor(dtype, shape, seed=seed * 100 + 51)
    out["extra"] = {"seed": seed, "note": f"state {seed}", "sizes": [7, 3, 1]}
    return out


def local_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of ``rank``'s dim-0 shard: torch.chunk's split (ceil), computed here on its
    own so the check does not trust DTensor's arithmetic."""
    per = -(-rows // world)
    start = min(rank * per, rows)
    return start, min(start + per, rows)


def sharded_state(seed: int, rank: int, world: int, *, zeros: bool = False) -> dict[str, Any]:
    """This rank's view of ``seed``'s state over a ``world``-rank mesh (``zeros``: a load target)."""
    mesh = init_device_mesh("cpu", (world,))
    full = global_state(seed)
    out: dict[str, Any] = {}
    for name in SHARDED:
        t = full[name]
        a, b = local_rows(t.shape[0], rank, world)
        local = t[a:b].clone()
        if zeros:
            local.zero_()
        out[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride())
    name = REPLICATED[0]
    rep = torch.zeros_like(full[name]) if zeros else full[name].clone()
    out[name] = DTensor.from_local(rep, mesh, [Replicate()], run_check=False)
    name = PLAIN[0]
    out[name] = torch.zeros_like(full[name]) if zeros else full[name].clone()
    out["extra"] = {k: None for k in full["extra"]} if zeros else dict(full["extra"])
    return out


def check_local(sd: dict[str, Any], seed: int, rank: int, world: int) -> list[str]:
    """Names whose local value differs (bit-exactly) from this rank's slice of the reference."""
    full = global_state(seed)
    bad = []
    for name in SHARDED:
        a, b = local_rows(full[name].shape[0], rank, world)
        if not bit_equal(sd[name].to_local(), full[name][a:b]):
            bad.append(name)
    if not bit_equal(sd[REPLICATED[0]].to_local(), full[REPLICATED[0]]):
        bad.append(REPLICATED[0])
    if not bit_equal(sd[PLAIN[0]], full[PLAIN[0]]):
        bad.append(PLAIN[0])
    if sd["extra"] != full["extra"]:
        bad.append("extra")
    return bad


def shard_rows(sd: dict[str, Any]) -> dict[str, int]:
    return {name: sd[name].to_local().shape[0] for name in SHARDED}


# -- phases -------------------------------------------------------------------------------------

def save(rank: int, world: int, path: str, seed: int, stop: dict[str, Any] | None = None) -> dict[str, Any]:
    """Save ``seed``'s state; the rank named in ``stop`` SIGKILLs itself after ``after_bytes``."""
    sd = sharded_state(seed, rank, world)
    stopper = Stopper(after_bytes=stop["after_bytes"]) if stop and stop["rank"] == rank else None
    dcp.save(sd, storage_writer=StoppingWriter(path, stopper=stopper, **WRITER_KWARGS))
    return {"rows": shard_rows(sd)}


def load(rank: int, world: int, path: str, seed: int) -> dict[str, Any]:
    """Load into zeroed DTensors over this world's mesh; compare with ``seed``'s reference."""
    sd = sharded_state(seed, rank, world, zeros=True)
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(path, thread_count=2, codec_threads=1))
    return {"rows": shard_rows(sd), "mismatches": check_local(sd, seed, rank, world)}


PHASES = {"save": save, "load": load}


def zygote(conn: Any) -> None:
    """Serve ``(world, phase, out, args, deadline_s)`` requests from ``conn`` until None: fork the
    ``world`` ranks of the phase, wait, kill the ranks still running after ``deadline_s``, and
    answer their exit codes (None: killed at the deadline; -9: SIGKILLed itself)."""
    import torch._dynamo  # noqa: F401  (DTensor.from_local imports it on first use)

    # The ranks' gc passes (release_dtensor_caches collects) then skip the inherited heap:
    # without this each of 16 ranks walks, and so copies, all of it: ~3 s of wall time a phase.
    gc.freeze()
    fork = multiprocessing.get_context("fork")
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        world, phase, out, args, deadline_s = request
        port = free_port()
        procs = [fork.Process(target=entry, args=(r, world, port, out, phase, args)) for r in range(world)]
        for p in procs:
            p.start()
        conn.send(join_within(procs, deadline_s))


def entry(rank: int, world: int, port: int, out: str, phase: str, args: dict[str, Any]) -> None:
    """One rank of one phase: the result (or the failure) goes to ``<out>/<phase>_<rank>.json``."""
    # Die with the zygote (killed by the test at its own deadline): no rank outlives the test.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    started = time.monotonic()
    result: dict[str, Any] = {"rank": rank}
    ok = False
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=GLOO_TIMEOUT_S))
        result["init_s"] = round(time.monotonic() - started, 2)
        result.update(PHASES[phase](rank, world, **args))
        result["work_s"] = round(time.monotonic() - started, 2)
        # No rank tears its group down while a peer still talks on it (see tests/_dist.py).
        dist.barrier()
        ok = True
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        result["traceback"] = traceback.format_exc()[-6000:]
    result["ok"] = ok
    result["seconds"] = round(time.monotonic() - started, 2)
    (Path(out) / f"{phase}_{rank}.json").write_text(json.dumps(result))
    if ok:
        # Without this the group outlives destroy_process_group (nvdcp/demo/teardown.py).
        release_dtensor_caches()
        dist.destroy_process_group()
    # A failed rank leaves its group as it is: a peer is dead or stuck, and the process ends
    # with os._exit (multiprocessing's forked children), so no teardown races its threads.
    sys.exit(0 if ok else 1)

"""Several ranks on one host saving and loading at once: thread pools sized per rank or per host.

    python -m benchmarks.local_ranks_bench [--ranks 2] [--case small] [--rounds 3] [--dir DIR]

torchrun starts one process per GPU on the same cores. Until ``nvdcp.cores`` each rank sized
its codec threads, data files and I/O threads by the whole machine (``os.cpu_count()``), so N
ranks ran N times as many threads as cores. This runs ``--ranks`` real processes (gloo on
127.0.0.1, CPU tensors, each rank its share of a ``cpu_pipeline_bench`` workload) that save one
DCP checkpoint with nvdcp's default arguments and load it back, in settings alternating
over ``--rounds`` (each in fresh processes), one setting per ``--locals`` value L: every rank
sees ``LOCAL_WORLD_SIZE=L`` and sizes its pools for 1/L of the host's usable cores. ``L=1`` is
the sizing before (every core, each rank); ``L=N`` is what torchrun sets (each rank its share);
values between give each rank some slack over its share.

Reported per setting: the slowest rank's save and load seconds (medians over rounds), every
load checked bit-exact. Writes ``benchmarks/results/local_ranks_bench_<date>.json``.
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from benchmarks.common import write_results


def _rank(rank: int, world: int, port: int, case: str, path: str, local: int, out: Any) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(local)  # before nvdcp sizes a pool
    os.environ["OMP_NUM_THREADS"] = "1"
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import nvdcp
    from benchmarks.cpu_pipeline_bench import WORKLOADS
    from benchmarks.workload import states_equal, zeros_like_state
    from nvdcp.cores import usable_cores

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        state = _rank_state(WORKLOADS[case], rank, world)
        target = zeros_like_state(state)
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=nvdcp.NvcompWriter(path, on_identical_save="ignore"))
        save_s = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=nvdcp.NvcompReader(path))
        load_s = time.perf_counter() - t0
        exact = states_equal(state, target)
        dist.barrier()
        out.put({"rank": rank, "save_s": save_s, "load_s": load_s, "bit_exact": exact, "cores": usable_cores()})
    finally:
        dist.destroy_process_group()


def _rank_state(workload: Any, rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank``'s part of a workload: a workload that takes a ``count`` (``small``,
    ``moe``) is built at ``count / world`` items from the rank's own seed, so no rank generates
    (and holds) the whole state; any other is built whole and shared out (:func:`_share`)."""
    params = inspect.signature(workload).parameters
    if "count" in params:
        return _share(workload(count=params["count"].default // world, seed=rank), rank, 1)
    return _share(workload(), rank, world)


def _share(state: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank``'s items of a flat or one-level state (every ``world``-th, by key order): a
    rank of a sharded job saves its own shards under keys no other rank has."""
    flat: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return {f"rank{rank}.{k}": v for i, (k, v) in enumerate(sorted(flat.items())) if i % world == rank}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_once(case: str, ranks: int, local: int, path: str) -> dict[str, Any]:
    """One save and load by ``ranks`` processes; the slowest rank's times."""
    shutil.rmtree(path, ignore_errors=True)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, ranks, port, case, path, local, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    rows = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a rank exited with {p.exitcode}")
    shutil.rmtree(path, ignore_errors=True)
    return {
        "save_s": max(r["save_s"] for r in rows), "load_s": max(r["load_s"] for r in rows),
        "bit_exact": all(r["bit_exact"] for r in rows), "cores_per_rank": rows[0]["cores"],
    }


def _summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per setting: the medians over its rounds."""
    return {
        s: {"save_s": statistics.median(r["save_s"] for r in rows), "load_s": statistics.median(r["load_s"] for r in rows),
            "cores_per_rank": rows[0]["cores_per_rank"], "bit_exact": all(r["bit_exact"] for r in rows)}
        for s, rows in runs.items() if rows
    }


def _record(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> Path:
    return write_results("local_ranks_bench", {
        "case": args.case, "ranks": args.ranks, "rounds": args.rounds, "summary": _summary(runs), "runs": runs,
    }, args.out, args.suffix)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--case", default="small", help="a cpu_pipeline_bench workload (small, large, moe, demo)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--locals", default=None, help="LOCAL_WORLD_SIZE values to compare (default: 1,RANKS)")
    ap.add_argument("--dir", default="/tmp/nvdcp-local-ranks")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--suffix", default="")
    args = ap.parse_args(argv)
    locals_ = [int(v) for v in (args.locals or f"1,{args.ranks}").split(",")]
    runs: dict[str, list[dict[str, Any]]] = {f"local={v}": [] for v in locals_}
    run_once(args.case, args.ranks, args.ranks, os.path.join(args.dir, "warm"))  # first-use costs, untimed
    for rnd in range(args.rounds):
        for local in locals_ if rnd % 2 == 0 else locals_[::-1]:
            setting = f"local={local}"
            row = run_once(args.case, args.ranks, local, os.path.join(args.dir, setting))
            runs[setting].append(row)
            print(f"round {rnd} {setting}: save {row['save_s']:.3f} s, load {row['load_s']:.3f} s, "
                  f"{row['cores_per_rank']} cores a rank, bit-exact {row['bit_exact']}", flush=True)
            _record(args, runs)  # after every run: a run cut short keeps what it measured
    summary = _summary(runs)
    for s, row in summary.items():
        print(f"{s}: save {row['save_s']:.3f} s, load {row['load_s']:.3f} s (medians; {row['cores_per_rank']} cores a rank)")
    first = summary[f"local={locals_[0]}"]
    for s, row in summary.items():
        print(f"{s} / local={locals_[0]}: save {row['save_s'] / first['save_s']:.3f}x, "
              f"load {row['load_s'] / first['load_s']:.3f}x")
    target = _record(args, runs)
    print(f"-> {target}")


if __name__ == "__main__":
    sys.exit(main())

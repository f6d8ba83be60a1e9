"""GPU load of large tensors from /dev/shm against the reader's knobs (issue 18: load >= 15 GB/s).

    python -m benchmarks.load_knobs --out DIR [--gb 4] [--dir /dev/shm/nvdcp-knobs] [--repeats 3]
    python -m benchmarks.load_knobs --out DIR --first-load     # a fresh process per setting

``--first-load``: each setting in a fresh process that saves, then times its first load (what a
job resuming from a checkpoint pays: pinned staging is allocated then) and the loads after it.

Saves 4 GB of fp32 in 64 MiB tensors on ``cuda:0`` once with default arguments, then loads it
into zeroed GPU tensors with each combination of GPU decode batches in flight
(``nvdcp.dcp.reader.MAX_GPU_THREADS``, with ``thread_count`` to match), pinned staging budget
(``GpuConfig.pinned_memory_bytes``) and GPU scratch budget (``GpuConfig.gpu_memory_bytes``),
in one process, ``--repeats`` loads each after one untimed load; medians, GB/s of state,
bit-exactness of every load. Writes ``load_knobs_<date>.json`` (date, machine, command).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from benchmarks.common import fresh_dir, markdown_table, write_results
from nvdcp.dcp import reader as reader_mod
from nvdcp.gpu.config import GpuConfig

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--dir", default="/dev/shm/nvdcp-knobs")
    p.add_argument("--gb", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", default="4,6,8")
    p.add_argument("--pinned-mib", default="512,1024")
    p.add_argument("--gpu-mib", default="0", help="GPU scratch budgets in MiB (0: the default)")
    p.add_argument("--first-load", action="store_true", help="each setting in a fresh process, first load timed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("load_knobs needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.first_load:
        return _fresh_processes(args)
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)
    n = max(1, int(args.gb * 1e9 / (64 * MiB)))
    state = {f"t{i}": torch.randn(16 * MiB, device=dev, generator=g) * 0.02 for i in range(n)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    path = os.path.join(fresh_dir(args.dir), "ckpt")
    dcp.save(state, storage_writer=nvdcp.NvcompWriter(path))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    rows: list[dict[str, Any]] = []
    for threads, pinned, gpu_mib in itertools.product(
        [int(x) for x in args.threads.split(",")], [int(x) for x in args.pinned_mib.split(",")],
        [int(x) for x in args.gpu_mib.split(",")],
    ):
        reader_mod.MAX_GPU_THREADS = threads
        config = GpuConfig(pinned_memory_bytes=pinned * MiB, gpu_memory_bytes=gpu_mib * MiB or None)
        times, exact, first = [], True, None
        for k in range(args.repeats + 1):
            for t in target.values():
                t.zero_()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dcp.load(target, storage_reader=nvdcp.NvcompReader(path, thread_count=max(threads, 8), gpu=config))
            torch.cuda.synchronize()
            if k:
                times.append(time.perf_counter() - t0)
            else:
                first = time.perf_counter() - t0
            exact = exact and all(torch.equal(target[key], state[key]) for key in state)
        med = statistics.median(times)
        rows.append({"gpu_threads": threads, "pinned_MiB": pinned, "gpu_MiB": gpu_mib or "default",
                     "load_s": med, "load_GB/s": nbytes / med / 1e9, "all_s": [round(t, 3) for t in times],
                     "first_load_s": first,
                     "bit_exact": exact})
        print(f"  threads {threads} pinned {pinned} MiB gpu {gpu_mib or 'default'}: {med:.3f} s "
              f"({nbytes / med / 1e9:.2f} GB/s) {rows[-1]['all_s']} exact {exact}", flush=True)
    print(markdown_table(rows, ["gpu_threads", "pinned_MiB", "gpu_MiB", "first_load_s", "load_s", "load_GB/s", "bit_exact"]))
    if args.worker:
        print("ROWS " + json.dumps(rows), flush=True)
        return 0
    extra = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "state_bytes": nbytes, "args": vars(args)}
    print(f"wrote {write_results('load_knobs', {**extra, 'results': rows}, args.out)}")
    return 0 if all(r["bit_exact"] for r in rows) else 1


def _fresh_processes(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for threads, pinned, gpu_mib in itertools.product(args.threads.split(","), args.pinned_mib.split(","),
                                                      args.gpu_mib.split(",")):
        cmd = [sys.executable, "-m", "benchmarks.load_knobs", "--worker", "--dir", args.dir, "--gb", str(args.gb),
               "--repeats", str(args.repeats), "--threads", threads, "--pinned-mib", pinned, "--gpu-mib", gpu_mib]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        found = [ln for ln in done.stdout.splitlines() if ln.startswith("ROWS ")]
        if not found:
            rows.append({"gpu_threads": threads, "pinned_MiB": pinned, "gpu_MiB": gpu_mib,
                         "error": (done.stderr.strip().splitlines() or ["no output"])[-1]})
            continue
        rows.extend(json.loads(found[-1][5:]))
        r = rows[-1]
        print(f"  fresh process: threads {threads} pinned {pinned} MiB gpu {gpu_mib}: first load "
              f"{r['first_load_s']:.3f} s, then {r['load_s']:.3f} s", flush=True)
    print(markdown_table(rows, ["gpu_threads", "pinned_MiB", "gpu_MiB", "first_load_s", "load_s", "load_GB/s", "bit_exact"]))
    extra = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "torch": torch.__version__,
             "args": vars(args), "mode": "first-load"}
    print(f"wrote {write_results('load_knobs', {**extra, 'results': rows}, args.out, suffix='_first_load')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

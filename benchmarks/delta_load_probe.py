"""Where a depth-1 delta load's extra time goes, against a full load of the same state (issue 15).

    python -m benchmarks.delta_load_probe [--variant bf16|fp32] [--loads 8] [--device cuda|cpu]
        [--root /dev/shm/dlp] [--profile] [--max-gpu-threads N] [--out DIR] [--suffix _h100_fold]

State: ``delta_probe``'s synthetic chain (671 MB raw: 160 bf16 or 80 fp32 tensors of 2 M
elements). Saves a full checkpoint, a delta against it (``DeltaPolicy``) and a full checkpoint of
the delta's state, then loads the two checkpoints of that state ``--loads`` times each,
alternating, into the same destination tensors after two rounds kept apart (``warm_up_s``: the
first full and depth-1 loads of the process pay its one-time costs, such as compiling Triton
kernels when ``TRITON_CACHE_DIR`` is empty), and checks the last load bit-exact. Reports the medians, their ratio and each load's report phases (seconds summed
over threads). ``--profile`` adds, per load kind, a CUDA timeline (copies, kernels and how long
the GPU was busy, :mod:`benchmarks.cuda_timeline`) and every thread's stack sampled over six
loads (``gpu_pipeline_bench.StackSampler``'s summary: top lines per thread group).

Comparing two settings (``NVDCP_GPU_FOLD=0`` against the default, or ``--max-gpu-threads``, which
sets the reader's ``MAX_GPU_THREADS`` for the process) means one process per setting,
alternating, several rounds: these machines are noisy.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import nvdcp
import nvdcp.dcp.reader as reader_module
from benchmarks.common import write_results
from benchmarks.delta_probe import chain_states
from benchmarks.gpu_pipeline_bench import StackSampler


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def probe(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if args.max_gpu_threads:
        reader_module.MAX_GPU_THREADS = args.max_gpu_threads
    states = chain_states(args.variant, 2, args.device)
    root = Path(args.root) / args.variant
    shutil.rmtree(root, ignore_errors=True)
    policy = nvdcp.DeltaPolicy(full_every=100)
    dcp.save(states[0], storage_writer=nvdcp.NvcompWriter(root / "p0", delta=policy), no_dist=True)
    dcp.save(states[1], storage_writer=nvdcp.NvcompWriter(root / "p1", delta=policy), no_dist=True)
    dcp.save(states[1], storage_writer=nvdcp.NvcompWriter(root / "f1", on_identical_save="ignore"), no_dist=True)
    dest = {k: torch.empty_like(v) for k, v in states[1].items()}
    paths = {"full": root / "f1", "d1": root / "p1"}

    def load(kind: str) -> nvdcp.NvcompReader:
        reader = nvdcp.NvcompReader(paths[kind])
        dcp.load(dest, storage_reader=reader, no_dist=True)
        sync()
        return reader

    times: dict[str, list[float]] = {"full": [], "d1": []}
    first: dict[str, list[float]] = {"full": [], "d1": []}  # the untimed rounds: the first pays the process's setup
    for _ in range(2):
        for kind in first:
            t0 = time.perf_counter()
            load(kind)
            first[kind].append(time.perf_counter() - t0)
    phases: dict[str, dict[str, float]] = {}
    cpu: dict[str, list[float]] = {"full": [], "d1": []}  # the process's CPU seconds (user + system) per load
    for _ in range(args.loads):
        for kind in times:
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            reader = load(kind)
            times[kind].append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu[kind].append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
            phases[kind] = {k: round(v, 4) for k, v in (reader.last_report.phases if reader.last_report else {}).items()}
    exact = all(torch.equal(_bits(dest[k]), _bits(states[1][k])) for k in dest)
    med = {kind: statistics.median(v) for kind, v in times.items()}
    row: dict[str, Any] = {
        "variant": args.variant, "seconds": times, "median_s": med, "warm_up_s": first, "d1_over_full": med["d1"] / med["full"],
        "cpu_s": cpu, "median_cpu_s": {kind: statistics.median(v) for kind, v in cpu.items()},
        "phases": phases, "bit_exact": exact,
        "bytes": {kind: sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) for kind, path in paths.items()},
        # the GPU path's chain fold (nvdcp/gpu/fold.py); host loads never use it
        "fold_kernel": device.type == "cuda" and os.environ.get("NVDCP_GPU_FOLD", "1") != "0",
        "max_gpu_threads": reader_module.MAX_GPU_THREADS,
    }
    if args.profile:
        from benchmarks.cuda_timeline import cuda_timeline

        for kind in times:
            if device.type == "cuda":
                row[f"timeline_{kind}"] = cuda_timeline(lambda kind=kind: load(kind))
            with StackSampler() as sampler:
                for _ in range(6):
                    load(kind)
            row[f"stacks_{kind}"] = sampler.summary()
    shutil.rmtree(root, ignore_errors=True)
    return row


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--loads", type=int, default=8)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--root", default="/dev/shm/nvdcp-delta-load-probe")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--max-gpu-threads", type=int, default=None,
                   help="GPU decode batches in flight (the reader's MAX_GPU_THREADS; thread_count still caps it)")
    p.add_argument("--out", default=None)
    p.add_argument("--suffix", default="")
    args = p.parse_args(argv)
    row = probe(args)
    med = row["median_s"]
    print(f"{args.variant} fold_kernel={row['fold_kernel']}: full load {med['full']:.4f} s, depth-1 {med['d1']:.4f} s "
          f"({row['d1_over_full']:.2f}x); process CPU {row['median_cpu_s']['full']:.3f} / {row['median_cpu_s']['d1']:.3f} s; "
          f"bit-exact {row['bit_exact']}", flush=True)
    path = write_results("delta_load_probe", {"benchmark": "delta_load_probe", "issue": 15, "device": args.device,
                                              "rows": [row]}, args.out, args.suffix)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()

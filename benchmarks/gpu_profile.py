"""Where the GPU codec stage spends its time: torch.profiler (CUDA kernels and host ops) and
cProfile (Python) of one encode and one decode of the reference fp32 state.

    python -m benchmarks.gpu_profile [--steps 40] [--out DIR]

Prints the tables and writes benchmarks/results/gpu_profile_<date>.json (wall times per phase,
the top kernels by CUDA time). A diagnostic for optimising `nvdcp.gpu`, not a pass/fail check.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from typing import Any

import numpy as np
import torch

from benchmarks.common import write_results
from benchmarks.gpu_bench import encoder_jobs
from benchmarks.workload import train_state
from nvdcp.demo.model import GPTConfig
from nvdcp.gpu.config import GpuConfig
from nvdcp.gpu.decoder import DecodeRequest, GpuDecoder
from nvdcp.gpu.encoder import GpuEncoder


def timed(fn: Any, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def python_profile(fn: Any, top: int = 25) -> str:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def torch_profile(fn: Any, top: int = 20) -> tuple[str, list[dict[str, Any]]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    table = events.table(sort_by="cuda_time_total", row_limit=top)
    rows = sorted(
        ({"name": e.key[:80], "calls": e.count, "cuda_ms": round(getattr(e, "device_time_total", 0) / 1e3, 2),
          "cpu_ms": round(e.cpu_time_total / 1e3, 2)} for e in events),
        key=lambda r: -r["cuda_ms"],
    )[:top]
    return table, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    state, _ = train_state("cuda", cfg=GPTConfig.reference(), steps=args.steps, batch=32)
    device = torch.device("cuda", 0)
    jobs = encoder_jobs(state)
    raw = sum(j.data.numel() for j in jobs)
    cfg = GpuConfig()
    encoder = GpuEncoder(device, chunk_bytes=65536, budget_bytes=cfg.gpu_budget(device), gdeflate_type=0)
    items = [(j, bytes(e.header_bytes), b"".join(bytes(c) for c in e.chunks), e.header) for j, e in encoder.encode(jobs)]

    def encode() -> None:
        for _ in encoder.encode(jobs):
            pass

    def kernels() -> None:
        launched = [encoder._launch(jobs, b, k % 2) for k, b in enumerate(encoder._plan(jobs))]
        for lch in launched:
            lch.stream.synchronize()

    decoder = GpuDecoder(device, budget_bytes=cfg.gpu_budget(device))
    requests = [DecodeRequest(h, j.dtype, "profile", payload=np.frombuffer(p, dtype=np.uint8)) for j, _, p, h in items]

    def decode() -> None:
        decoder.decode_many(requests)

    decode()
    phases = {name: timed(fn) for name, fn in [("encode", encode), ("launch_only", kernels), ("decode", decode)]}
    results: dict[str, Any] = {"raw_bytes": raw, "seconds": {k: round(v, 4) for k, v in phases.items()},
                               "GBps": {k: round(raw / v / 1e9, 1) for k, v in phases.items()}}
    print(results, flush=True)
    for name, fn in [("encode", encode), ("decode", decode)]:
        table, rows = torch_profile(fn)
        results[f"{name}_kernels"] = rows
        print(f"\n== {name}: torch.profiler, by CUDA time ==\n{table}", flush=True)
        print(f"\n== {name}: cProfile, by own time ==\n{python_profile(fn)}", flush=True)
    print(f"wrote {write_results('gpu_profile', results, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

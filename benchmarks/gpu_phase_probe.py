"""Wall time of each host step of the GPU encoder's writer path, per bucket (a diagnostic).

    python -m benchmarks.gpu_phase_probe [--steps 40]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.gpu_bench import encoder_jobs
from benchmarks.workload import train_state
from nvdcp.demo.model import GPTConfig
from nvdcp.gpu.config import GpuConfig
from nvdcp.gpu.encoder import GpuEncoder, _PooledSink


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    state, _ = train_state("cuda", cfg=GPTConfig.reference(), steps=args.steps, batch=32)
    device = torch.device("cuda", 0)
    jobs = encoder_jobs(state)
    enc = GpuEncoder(device, chunk_bytes=65536, budget_bytes=GpuConfig().gpu_budget(device), gdeflate_type=0)
    for rep in range(3):
        totals: dict[str, float] = {}
        sink = _PooledSink(enc.pinned)
        torch.cuda.synchronize()
        t_all = time.perf_counter()
        clock = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            totals[name] = totals.get(name, 0.0) + now - clock
            clock = now

        gen = enc._buckets(jobs, None, sink)
        while True:
            try:
                hb = next(gen)
            except StopIteration:
                break
            lap("launch+pack+d2h enqueue")
            hb.done.synchronize()
            lap("wait d2h")
            views = hb.views()
            lap("views")
            crcs = hb.checksums()
            lap("crc")
            bytes_total = sum(len(v) for v in views)
            lap("len")
            for v in views[:64]:
                bytes(v)
            lap("bytes(64 views)")
            sink.release()
            del views, crcs
            lap("release")
        totals["total"] = time.perf_counter() - t_all
        print(rep, {k: round(v * 1e3, 1) for k, v in totals.items()}, "ms; last bucket stored", bytes_total, flush=True)


if __name__ == "__main__":
    main()

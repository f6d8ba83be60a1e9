"""CPU benchmark (issue 2): nvdcp against stock DCP writers on the CPU reference workload.

    python -m benchmarks.cpu_bench [--steps 30] [--threads 1] [--dir /tmp/nvdcp-cpu-bench]

The workload is the byte-level GPT of nvdcp/demo/workload.py at CPU size (d=256, 4 layers)
trained a few steps with AdamW: fp32 params + exp_avg + exp_avg_sq, and its bf16 variant. One run compares
stock FileSystemWriter, FileSystemWriter + torch's ZStandard extension and nvdcp at the same
thread_count: bytes, ratio, save time (fsync on) and load time. Writes
benchmarks/results/cpu_bench_<date>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from benchmarks.common import dir_bytes, fresh_dir, markdown_table, write_results
from benchmarks.workload import states_equal, tensor_bytes, to_bf16, train_state, zeros_like_state
from nvdcp.demo.model import GPTConfig


def zstd_writer(path: str, threads: int) -> Any:
    from torch.distributed.checkpoint._extension import ZStandard

    return dcp.FileSystemWriter(path, thread_count=threads, _extensions=[ZStandard()])


def measure(name: str, state: Any, root: str, writer: Any, reader: Any, repeats: int) -> dict[str, Any]:
    saves, loads = [], []
    exact = True
    for _ in range(repeats):
        path = fresh_dir(os.path.join(root, name.replace(" ", "_")))
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=writer(path))
        saves.append(time.perf_counter() - t0)
        target = zeros_like_state(state)
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=reader(path))
        loads.append(time.perf_counter() - t0)
        exact &= states_equal(state, target)
    return {"writer": name, "bytes": dir_bytes(path), "save_s": min(saves), "load_s": min(loads),
            "bit_exact": exact, "repeats": repeats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/nvdcp-cpu-bench")
    ap.add_argument("--small", action="store_true", help="tiny model, one repeat (smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = GPTConfig(d_model=64, n_layers=1, n_heads=2, context=32) if args.small else GPTConfig()
    steps = 2 if args.small else args.steps
    repeats = 1 if args.small else args.repeats
    torch.set_num_threads(os.cpu_count() or 1)
    state, loss = train_state("cpu", cfg=cfg, steps=steps, batch=8)
    t = args.threads
    results: dict[str, Any] = {"workload": {"config": cfg.__dict__, "steps": steps, "final_loss": round(loss, 3)},
                               "thread_count": t, "variants": {}}
    for label, st in (("fp32_adamw", state), ("bf16", to_bf16(state))):
        raw = tensor_bytes(st)
        rows = [
            measure(f"stock t{t}", st, args.dir, lambda p: dcp.FileSystemWriter(p, thread_count=t),
                    dcp.FileSystemReader, repeats),
            measure(f"stock+ZStandard t{t}", st, args.dir, lambda p: zstd_writer(p, t), dcp.FileSystemReader, repeats),
            measure(f"nvdcp t{t}", st, args.dir, lambda p: nvdcp.NvcompWriter(p, thread_count=t),
                    nvdcp.NvcompReader, repeats),
        ]
        for r in rows:
            r["ratio"] = round(raw / r["bytes"], 4)
        results["variants"][label] = {"raw_bytes": raw, "rows": rows}
        print(f"\n{label}: {raw:,} bytes of tensors")
        print(markdown_table(rows, ["writer", "bytes", "ratio", "save_s", "load_s", "bit_exact"]), flush=True)
    print("written", write_results("cpu_bench", results, args.out))


if __name__ == "__main__":
    main()

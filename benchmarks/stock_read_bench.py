"""Reading a stock DCP checkpoint: nvdcp's NvcompReader against torch's FileSystemReader.

    python -m benchmarks.stock_read_bench [--mib 256] [--repeats 7] [--dir /tmp/nvdcp-stock-read-bench]

Writes stock checkpoints with torch's ``FileSystemWriter`` (plain, and through torch's
``ZStandard`` stream extension), then loads each into a preallocated state dict with stock
``FileSystemReader`` and with ``NvcompReader`` (default ``thread_count`` and ``thread_count=1``),
alternating readers within each repeat so page-cache state and machine noise hit them alike
(the files are read once before timing: warm page cache, as a restart from local disk is after
the save). Every load is checked bit-exact. The target is nvdcp <= 1.1x stock's time. Reported
per reader: median and best wall time (and their ratio to stock's), and the process CPU time of
the best load (less sensitive to other processes on a shared machine; nvdcp's counts its
threads).

Workloads: ``large`` (4 MiB fp32 tensors, most of the bytes), ``mixed`` (the same bytes as
tensors of 4 KiB to 4 MiB, bf16 and int64 too, plus byte items) and ``small`` (thousands of
tiny items: per-item overhead). Writes benchmarks/results/stock_read_bench_<date>.json and
prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import nvdcp
from benchmarks.common import dir_bytes, fresh_dir, machine, markdown_table, write_results
from benchmarks.workload import states_equal, tensor_bytes, zeros_like_state

MiB = 1 << 20


def workload(kind: str, mib: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    total = mib * MiB
    sd: dict[str, Any] = {}
    if kind == "large":
        for i in range(max(1, total // (4 * MiB))):
            sd[f"layer{i}.weight"] = torch.randn(1024, 1024, generator=g)
    elif kind == "mixed":
        sizes = [4 * MiB, 1 * MiB, 256 << 10, 64 << 10, 16 << 10, 4 << 10]
        i, used = 0, 0
        while used < total:
            nbytes = sizes[i % len(sizes)]
            if i % 5 == 3:
                t = torch.randn(nbytes // 2, generator=g).to(torch.bfloat16)
            elif i % 7 == 5:
                t = torch.randint(0, 1 << 40, (nbytes // 8,), generator=g)
            else:
                t = torch.randn(nbytes // 4, generator=g).reshape(-1, 64) if nbytes >= 256 else torch.randn(nbytes // 4, generator=g)
            sd[f"block{i}.param"] = t
            used += nbytes
            i += 1
        sd["extra"] = {"step": 1234, "note": "byte items ride along", "lrs": [0.1 * k for k in range(16)]}
    elif kind == "small":
        for i in range(max(1, total // (16 << 10))):
            sd[f"p{i}"] = torch.randn(4096, generator=g)  # 16 KiB each
        sd["extra"] = {f"k{i}": i for i in range(200)}
    else:
        raise ValueError(kind)
    return sd


def stock_writer(path: str, zstd: bool) -> Any:
    if zstd:
        from torch.distributed.checkpoint._extension import ZStandard

        return FileSystemWriter(path, sync_files=False, _extensions=[ZStandard()])
    return FileSystemWriter(path, sync_files=False)


READERS: dict[str, Callable[[str], Any]] = {
    "stock FileSystemReader": lambda p: FileSystemReader(p),
    "nvdcp NvcompReader": lambda p: nvdcp.NvcompReader(p),
    "nvdcp NvcompReader thread_count=1": lambda p: nvdcp.NvcompReader(p, thread_count=1),
}


def _read_all_files(path: str) -> None:
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            while f.read(16 * MiB):
                pass


def measure(kind: str, zstd: bool, mib: int, root: str, repeats: int) -> list[dict[str, Any]]:
    state = workload(kind, mib)
    path = fresh_dir(os.path.join(root, f"{kind}{'_zstd' if zstd else ''}"))
    dcp.save(state, storage_writer=stock_writer(path, zstd))
    _read_all_files(path)
    times: dict[str, list[float]] = {name: [] for name in READERS}
    cpu: dict[str, list[float]] = {name: [] for name in READERS}
    exact = dict.fromkeys(READERS, True)
    targets = {name: zeros_like_state(state) for name in READERS}
    for name, make in READERS.items():  # one untimed load each: imports, pools, first-touch pages
        dcp.load(targets[name], storage_reader=make(path))
    for _ in range(repeats):
        for name, make in READERS.items():
            target = targets[name]
            c0, t0 = time.process_time(), time.perf_counter()
            dcp.load(target, storage_reader=make(path))
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            exact[name] &= states_equal(state, target)
    stock = statistics.median(times["stock FileSystemReader"])
    stock_min = min(times["stock FileSystemReader"])
    stock_cpu = min(cpu["stock FileSystemReader"])
    raw = tensor_bytes(state)
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({
            "workload": kind, "transform": "zstd" if zstd else "none", "reader": name,
            "items": len(dcp.FileSystemReader(path).read_metadata().storage_data), "raw_bytes": raw,
            "stored_bytes": dir_bytes(path), "median_s": med, "min_s": min(ts), "max_s": max(ts),
            "gb_per_s": raw / med / 1e9, "vs_stock": med / stock, "min_vs_stock": min(ts) / stock_min,
            "cpu_s": min(cpu[name]), "cpu_vs_stock": min(cpu[name]) / stock_cpu,
            "bit_exact": exact[name], "times_s": ts, "cpu_times_s": cpu[name],
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="tensor bytes per workload (MiB)")
    ap.add_argument("--small-mib", type=int, default=32, help="tensor bytes of the many-small-items workload")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dir", default="/tmp/nvdcp-stock-read-bench")
    ap.add_argument("--workloads", default="large,mixed,small")
    ap.add_argument("--no-zstd", action="store_true", help="skip the ZStandard-extension checkpoints")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    rows: list[dict[str, Any]] = []
    for kind in args.workloads.split(","):
        mib = args.small_mib if kind == "small" else args.mib
        for zstd in (False,) if args.no_zstd else (False, True):
            rows += measure(kind, zstd, mib, args.dir, args.repeats)
            print(markdown_table(rows[-len(READERS):], ["workload", "transform", "reader", "median_s", "vs_stock",
                                                         "min_vs_stock", "cpu_vs_stock"]), flush=True)
    columns = ["workload", "transform", "reader", "items", "raw_bytes", "median_s", "min_s", "gb_per_s", "vs_stock",
               "min_vs_stock", "cpu_s", "cpu_vs_stock", "bit_exact"]
    print()
    print(markdown_table(rows, columns))
    ours = [r for r in rows if r["reader"] == "nvdcp NvcompReader"]
    worst = max(r["vs_stock"] for r in ours)
    worst_min = max(r["min_vs_stock"] for r in ours)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    target = write_results("stock_read_bench", {
        "machine_note": f"{machine().get('cores')}-core CPU machine, page cache warm; load average at the end {load}",
        "settings": vars(args), "target_vs_stock": 1.1, "worst_nvdcp_default_vs_stock_median": worst,
        "worst_nvdcp_default_vs_stock_min": worst_min, "rows": rows,
    }, args.out)
    print(f"\nworst NvcompReader (default threads) / FileSystemReader: median {worst:.3f}, best-of {worst_min:.3f}  -> {target}")


if __name__ == "__main__":
    main()

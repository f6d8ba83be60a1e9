"""How many threads should encode small items' batches? (issue 18: the 20,000-small-tensor save)

    python -m benchmarks.small_item_threads [--threads 1,2,4,8] [--repeats 2] [--dir DIR] [--out DIR]

Saves the ``small`` state of :mod:`benchmarks.cpu_pipeline_bench` (20,000 CPU tensors of
4 KiB-1 MiB) with default ``NvcompWriter`` arguments, once per value of
``nvdcp.pipeline.encoder.SMALL_ITEM_THREADS`` (small-item batches an encoder runs at once),
the values alternating within each repeat so machine noise hits all alike. (The first runs, on
2026-12-01, swept cores per thread instead: ``cores_per_thread`` in their JSON.) Reports
``write_data``'s wall time (the storage layer's share of a save: encoding and writing; DCP's
planning is the same for all) and the whole save's. A small item's
encode is mostly Python holding the GIL, so more threads can be slower. Writes
``small_item_threads_<date>.json`` (date, machine, command).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from typing import Any

import torch.distributed.checkpoint as dcp

import nvdcp
from benchmarks.common import fresh_dir, markdown_table, write_results
from benchmarks.cpu_pipeline_bench import small_state
from nvdcp.pipeline import encoder as encoder_module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--items", type=int, default=20_000)
    ap.add_argument("--dir", default="/tmp/nvdcp-small-item-threads")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    values = [int(v) for v in args.threads.split(",")]
    state = small_state(args.items)
    cores = os.cpu_count() or 1
    write_s: dict[int, list[float]] = {v: [] for v in values}
    save_s: dict[int, list[float]] = {v: [] for v in values}
    last: dict[str, float] = {}
    real_write_data = nvdcp.NvcompWriter.write_data

    def timed_write_data(self: Any, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        fut = real_write_data(self, *a, **k)
        fut.wait()
        last["write_data"] = time.perf_counter() - t0
        return fut

    nvdcp.NvcompWriter.write_data = timed_write_data  # type: ignore[method-assign]
    try:
        for repeat in range(args.repeats + 1):  # the first round warms up (page cache, pools)
            for value in values:
                encoder_module.SMALL_ITEM_THREADS = value
                encoder_module.close_shared_encoders()  # an encoder sizes its small-item gate when built
                path = fresh_dir(os.path.join(args.dir, "ckpt"))
                t0 = time.perf_counter()
                dcp.save(state, storage_writer=nvdcp.NvcompWriter(path, on_identical_save="ignore"))
                if repeat:
                    save_s[value].append(time.perf_counter() - t0)
                    write_s[value].append(last["write_data"])
    finally:
        nvdcp.NvcompWriter.write_data = real_write_data  # type: ignore[method-assign]
    rows = [
        {
            "small_item_threads": v,
            "write_data_s": round(statistics.median(write_s[v]), 3), "save_s": round(statistics.median(save_s[v]), 3),
            "write_data_all": [round(x, 3) for x in write_s[v]],
            "write_data_us_per_item": round(statistics.median(write_s[v]) / args.items * 1e6, 1),
        }
        for v in values
    ]
    print(markdown_table(rows, ["small_item_threads", "write_data_s", "save_s",
                                "write_data_us_per_item", "write_data_all"]))
    target = write_results("small_item_threads", {
        "machine_note": f"{cores} cores, local storage at {args.dir} (page cache)",
        "items": args.items, "repeats": args.repeats, "rows": rows,
    }, args.out)
    print(f"-> {target}")


if __name__ == "__main__":
    main()

"""Delta loads of many small items against full loads (issue 15: delta load <= 1.5x a full one).

    python -m benchmarks.delta_small_items [--items 5000] [--repeats 2] [--out DIR] [--dir DIR]
                                           [--min-item-bytes N]

A state of ``--items`` fp32 tensors of 4-32 KiB is saved three times with
``NvcompWriter(delta=DeltaPolicy(full_every=8, min_item_bytes=0))`` (a full save, then deltas of
depth 1 and 2; ``min_item_bytes=0`` makes these small items deltas, which the policy's default,
64 KiB, would store whole: pass ``--min-item-bytes 65536`` to measure that),
the values nudged between saves as a training step would; each checkpoint is then loaded into
CPU tensors ``--repeats`` times. Reports the median load time of each depth and its ratio to
the full load, and checks every load bit for bit. Per-record host work is what this measures:
a delta load of depth d reads, checks and decodes d + 1 records per item. Writes
``delta_small_items_<date>.json`` (date, machine, command).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from benchmarks.common import fresh_dir, markdown_table, write_results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=5000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--dir", default=None, help="checkpoint root (default: a new temporary folder)")
    p.add_argument("--min-item-bytes", type=int, default=0, help="DeltaPolicy min_item_bytes (default 0: all deltas)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(1024 * (1 + i % 8), generator=g) for i in range(args.items)}
    root = fresh_dir(args.dir or tempfile.mkdtemp(prefix="nvdcp-delta-small-"))
    policy = nvdcp.DeltaPolicy(full_every=8, min_item_bytes=args.min_item_bytes)
    paths, wants = [], []
    for k in range(3):
        path = f"{root}/c{k}"
        dcp.save(state, storage_writer=nvdcp.NvcompWriter(path, delta=policy))
        paths.append(path)
        wants.append({key: v.clone() for key, v in state.items()})
        for v in state.values():
            v.add_(torch.randn(v.shape, generator=g) * 1e-4)
    rows: list[dict[str, Any]] = []
    exact = True
    for depth, (path, want) in enumerate(zip(paths, wants)):
        times = []
        for _ in range(args.repeats):
            target = {key: torch.empty_like(v) for key, v in want.items()}
            t0 = time.perf_counter()
            dcp.load(target, storage_reader=nvdcp.NvcompReader(path))
            times.append(time.perf_counter() - t0)
            exact = exact and all(torch.equal(target[key], want[key]) for key in want)
        rows.append({"depth": depth, "items": args.items, "load_s": statistics.median(times),
                     "all_s": [round(t, 3) for t in times]})
    for row in rows:
        row["vs_full"] = row["load_s"] / rows[0]["load_s"]
        print(f"  depth {row['depth']}: {row['load_s']:.3f} s ({row['vs_full']:.2f}x the full load)", flush=True)
    print(markdown_table(rows, ["depth", "items", "load_s", "vs_full"]))
    print(f"bit-exact: {exact}")
    print(f"wrote {write_results('delta_small_items', {'results': rows, 'bit_exact': exact, 'args': vars(args)}, args.out)}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())

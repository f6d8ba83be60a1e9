"""What DCP's plan caching saves: repeated saves with and without ``enable_plan_caching``.

    python -m benchmarks.plan_caching_probe [--case small_model] [--rounds 5] [--dir /dev/shm/pc]

A training job saves the same state layout again and again. ``DefaultSavePlanner(
enable_plan_caching=True)`` then skips DCP's global planning (the coordinator's gather, dedup,
checks and metadata building) for ranks whose plan has not changed; nvdcp names such a save's
files itself (docs/RELIABILITY.md, "Plans cached by the planner"). This saves a
``cpu_pipeline_bench`` workload with stock's ``FileSystemWriter`` and with ``NvcompWriter``,
each with the default planner and with a caching one (the cache filled by an untimed save
first), the four settings alternating in every round, each save into a fresh folder. Reports
the median seconds per setting and nvdcp's time over stock's for each planner. Writes
``benchmarks/results/plan_caching_probe_<date>.json``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

import nvdcp
from benchmarks.common import write_results
from benchmarks.cpu_pipeline_bench import WORKLOADS
from nvdcp.testing import clear_plan_caches

WRITERS = {"stock": lambda path: FileSystemWriter(path),
           "nvdcp": lambda path: nvdcp.NvcompWriter(path, on_identical_save="ignore")}


class StockCachingPlanner(DefaultSavePlanner):
    """torch keys its plan cache by the planner's class: one class per writer keeps each
    writer's cached plans its own."""


class NvdcpCachingPlanner(DefaultSavePlanner):
    """As :class:`StockCachingPlanner`, for nvdcp's saves."""


def _planner(writer: str, caching: bool) -> DefaultSavePlanner:
    if not caching:
        return DefaultSavePlanner()
    cls = StockCachingPlanner if writer == "stock" else NvdcpCachingPlanner
    return cls(enable_plan_caching=True)  # type: ignore[call-arg]


def save_seconds(state: dict[str, Any], writer: str, caching: bool, path: Path) -> float:
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=WRITERS[writer](str(path)), planner=_planner(writer, caching))
    seconds = time.perf_counter() - t0
    shutil.rmtree(path, ignore_errors=True)
    return seconds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="small_model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/nvdcp-plan-caching")
    ap.add_argument("--out", default=None)
    ap.add_argument("--suffix", default="")
    args = ap.parse_args(argv)
    root = Path(args.dir)
    state = WORKLOADS[args.case]()
    clear_plan_caches()
    settings = [(w, c) for w in WRITERS for c in (False, True)]
    runs: dict[str, list[float]] = {f"{w} {'caching' if c else 'default'}": [] for w, c in settings}
    for rnd in range(args.rounds + 1):  # round 0 fills the cache and warms pools: untimed
        for writer, caching in settings if rnd % 2 else settings[::-1]:
            seconds = save_seconds(state, writer, caching, root / f"{writer}_{caching}")
            if rnd:
                runs[f"{writer} {'caching' if caching else 'default'}"].append(seconds)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    for name, secs in medians.items():
        print(f"{name}: {secs:.3f} s (median of {args.rounds})")
    ratios = {p: medians[f"nvdcp {p}"] / medians[f"stock {p}"] for p in ("default", "caching")}
    print(f"nvdcp / stock: default planner {ratios['default']:.3f}x, caching planner {ratios['caching']:.3f}x; "
          f"caching / default: stock {medians['stock caching'] / medians['stock default']:.3f}x, "
          f"nvdcp {medians['nvdcp caching'] / medians['nvdcp default']:.3f}x")
    target = write_results("plan_caching_probe", {"case": args.case, "rounds": args.rounds, "runs": runs,
                                                  "medians_s": medians, "nvdcp_over_stock": ratios},
                           args.out, args.suffix)
    print(f"-> {target}")


if __name__ == "__main__":
    main()

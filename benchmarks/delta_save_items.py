"""Delta saves of states with many items against full saves (issue 15 x issue 18: per-save cost
that grows with the item count).

    python -m benchmarks.delta_save_items [--items 2000,20000] [--floats 64] [--saves 5]
                                          [--dir /dev/shm/dsi] [--out DIR] [--suffix _cpu]

For each ``--items`` count, a state of that many fp32 tensors of ``--floats`` elements under one
key (as a model's ``state_dict()``) is saved ``--saves`` times whole (``NvcompWriter(path)``) and
``--saves`` times through one ``DeltaPolicy(full_every=1000)`` (a delta against the save before),
alternating, the values nudged before each save. Items this small are stored whole by the
policy's default ``min_item_bytes``: what a delta save adds here is its fixed work per save, which
grows with the item count: finding the base (``resolve_base``, timed on its own) and the
policy's bookkeeping. Reports medians (the first save of each kind left out) and writes
``delta_save_items_<date><suffix>.json`` (date, machine, command).
"""

from __future__ import annotations

import argparse
import logging
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
from nvdcp.dcp import writer as writer_module


class _BaseCheckTimer:
    """Seconds spent in each save's ``resolve_base`` (the writer's call, wrapped while in use)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._original = writer_module.resolve_base

    def __enter__(self) -> _BaseCheckTimer:
        original = self._original

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - t0)

        writer_module.resolve_base = timed  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        writer_module.resolve_base = self._original  # type: ignore[assignment]


def measure(items: int, floats: int, saves: int, root: str) -> dict[str, Any]:
    state = {"model": {f"layer{i}.weight": torch.randn(floats) for i in range(items)}}
    policy = nvdcp.DeltaPolicy(full_every=1000)
    times: dict[str, list[float]] = {"full": [], "delta": []}
    with _BaseCheckTimer() as timer:
        for i in range(saves):
            for kind in ("full", "delta"):
                for t in state["model"].values():
                    t.add_(1e-3)
                path = fresh_dir(f"{root}/{kind}{i % 2}")
                writer = nvdcp.NvcompWriter(path, delta=policy) if kind == "delta" else nvdcp.NvcompWriter(path)
                t0 = time.perf_counter()
                dcp.save(state, storage_writer=writer, no_dist=True)
                times[kind].append(time.perf_counter() - t0)
    full, delta = statistics.median(times["full"][1:]), statistics.median(times["delta"][1:])
    checks = timer.seconds  # one per delta save after the first (the policy had no save before it)
    return {
        "items": items, "floats": floats, "saves": saves, "full_save_s": full, "delta_save_s": delta,
        "delta_over_full": delta / full, "base_check_s": statistics.median(checks) if checks else None,
        "full_saves_s": times["full"], "delta_saves_s": times["delta"], "base_checks_s": timer.seconds,
        "nvdcp": nvdcp.__file__,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", default="2000,20000", help="item counts, comma separated")
    p.add_argument("--floats", type=int, default=64, help="fp32 elements per tensor")
    p.add_argument("--saves", type=int, default=5, help="saves of each kind per item count")
    p.add_argument("--dir", default=None, help="checkpoint root (default: a new temporary folder)")
    p.add_argument("--out", default=None)
    p.add_argument("--suffix", default="")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("nvdcp").setLevel(logging.ERROR)  # the identical-save notes of a benchmark loop
    root = fresh_dir(args.dir or tempfile.mkdtemp(prefix="nvdcp-delta-save-items-"))
    rows = [measure(int(n), args.floats, args.saves, root) for n in args.items.split(",") if n]
    print(markdown_table(rows, ["items", "full_save_s", "delta_save_s", "delta_over_full", "base_check_s"]))
    print("->", write_results("delta_save_items", {"args": vars(args), "rows": rows}, args.out, suffix=args.suffix))
    return 0


if __name__ == "__main__":
    sys.exit(main())

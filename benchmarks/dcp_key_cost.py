"""Stock DCP's own cost per top-level key of a saved state dict, which every storage writer pays.

    python -m benchmarks.dcp_key_cost [--keys 20000] [--repeats 5] [--out DIR]

``dcp.save`` passes the state dict through ``_stateful_to_state_dict``, which wraps the handling
of every top-level key in DCP's method logger: a ``uuid4``, a message dict and two DEBUG records
on a logger that torch sets to DEBUG with a ``NullHandler`` (``c10d-NullHandler-dcp_logger``).
A state of N small tensors at the top level (``benchmarks/cpu_pipeline_bench.py``'s ``small``
case, the sweep's ``many``) pays that N times before the storage writer sees an item; the same
tensors under one key pay it once. This measures the call alone for both layouts, with that
logger at DEBUG (torch's setting) and at INFO (what ``logging.getLogger(
"c10d-NullHandler-dcp_logger").setLevel(logging.INFO)`` in a training script gives). Medians of
``--repeats``; writes ``benchmarks/results/dcp_key_cost_<date>.json``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings

from benchmarks.common import markdown_table, write_results

LOGGER = "c10d-NullHandler-dcp_logger"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch
    from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict

    flat = {f"t{i:06d}": torch.zeros(4) for i in range(args.keys)}
    layouts = {"top level": flat, "under one key": {"model": dict(flat)}}
    logger = logging.getLogger(LOGGER)
    before = logger.level
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for _ in range(args.repeats):
            for level in (logging.DEBUG, logging.INFO):
                logger.setLevel(level)
                for name, sd in layouts.items():
                    t0 = time.perf_counter()
                    _stateful_to_state_dict(sd)
                    times.setdefault((name, logging.getLevelName(level)), []).append(time.perf_counter() - t0)
    finally:
        logger.setLevel(before)
    rows = [{
        "layout": layout, "logger_level": level, "tensors": args.keys, "median_s": round(statistics.median(v), 4),
        "us_per_tensor": round(statistics.median(v) / args.keys * 1e6, 2),
    } for (layout, level), v in times.items()]
    print(markdown_table(rows, ["layout", "logger_level", "tensors", "median_s", "us_per_tensor"]))
    print(f"wrote {write_results('dcp_key_cost', {'torch': torch.__version__, 'repeats': args.repeats, 'rows': rows}, args.out)}")


if __name__ == "__main__":
    main()

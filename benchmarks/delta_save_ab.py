"""A delta save's time against a full save's, at the default settings, for comparing two trees.

    python benchmarks/delta_save_ab.py [--rounds 5] [--root /dev/shm/dsab] [--out DIR] [--suffix _new_r1]

Trains the reference GPT (``benchmarks.delta_bench``'s CUDA workload, two snapshots 10 steps
apart near peak LR), then per variant (fp32 AdamW state, bf16 weights) saves, each round: the
first snapshot whole with a ``DeltaPolicy``, the second as a delta against it (timed) and the
second as a full checkpoint (timed). The first round warms up; medians of the rest and their
ratio are printed and written to ``delta_save_ab_<date><suffix>.json``.

Run as a file, it takes ``nvdcp`` and ``benchmarks`` from ``PYTHONPATH``: point that at another
checkout to time its code with the same driver (``PYTHONPATH=/old/tree python
benchmarks/delta_save_ab.py``), one process per tree, alternating rounds (the machines are noisy).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import time
import warnings
from typing import Any

import torch


def timed(fn: Any) -> float:
    gc.collect()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--root", default="/dev/shm/dsab")
    p.add_argument("--out", default=None)
    p.add_argument("--suffix", default="")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("delta_save_ab needs CUDA")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    import torch.distributed.checkpoint as dcp

    import nvdcp
    from benchmarks import delta_bench
    from benchmarks.common import write_results

    snaps, _ = delta_bench.train(delta_bench.parse(["--device", "cuda", "--intervals", "10", "--checkpoints", "2"]))
    first, last = sorted(snaps)
    rows = []
    try:
        for variant in ("fp32_adamw", "bf16_weights"):
            base, state = delta_bench.variant_state(variant, snaps[first]), delta_bench.variant_state(variant, snaps[last])
            times: dict[str, list[float]] = {"delta": [], "full": []}
            for r in range(args.rounds):
                shutil.rmtree(args.root, ignore_errors=True)
                policy = nvdcp.DeltaPolicy(full_every=100)
                dcp.save(base, storage_writer=nvdcp.NvcompWriter(f"{args.root}/base", delta=policy), no_dist=True)
                delta_s = timed(lambda: dcp.save(state, storage_writer=nvdcp.NvcompWriter(
                    f"{args.root}/delta", delta=policy), no_dist=True))
                full_s = timed(lambda: dcp.save(state, storage_writer=nvdcp.NvcompWriter(f"{args.root}/full"),
                                                no_dist=True))
                if r:
                    times["delta"].append(delta_s)
                    times["full"].append(full_s)
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {"variant": variant, "seconds": times, "median_s": med,
                   "delta_over_full": round(med["delta"] / med["full"], 3)}
            print(f"{variant}: delta {med['delta']:.4f} s, full {med['full']:.4f} s, ratio {row['delta_over_full']}",
                  flush=True)
            rows.append(row)
    finally:
        shutil.rmtree(args.root, ignore_errors=True)
    path = write_results("delta_save_ab", {"benchmark": "delta_save_ab", "issue": 15, "nvdcp": nvdcp.__file__,
                                           "rows": rows}, args.out, args.suffix)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())

"""The CPU batch encoder's last pass over a group's stored chunks (issue 18: CPU small-tensor
saves): gathering them into the records and checksumming them, as two passes
(``copy_ranges`` then ``checksum_ranges``) against the fused one (``copy_ranges_checksummed``,
each chunk checksummed right after its copy, while it is in cache).

    python -m benchmarks.gather_crc_probe [--chunks 10000] [--repeats 5] [--out DIR] [--suffix S]

Chunks of 64 KiB and 40,000 bytes (a third), copied from one buffer into records with gaps (the
headers' room), at 1 and 2 threads; best of ``repeats``, in GB/s of chunk bytes. Both give the
same CRCs (checked).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from benchmarks.common import write_results
from nvdcp.format.crc import checksum_ranges
from nvdcp.pipeline import cpu_batch


def _best(fn: Any, repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--suffix", default="")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    n, size = args.chunks, 64 << 10
    src = rng.integers(0, 256, size=n * size, dtype=np.uint8)
    sizes = np.full(n, size, dtype=np.int64)
    sizes[::3] = 40_000
    src_of, src_off = np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int64) * size
    dst = np.concatenate(([0], np.cumsum(sizes + 100)[:-1])).astype(np.int64)
    out = np.zeros(int(dst[-1] + size + 100), dtype=np.uint8)
    gb = int(sizes.sum()) / 1e9
    rows = []
    for threads in (1, 2):
        def two_steps() -> np.ndarray:
            cpu_batch.copy_ranges(out, dst, [src], src_of, src_off, sizes)
            return checksum_ranges(out, dst, sizes, threads)

        t_two, want = _best(two_steps, args.repeats)
        t_fused, got = _best(lambda: cpu_batch.copy_ranges_checksummed(out, dst, [src], src_of, src_off, sizes, threads),
                             args.repeats)
        assert np.array_equal(want, got), "the fused pass gave other CRCs"
        row = {"threads": threads, "two_steps_gb_s": gb / t_two, "fused_gb_s": gb / t_fused, "speedup": t_two / t_fused}
        rows.append(row)
        print(f"threads {threads}: two steps {row['two_steps_gb_s']:.2f} GB/s, fused {row['fused_gb_s']:.2f} GB/s "
              f"({row['speedup']:.2f}x), {gb * 1e3:.0f} MB")
    path = write_results("gather_crc_probe", {"issue": 18, "chunks": n, "bytes": int(sizes.sum()), "rows": rows},
                         args.out, suffix=args.suffix)
    print(f"-> {path}")


if __name__ == "__main__":
    main()

"""Host cost of building a GPU bucket's records, per item: one at a time (a header packed and
checksummed per item, as ``GpuEncoder._item`` does) vs together (``GpuEncoder._bucket_items``:
headers packed into one buffer and checksummed in one call). A diagnostic of issue 18's per-item
cost, on a synthetic bucket (no GPU needed: the records are host work).

    python -m benchmarks.record_build_cost [--items 5000] [--repeats 5]

Prints microseconds per item (median of the repeats) and writes
``benchmarks/results/record_build_cost_<date>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from benchmarks.common import write_results
from nvdcp.gpu.encoder import GpuEncoder, GpuJob, HostBucket, _Bucket, _Segment
from nvdcp.pipeline.policy import Layout

CHUNK = 65536
GRANULE = 256


def synthetic_bucket(items: int, seed: int = 0) -> tuple[list[GpuJob], HostBucket]:
    """``items`` fp32 jobs of 1,024-262,143 elements, each held whole by one segment, with
    random stored sizes (chunks padded to the compaction granule) and CRCs."""
    rng = np.random.default_rng(seed)
    layout = Layout(1, ("gdeflate", "none", "none", "none"))
    jobs, segments, slot = [], [], 0
    for i, elements in enumerate(rng.integers(1024, 262_144, items).tolist()):
        jobs.append(GpuJob(("item", i), torch.empty(elements * 4, dtype=torch.uint8), layout, torch.float32, 1, (elements,)))
        blocks = -(-elements // CHUNK)
        segments.append(_Segment(i, 0, blocks, slot))
        slot += blocks * 4
    stored = rng.integers(100, CHUNK, slot).astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(-(-stored // GRANULE) * GRANULE)))
    host = torch.empty(int(offsets[-1]), dtype=torch.uint8)
    crcs = torch.from_numpy(rng.integers(0, 2**31, slot).astype(np.int32))
    return jobs, HostBucket(_Bucket(segments, slot), stored, offsets, [(host, 0, slot)], None, crcs)  # type: ignore[arg-type]


def one_at_a_time(encoder: GpuEncoder, jobs: list[GpuJob], hb: HostBucket) -> list[object]:
    crcs = hb.checksums()
    out = []
    for seg in hb.bucket.segments:
        job = jobs[seg.job]
        lo, hi = seg.first_slot, seg.first_slot + seg.n_blocks * job.n_planes
        out.append(encoder._item(job, hb.spans(lo, hi), crcs[lo:hi]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    jobs, hb = synthetic_bucket(args.items)
    encoder = object.__new__(GpuEncoder)
    encoder.chunk_bytes = CHUNK
    ways = {
        "one_at_a_time": lambda: one_at_a_time(encoder, jobs, hb),
        "together": lambda: list(encoder._bucket_items(jobs, hb, {}, True)),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, run in ways.items():  # alternating: machine noise hits both alike
            t0 = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - t0) / args.items * 1e6)
    result = {name: {"us_per_item_median": statistics.median(v), "us_per_item": v} for name, v in times.items()}
    for name, r in result.items():
        print(f"{name}: {r['us_per_item_median']:.1f} us/item (median of {args.repeats})")
    write_results("record_build_cost", {"items": args.items, "chunks": int(len(hb.stored)), "results": result},
                  out_dir=args.out)


if __name__ == "__main__":
    main()

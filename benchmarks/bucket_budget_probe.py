"""How a GPU save of many small tensors scales with its bucket count (issue 18: per-item cost).

    python -m benchmarks.bucket_budget_probe [--case moe] [--rounds 2] [--dir /dev/shm/bbp]

The GPU encoder packs block ranges into buckets under its scratch budget (1 GiB by default: two
buckets of 512 MiB in flight) and its pinned budget; each bucket costs a fixed number of torch,
nvCOMP and Triton calls on the encode thread. A small tensor still takes a full chunk-sized slot
per plane, so 100,000 tensors of 1-64 KiB need over a hundred buckets. This saves the case's
GPU state with the default budgets and with larger ones (fewer buckets), alternating, and
reports wall and own time (``cpu_pipeline_bench``'s accounting) and the bucket count, to tell
what the per-bucket cost is worth. Writes ``benchmarks/results/bucket_budget_probe_<date>.json``.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from benchmarks import cpu_pipeline_bench as cpb
from benchmarks.common import write_results

GiB = 1 << 30
MiB = 1 << 20
#: (label, gpu_memory_bytes, pinned_memory_bytes): None keeps nvdcp's default
SETTINGS: list[tuple[str, int | None, int | None]] = [
    ("default", None, None),
    ("gpu4g_pin2g", 4 * GiB, 2 * GiB),
    ("gpu16g_pin8g", 16 * GiB, 8 * GiB),
]


def _count_buckets() -> list[int]:
    """Count the buckets each save plans (wraps GpuEncoder._plan)."""
    from nvdcp.gpu.encoder import GpuEncoder

    counts: list[int] = []
    plan = GpuEncoder._plan

    def counted(self: GpuEncoder, jobs: Any, depth: int = 2) -> Any:
        buckets = plan(self, jobs, depth)
        counts.append(len(buckets))
        return buckets

    GpuEncoder._plan = counted  # type: ignore[method-assign]
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="moe")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default="/dev/shm/bucket-budget-probe")
    ap.add_argument("--out", default=None)
    ap.add_argument("--suffix", default="")
    args = ap.parse_args()

    import nvdcp
    from nvdcp.gpu.config import GpuConfig

    state = cpb._to_device(cpb.WORKLOADS[args.case](), "cuda")
    counts = _count_buckets()
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in SETTINGS}
    path = f"{args.dir}/ckpt"
    for rnd in range(args.rounds + 1):  # the first round warms every setting up, untimed
        for label, gpu_bytes, pinned_bytes in SETTINGS:
            config = GpuConfig(gpu_memory_bytes=gpu_bytes, pinned_memory_bytes=pinned_bytes)
            cpb._writer = lambda kind, p, config=config: nvdcp.NvcompWriter(p, gpu=config)  # type: ignore[assignment]
            result = cpb.save_once("nvdcp", state, path)
            result["buckets"] = counts[-1] if counts else None
            nvdcp.release_resources()
            torch.cuda.empty_cache()
            if rnd:
                runs[label].append(result)
                print(f"round {rnd} {label:>14}: wall {result['wall_s']:.3f} s, own {result['own_s']:.3f} s, "
                      f"{result['buckets']} buckets", flush=True)
    summary = {label: {"wall_s": statistics.median(r["wall_s"] for r in rs),
                       "own_s": statistics.median(r["own_s"] for r in rs), "buckets": rs[-1]["buckets"]}
               for label, rs in runs.items()}
    for label, s in summary.items():
        print(f"{label:>14}: wall {s['wall_s']:.3f} s, own {s['own_s']:.3f} s, {s['buckets']} buckets")
    target = write_results("bucket_budget_probe", {"case": args.case, "rounds": args.rounds,
                                                   "settings": SETTINGS, "runs": runs, "summary": summary},
                           args.out, suffix=args.suffix)
    print(f"-> {target}")


if __name__ == "__main__":
    main()

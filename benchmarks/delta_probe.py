"""Delta saves and loads of a synthetic chain against full ones, in one process (issue 15): the
quick A/B for changes to the delta path, where ``delta_bench`` trains a model first.

    python -m benchmarks.delta_probe [--device cuda|cpu] [--root /dev/shm/dp] [--saves 9]
        [--variants bf16,fp32] [--loads 7] [--tensors N] [--rows 1024] [--out DIR] [--suffix _h200]

State: 2 M-element tensors (``--rows x 2048``, 1024 rows; 160 in bf16, 80 in fp32: 671 MB raw either way)
drawn once at weights' scale (std 0.02), then moved by ``2e-4 x randn`` per save,
as optimizer steps do, and cast to the variant's dtype: nearly every bf16 value changes between
saves, so the deltas are larger than a trained model's (``delta_bench``) and the saves' extra
work is all there. A delta chain (``DeltaPolicy(full_every=100)``) of ``--saves`` saves, each
followed by a full save of the same state elsewhere (``NvcompWriter`` defaults); then loads of a
full checkpoint, the depth-1 delta and the depth-3 delta, ``--loads`` each, alternating. Every
load is checked bit-exact. Prints medians (the first save of each kind dropped) and the ratios,
and writes ``delta_probe_<date><suffix>.json``. To compare two versions of the code, run it once
per version (``PYTHONPATH``) in one session, alternating, several rounds: these machines are noisy.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from benchmarks.common import dir_bytes, write_results

COLS = 2048
COUNTS = {"bf16": 160, "fp32": 80}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def chain_states(variant: str, saves: int, device: str, tensors: int | None = None, rows: int = 1024,
                 seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``saves`` states of one run: fp32 master weights stepped by small noise, cast to the variant."""
    torch.manual_seed(seed)
    master = {f"w{i}": torch.randn(rows, COLS, device=device) * 0.02 for i in range(tensors or COUNTS[variant])}
    states = []
    for _ in range(saves):
        states.append({k: v.to(DTYPES[variant]).clone() for k, v in master.items()})
        for v in master.values():
            v.add_(torch.randn_like(v) * 2e-4)
    return states


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def probe(variant: str, root: str, saves: int, loads: int, device: str, tensors: int | None = None,
          rows: int = 1024) -> dict[str, Any]:
    """One variant's chain: its saves, each beside a full save of the same state, then its loads."""
    if saves < 4:
        raise ValueError(f"--saves must be at least 4 (a depth-3 delta is loaded), got {saves}")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    states = chain_states(variant, saves, device, tensors, rows)
    folder = os.path.join(root, variant)
    shutil.rmtree(folder, ignore_errors=True)
    policy = nvdcp.DeltaPolicy(full_every=100)
    times: dict[str, list[float]] = {"full_save": [], "delta_save": [], "full_load": [], "d1_load": [], "d3_load": []}

    def timed(key: str, fn: Any) -> None:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times[key].append(time.perf_counter() - t0)

    dcp.save(states[0], storage_writer=nvdcp.NvcompWriter(os.path.join(folder, "p0"), delta=policy))
    for i in range(1, saves):
        full = os.path.join(folder, f"f{i}")
        timed("full_save", lambda: dcp.save(states[i], storage_writer=nvdcp.NvcompWriter(full, on_identical_save="ignore")))
        timed("delta_save", lambda: dcp.save(states[i], storage_writer=nvdcp.NvcompWriter(os.path.join(folder, f"p{i}"),
                                                                                          delta=policy)))
        if i > 1:
            shutil.rmtree(full)  # keep f1 for the loads

    exact = True

    def load(path: str, want: dict[str, torch.Tensor]) -> None:
        nonlocal exact
        out = {k: torch.empty_like(v) for k, v in want.items()}
        dcp.load(out, storage_reader=nvdcp.NvcompReader(path), no_dist=True)
        exact = exact and all(torch.equal(_bits(out[k]), _bits(want[k])) for k in want)

    for _ in range(loads):
        timed("full_load", lambda: load(os.path.join(folder, "f1"), states[1]))
        timed("d1_load", lambda: load(os.path.join(folder, "p1"), states[1]))
        timed("d3_load", lambda: load(os.path.join(folder, "p3"), states[3]))
    sizes = {name: dir_bytes(os.path.join(folder, name)) for name in ("f1", "p1")}
    shutil.rmtree(folder, ignore_errors=True)
    med = {k: statistics.median(v[1:] if len(v) > 2 else v) for k, v in times.items()}
    return {
        "variant": variant, "bit_exact": exact, "bytes": sizes, "seconds": times, "median_s": med,
        "delta_save_over_full": med["delta_save"] / med["full_save"],
        "d1_load_over_full": med["d1_load"] / med["full_load"], "d3_load_over_full": med["d3_load"] / med["full_load"],
    }


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--root", default="/dev/shm/nvdcp-delta-probe")
    p.add_argument("--saves", type=int, default=9)
    p.add_argument("--loads", type=int, default=7)
    p.add_argument("--variants", default="bf16,fp32")
    p.add_argument("--tensors", type=int, default=None, help="tensors per state (default 160 bf16, 80 fp32)")
    p.add_argument("--rows", type=int, default=1024, help="rows of 2048 elements per tensor")
    p.add_argument("--out", default=None)
    p.add_argument("--suffix", default="")
    args = p.parse_args(argv)
    rows = []
    for variant in args.variants.split(","):
        row = probe(variant, args.root, args.saves, args.loads, args.device, args.tensors, args.rows)
        rows.append(row)
        med = row["median_s"]
        print(f"{variant}: full save {med['full_save']:.4f} s, delta save {med['delta_save']:.4f} s "
              f"({row['delta_save_over_full']:.2f}x); full load {med['full_load']:.4f} s, depth-1 "
              f"{row['d1_load_over_full']:.2f}x, depth-3 {row['d3_load_over_full']:.2f}x; bit-exact {row['bit_exact']}",
              flush=True)
    path = write_results("delta_probe", {"benchmark": "delta_probe", "issue": 15, "device": args.device, "rows": rows},
                         args.out, args.suffix)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()

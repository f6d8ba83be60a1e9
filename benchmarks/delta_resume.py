"""A resumed job's first delta save, whose bases are read back from storage (issue 15, part 2).

    python -m benchmarks.delta_resume [--items 2000] [--repeats 3] [--out DIR] [--dir DIR]

A state of ``--items`` fp32 tensors of 64-256 KiB (above ``DeltaPolicy``'s default
``min_item_bytes``) is saved whole with ``DeltaPolicy(full_every=100)``, nudged as a training step
would, then saved ``--repeats`` times with a fresh policy that ``resume_from`` the first
checkpoint (a restarted job: the host cache is empty, so every base is read back from storage and
decoded before the deltas are taken), and ``--repeats`` times by the policy that made the first
save, a step apart each (its cache holds the bases: a running job's saves), and as a full nvdcp
save. Reports the medians and their ratios to the full save, and checks that the resumed
checkpoint loads bit for bit. Writes
``delta_resume_<date>.json`` (date, machine, command).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from benchmarks.common import fresh_dir, markdown_table, timed, write_results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--dir", default=None, help="checkpoint root (default: a new temporary folder)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(int(torch.randint(16384, 65536, (1,), generator=g)), generator=g)
             for i in range(args.items)}
    root = fresh_dir(args.dir or tempfile.mkdtemp(prefix="nvdcp-delta-resume-"))
    policy = nvdcp.DeltaPolicy(full_every=100)
    dcp.save(state, storage_writer=nvdcp.NvcompWriter(f"{root}/base", delta=policy))
    for v in state.values():
        v.add_(torch.randn(v.shape, generator=g) * 1e-4 * v.abs())

    def save(name: str, delta: nvdcp.DeltaPolicy | None) -> float:
        writer = nvdcp.NvcompWriter(f"{root}/{name}", delta=delta, on_identical_save="ignore")
        return timed(lambda: dcp.save(state, storage_writer=writer))

    def resumed(k: int) -> float:
        fresh = nvdcp.DeltaPolicy(full_every=100)
        fresh.resume_from(f"{root}/base")
        return save(f"resumed{k}", fresh)

    cases = {
        "resumed delta save (bases read back)": [resumed(k) for k in range(args.repeats)],
        "delta save (bases in the host cache)": [],
        "full save": [save(f"full{k}", None) for k in range(args.repeats)],
    }
    target = {key: torch.empty_like(v) for key, v in state.items()}
    dcp.load(target, storage_reader=nvdcp.NvcompReader(f"{root}/resumed0"))
    exact = all(torch.equal(target[k].view(torch.int32), state[k].view(torch.int32)) for k in state)
    for k in range(args.repeats):  # the first save's policy, a step apart each: its cache holds every base
        cases["delta save (bases in the host cache)"].append(save(f"cached{k}", policy))
        for v in state.values():
            v.add_(torch.randn(v.shape, generator=g) * 1e-4 * v.abs())
    full = statistics.median(cases["full save"])
    rows: list[dict[str, Any]] = [
        {"case": name, "median_s": round(statistics.median(xs), 3), "vs_full": round(statistics.median(xs) / full, 3),
         "all_s": [round(x, 3) for x in xs]}
        for name, xs in cases.items()
    ]
    print(markdown_table(rows, ["case", "median_s", "vs_full", "all_s"]))
    print(f"bit-exact: {exact}")
    mb = sum(v.numel() * v.element_size() for v in state.values()) / 1e6
    path = write_results("delta_resume", {"items": args.items, "state_MB": round(mb, 1), "results": rows,
                                          "bit_exact": exact, "args": vars(args)}, args.out)
    print(f"wrote {path}")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())

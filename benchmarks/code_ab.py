"""Two versions of nvdcp on one case, alternating in fresh processes (issue 18: per-item cost).

    git worktree add -f out/old <commit>    # then build its native extension in it
    python -m benchmarks.code_ab --tree old=out/old --tree new=. [--case small] [--rounds 3]
        [--repeats 3] [--device cuda] [--dir /dev/shm/code-ab]
    python -m benchmarks.code_ab --tree off=.,NVDCP_ZSTD_LITERALS=0 --tree on=.   # a switch, one tree

A change to nvdcp's per-item cost is a few percent of a load on a noisy machine: compared run
against run, it is lost in the noise. Here each round runs every tree once, in turn, each in a
fresh process that imports nvdcp from its tree (``PYTHONPATH``), so noise hits all of them alike
and the medians of the rounds compare. A run saves the case's state (``cpu_pipeline_bench``'s
workloads: ``small`` is 20,000 tensors of 4 KiB-1 MiB) and loads it into a preallocated state,
``repeats`` times after an untimed first round, every load checked bit-exact; it reports wall and
*own* time per op (time in the storage layer's methods less DCP's planner callbacks, as
``cpu_pipeline_bench`` measures it). Writes ``benchmarks/results/code_ab_<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import write_results


def child(case: str, device: str, path: str, repeats: int) -> dict[str, Any]:
    """One tree's run (in its own process): ``repeats`` timed save+load rounds after a first."""
    import warnings

    warnings.filterwarnings("ignore")
    import nvdcp
    from benchmarks.cpu_pipeline_bench import WORKLOADS, _to_device, load_once, save_once
    from benchmarks.workload import states_equal, zeros_like_state

    state = _to_device(WORKLOADS[case](), device)
    target = zeros_like_state(state)
    ops: dict[str, list[dict[str, float]]] = {"save": [], "load": []}
    exact = True
    for rep in range(repeats + 1):
        saved = save_once("nvdcp", state, path)
        loaded = load_once("nvdcp", target, path)
        exact &= states_equal(state, target)
        if rep:
            ops["save"].append(saved)
            ops["load"].append(loaded)
    return {"nvdcp": nvdcp.__file__, "bit_exact": exact, "ops": ops}


def _run_tree(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of a tree: ``PATH[,VAR=VALUE...]`` (environment variables set for its process)."""
    tree, *assignments = spec.split(",")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(tree), os.environ.get("PYTHONPATH", "")]))
    env.update(a.split("=", 1) for a in assignments)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", args.case, args.device,
           os.path.join(args.dir, "ckpt"), str(args.repeats)]
    out = subprocess.run(cmd, env=env, cwd=os.path.abspath(tree), check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _record(args: argparse.Namespace, trees: dict[str, str], runs: dict[str, list[dict[str, Any]]],
            rounds_done: int) -> Path:
    """Summarize the rounds so far (medians per tree) and write them; returns the JSON's path."""
    summary = {}
    for name, rs in runs.items():
        summary[name] = {
            f"{op}_{what}_median_s": statistics.median(r[what] for run in rs for r in run["ops"][op])
            for op in ("save", "load") for what in ("wall_s", "own_s")
        }
        summary[name]["bit_exact"] = all(run["bit_exact"] for run in rs)
        if rounds_done == args.rounds:
            print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in summary[name].items()})
    return write_results("code_ab", {
        "issue": 18, "trees": trees, "case": args.case, "device": args.device, "rounds": args.rounds,
        "rounds_done": rounds_done, "repeats": args.repeats, "summary": summary, "runs": runs,
    }, args.out, suffix=args.suffix)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH[,VAR=VALUE...]: a source tree, and environment variables for its runs (twice or more)")
    ap.add_argument("--case", default="small")
    ap.add_argument("--device", default="cpu", help="where the state's tensors live (cpu or cuda)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/nvdcp-code-ab")
    ap.add_argument("--out", default=None)
    ap.add_argument("--suffix", default="")
    args = ap.parse_args(argv)
    trees = dict(spec.split("=", 1) for spec in args.tree)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for rnd in range(args.rounds):
        for name, tree in trees.items():
            run = _run_tree(tree, args)
            runs[name].append(run)
            medians = {op: statistics.median(r["wall_s"] for r in rs) for op, rs in run["ops"].items()}
            own = {op: statistics.median(r["own_s"] for r in rs) for op, rs in run["ops"].items()}
            print(f"round {rnd} {name}: save {medians['save']:.3f} s (own {own['save']:.3f}), "
                  f"load {medians['load']:.3f} s (own {own['load']:.3f}), bit-exact {run['bit_exact']}", flush=True)
        # Written after every round, so a run cut short (a device call's time limit) keeps its rounds.
        path = _record(args, trees, runs, rounds_done=rnd + 1)
    print(f"-> {path}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        case, device, path, repeats = sys.argv[2:6]
        print(json.dumps(child(case, device, path, int(repeats))))
    else:
        main()

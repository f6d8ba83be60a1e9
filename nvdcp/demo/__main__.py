"""``python -m nvdcp.demo``: train, checkpoint, stop, resume at another world size, verify.

Runs ``nvdcp.demo.train`` under torchrun twice on this machine: first on ``--first`` processes
(saving every ``--save-every`` steps with nvdcp and, for comparison, torch's FileSystemWriter),
then on ``--then`` processes, which resume from the latest complete checkpoint (a resharded
load) and train on. The demo checks that the state loaded after the restart is bit-identical to
the state that was saved, and that training went on from there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile


def torchrun(nproc: int, train_args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "nvdcp.demo.train", *train_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "NCCL_NVLS_ENABLE": "0"}
    print(f"$ torchrun --standalone --nproc-per-node={nproc} -m nvdcp.demo.train {' '.join(train_args)}", flush=True)
    subprocess.run(cmd, check=True, env=env)


def print_comparison(rows: list[dict[str, float]]) -> None:
    """A table of each compared save: bytes, ratio, save and load time, nvdcp vs stock."""
    if not rows:
        return
    print("\n| step | writer | bytes | ratio | save s | load s |\n|---|---|---|---|---|---|")
    for r in rows:
        for name, key in (("nvdcp", "nvdcp"), ("stock FileSystemWriter", "stock")):
            print(f"| {r['step']} | {name} | {r[key + '_bytes']:,} | {r['stock_bytes'] / r[key + '_bytes']:.3f} "
                  f"| {r[key + '_save_s']:.2f} | {r[key + '_load_s']:.2f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt-root", default=None, help="where checkpoints go (default: a fresh temp dir); s3://... works")
    p.add_argument("--first", type=int, default=2, help="processes before the restart")
    p.add_argument("--then", type=int, default=3, help="processes after the restart")
    p.add_argument("--steps", type=int, default=20, help="steps before the restart (and as many after)")
    p.add_argument("--save-every", type=int, default=10)
    args = p.parse_args(argv)

    root = args.ckpt_root or tempfile.mkdtemp(prefix="nvdcp-demo-")
    logs = tempfile.mkdtemp(prefix="nvdcp-demo-logs-")
    digests = os.path.join(logs, "digests.jsonl")
    common = ["--ckpt-root", root, "--save-every", str(args.save_every), "--digest-log", digests]
    print(f"checkpoints under {root}\n", flush=True)
    torchrun(args.first, [*common, "--steps", str(args.steps), "--compare-stock"])
    print(f"\n-- stopped; resuming on {args.then} processes (resharded load) --\n", flush=True)
    torchrun(args.then, [*common, "--steps", str(2 * args.steps)])

    with open(digests) as f:
        records = [json.loads(line) for line in f]
    saved = {r["step"]: r["digest"] for r in records if r["event"] == "save"}
    loads = [r for r in records if r["event"] == "load"]
    shutil.rmtree(logs, ignore_errors=True)
    if not loads or saved.get(loads[0]["step"]) != loads[0]["digest"]:
        print("\nRESUME CHECK FAILED: the loaded state differs from the saved one", flush=True)
        return 1
    print_comparison([r for r in records if r["event"] == "compare"])
    step = loads[0]["step"]
    print(f"\nresume verified: the state loaded on {loads[0]['world']} ranks at step {step} is bit-identical "
          f"to the one saved on {args.first} ranks; training continued to step {2 * args.steps}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

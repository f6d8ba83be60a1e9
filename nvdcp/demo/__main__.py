"""``python -m nvdcp.demo``: train, checkpoint, stop, resume at another world size, verify.

Runs ``nvdcp.demo.train`` under torchrun twice on this machine: first on ``--first`` processes
(saving every ``--save-every`` steps with nvdcp and, for comparison, torch's FileSystemWriter),
then on ``--then`` processes, which resume from the latest usable checkpoint (a resharded load)
and train on. The demo checks that the state loaded after the restart is bit-identical to the
state that was saved, and that training went on from there.

    python -m nvdcp.demo                                  # local temp dir, 2 then 3 processes
    python -m nvdcp.demo --async-save                     # dcp.async_save with nvdcp's stager
    AWS_ENDPOINT_URL=http://127.0.0.1:9000 python -m nvdcp.demo --ckpt-root s3://bucket/demo1

On a GPU machine the same command trains on the GPUs (NCCL) and compresses there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from nvdcp.demo.train import parse_storage_options
from nvdcp.manage import list_checkpoints


def torchrun(nproc: int, train_args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "nvdcp.demo.train", *train_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "NCCL_NVLS_ENABLE": "0"}
    print(f"$ torchrun --standalone --nproc-per-node={nproc} -m nvdcp.demo.train {' '.join(train_args)}", flush=True)
    subprocess.run(cmd, check=True, env=env)


def print_comparison(rows: list[dict[str, Any]]) -> None:
    """A table of each compared save, nvdcp next to stock: bytes, ratio, and times."""
    sync = [r for r in rows if r.get("mode", "sync") == "sync"]
    if sync:
        print("\n| step | writer | bytes | stock bytes / bytes | save s | load s |\n|---|---|---|---|---|---|")
        for r in sync:
            for name, key in (("nvdcp", "nvdcp"), ("stock FileSystemWriter", "stock")):
                print(f"| {r['step']} | {name} | {r[key + '_bytes']:,} | {r['stock_bytes'] / r[key + '_bytes']:.3f} "
                      f"| {r[key + '_save_s']:.2f} | {r[key + '_load_s']:.2f} |")
    asyncs = [r for r in rows if r.get("mode") == "async"]
    if asyncs:
        print("\n| step | async_save with | bytes | stock bytes / bytes | training blocked s | durable after s |\n|---|---|---|---|---|---|")
        for r in asyncs:
            for name, key in (("nvdcp (NvcompStager)", "nvdcp"), ("stock FileSystemWriter (DefaultStager)", "stock")):
                print(f"| {r['step']} | {name} | {r[key + '_bytes']:,} | {r['stock_bytes'] / r[key + '_bytes']:.3f} "
                      f"| {r[key + '_blocked_s']:.3f} | {r[key + '_save_s']:.2f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt-root", default=None,
                   help="where checkpoints go (default: a fresh temp dir); s3://bucket/prefix works; must hold none yet")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="backend option for URL roots, e.g. endpoint_url=http://127.0.0.1:9000 (repeatable)")
    p.add_argument("--first", type=int, default=2, help="processes before the restart")
    p.add_argument("--then", type=int, default=3, help="processes after the restart")
    p.add_argument("--steps", type=int, default=20, help="steps before the restart (and as many after)")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--async-save", action="store_true", help="checkpoint with dcp.async_save (nvdcp's stager)")
    p.add_argument("--async-mode", choices=["thread", "process"], default="thread")
    p.add_argument("--no-compare", action="store_true", help="skip the comparison with torch's FileSystemWriter")
    p.add_argument("--codec", default="auto")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=12, help="must divide by --first and --then")
    args = p.parse_args(argv)
    options = parse_storage_options(args.storage_option)

    root = args.ckpt_root or tempfile.mkdtemp(prefix="nvdcp-demo-")
    existing = list_checkpoints(root, options or None)
    if existing:
        print(f"{root} already holds checkpoints ({existing[-1].path}...): give the demo an empty root", flush=True)
        return 2
    logs = tempfile.mkdtemp(prefix="nvdcp-demo-logs-")
    digests = os.path.join(logs, "digests.jsonl")
    common = ["--ckpt-root", root, "--save-every", str(args.save_every), "--digest-log", digests,
              "--codec", args.codec, "--d-model", str(args.d_model), "--layers", str(args.layers),
              "--heads", str(args.heads), "--context", str(args.context), "--global-batch", str(args.global_batch)]
    for opt in args.storage_option:
        common += ["--storage-option", opt]
    if args.async_save:
        common += ["--async-save", "--async-mode", args.async_mode]
    print(f"checkpoints under {root}\n", flush=True)
    torchrun(args.first, [*common, "--steps", str(args.steps), *([] if args.no_compare else ["--compare-stock"])])
    print(f"\n-- stopped; resuming on {args.then} processes (resharded load) --\n", flush=True)
    torchrun(args.then, [*common, "--steps", str(2 * args.steps)])

    with open(digests) as f:
        records = [json.loads(line) for line in f]
    shutil.rmtree(logs, ignore_errors=True)
    saved = {r["step"]: r["digest"] for r in records if r["event"] == "save" and r["world"] == args.first}
    loads = [r for r in records if r["event"] == "load"]
    print_comparison([r for r in records if r["event"] == "compare"])
    if not loads or saved.get(loads[0]["step"]) != loads[0]["digest"] or loads[0]["step"] != max(saved, default=-1):
        print("\nRESUME CHECK FAILED: the state loaded after the restart is not the last one saved", flush=True)
        return 1
    final = [r for r in records if r["event"] == "save" and r["world"] == args.then]
    if not final or final[-1]["step"] != 2 * args.steps:
        print("\nRESUME CHECK FAILED: training did not go on to the end after the restart", flush=True)
        return 1
    how = f"dcp.async_save ({args.async_mode})" if args.async_save else "dcp.save"
    print(f"\nresume verified: the state loaded on {loads[0]['world']} ranks at step {loads[0]['step']} is "
          f"bit-identical to the one saved with {how} on {args.first} ranks; training continued to step "
          f"{2 * args.steps}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

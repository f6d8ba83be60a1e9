"""``nvdcp convert --to safetensors`` under a memory budget: peak RSS and time.

    python -m benchmarks.safetensors_export_bench [--max-memory 64MiB] [--steps 5] [--dir /tmp/nvdcp-st-bench]
    python -m benchmarks.safetensors_export_bench --small     # tiny checkpoints (smoke test)

Two checkpoints, each saved by nvdcp (``NvcompWriter``) and by stock ``FileSystemWriter``:

- ``reference``: the CPU reference workload (nvdcp/demo/workload.py: the byte-level GPT at
  d=256, 4 layers, trained ``--steps`` steps with AdamW; params + both moments), one process;
- ``synthetic``: a ~300 MB GPT-like state saved by 4 gloo processes as DTensors: a 128 MiB
  embedding sharded by columns (4 stored chunks of 32 MiB, each a block of columns: 1 KiB runs
  per row), layer weights sharded by rows and by columns, a bf16 head, a step counter and an
  optimizer hyper-parameter (byte items).

Each export runs in a fresh subprocess (``export_safetensors`` under ``--max-memory``). The
subprocess imports torch and nvdcp, resets its peak-RSS mark (``/proc/self/clear_refs``),
records its RSS (the interpreter baseline), exports, and reports ``VmHWM`` (peak RSS) and
``ru_maxrss``. ``overhead`` is peak minus baseline; the target is ``overhead <= 2 x budget``.
Each case runs ``--repeats`` times (default 3): the table shows the least time and the largest
peak. Every output tensor is then compared bit for bit with the source loaded by ``dcp.load``.
Writes benchmarks/results/safetensors_export_bench_<date>.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


# -- the child: one export, measured -----------------------------------------------------------
def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def child(args: argparse.Namespace) -> None:
    import torch  # noqa: F401  (in the baseline, as in any real use)

    import nvdcp  # noqa: F401
    from nvdcp.export_safetensors import export_safetensors

    reset = False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        reset = True
    except OSError:
        pass
    baseline = _status_kib("VmRSS")
    t0 = time.perf_counter()
    result = export_safetensors(
        args.src, args.dst, max_memory=args.max_memory, max_shard_size=args.max_shard_size,
        dtype=args.dtype, threads=args.threads, prefix=args.prefix,
    )
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    print(json.dumps({
        "baseline_rss_kib": baseline, "peak_rss_kib": peak, "peak_reset": reset,
        "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "seconds": seconds, "result": result.as_dict(),
    }))


# -- building the checkpoints ------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _synthetic_layout(small: bool) -> dict[str, tuple[tuple[int, ...], str, int | None]]:
    """name -> (global shape, dtype, sharded dim or None for replicated)."""
    d, vocab, ff = (64, 2048, 256) if small else (1024, 32768, 4096)
    layout: dict[str, tuple[tuple[int, ...], str, int | None]] = {
        "model.embed.weight": ((vocab, d), "float32", 1),
    }
    for i in range(4):
        layout[f"model.layers.{i}.mlp.w1"] = ((ff, d), "float32", 0)
        layout[f"model.layers.{i}.attn.qkv"] = ((3 * d, d), "float32", 1)
        layout[f"model.layers.{i}.attn.wo"] = ((d, d), "float32", 0)
        layout[f"model.layers.{i}.norm"] = ((d,), "float32", None)
    layout["model.head.weight"] = ((8 * d, 2 * d), "bfloat16", 0)
    return layout


def _local_part(name: str, shape: tuple[int, ...], dtype: str, dim: int | None, rank: int, world: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + rank)
    local = list(shape)
    if dim is not None:
        local[dim] //= world
    return (torch.randn(*local, generator=g) * 0.02).to(getattr(torch, dtype))


def _save_rank(rank: int, world: int, port: int, root: str, small: bool) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import nvdcp
    from nvdcp.demo.teardown import release_dtensor_caches

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model: dict[str, Any] = {}
        for name, (shape, dtype, dim) in _synthetic_layout(small).items():
            local = _local_part(name, shape, dtype, dim, 0 if dim is None else rank, world)
            placement = Replicate() if dim is None else Shard(dim)
            model[name.removeprefix("model.")] = DTensor.from_local(local, mesh, [placement], run_check=False)
        sd = {"model": model, "step": 1000, "optim": {"lr": 3e-4}}
        dcp.save(sd, storage_writer=nvdcp.NvcompWriter(os.path.join(root, "nvdcp")))
        dcp.save(sd, storage_writer=FileSystemWriter(os.path.join(root, "stock")))
        dist.barrier()
    finally:
        release_dtensor_caches()
        dist.destroy_process_group()


def build_synthetic(root: str, small: bool, world: int = 4) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_save_rank, args=(world, _free_port(), root, small), nprocs=world, join=True,
                       start_method="spawn")


def build_reference(root: str, steps: int, small: bool) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    import nvdcp
    from benchmarks.workload import train_state
    from nvdcp.demo.model import GPTConfig

    cfg = GPTConfig(d_model=64, n_layers=1, n_heads=2, context=32) if small else GPTConfig()
    state, loss = train_state("cpu", cfg=cfg, steps=steps, batch=8)
    dcp.save(state, storage_writer=nvdcp.NvcompWriter(os.path.join(root, "nvdcp")))
    dcp.save(state, storage_writer=FileSystemWriter(os.path.join(root, "stock")))
    return {"config": cfg.__dict__, "steps": steps, "final_loss": round(loss, 3)}


# -- checking the output -----------------------------------------------------------------------
def check_bit_exact(src: str, fmt: str, out: str, dtype: str | None) -> int:
    """Load the source with dcp.load and compare every exported tensor; returns tensors checked."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    import nvdcp
    from nvdcp.export_safetensors import DTYPES

    with open(os.path.join(src, ".metadata"), "rb") as f:
        md = pickle.load(f)
    index = json.loads(Path(out, "model.safetensors.index.json").read_text())
    cast = DTYPES[dtype] if dtype else None
    by_file: dict[str, list[str]] = {}
    for name, file in index["weight_map"].items():
        by_file.setdefault(file, []).append(name)
    checked = 0
    for file, names in sorted(by_file.items()):  # one file's tensors in memory at a time
        sd: dict[str, Any] = {}
        for name in names:
            meta = md.state_dict_metadata[name]
            assert isinstance(meta, TensorStorageMetadata)
            sd[name] = torch.empty(meta.size, dtype=meta.properties.dtype)
        dcp.load(sd, storage_reader=nvdcp.NvcompReader(src) if fmt == "nvdcp" else FileSystemReader(src))
        with safe_open(os.path.join(out, file), "pt") as f:
            for name in names:
                want = sd.pop(name)
                if cast is not None and want.is_floating_point():
                    want = want.to(cast)
                got = f.get_tensor(name)
                if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(
                    got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
                ):
                    raise AssertionError(f"{out}: {name} differs from the source")
                checked += 1
    return checked


# -- the run -----------------------------------------------------------------------------------
def run_export(src: str, dst: str, max_memory: int, max_shard_size: int, dtype: str | None, threads: int) -> dict[str, Any]:
    import shutil

    shutil.rmtree(dst, ignore_errors=True)
    cmd = [sys.executable, "-m", "benchmarks.safetensors_export_bench", "--child", src, dst,
           "--max-memory", str(max_memory), "--max-shard-size", str(max_shard_size), "--threads", str(threads)]
    if dtype:
        cmd += ["--dtype", dtype]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=REPO, env=env)
    if proc.returncode:
        raise RuntimeError(f"export of {src} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    ap.add_argument("--max-memory", default=str(64 * MiB), help="budget in bytes (default 64 MiB)")
    ap.add_argument("--max-shard-size", default=str(100 * 10**6), help="bytes per output file (default 100 MB)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prefix", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="exports per case: the least time, the largest peak")
    ap.add_argument("--steps", type=int, default=5, help="training steps of the reference workload")
    ap.add_argument("--dir", default="/tmp/nvdcp-st-bench")
    ap.add_argument("--small", action="store_true", help="tiny checkpoints, budget 1 MiB (smoke test)")
    ap.add_argument("--no-verify", action="store_true", help="skip the bit-exact comparison with the source")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    args = ap.parse_args()
    args.max_memory = int(args.max_memory)
    args.max_shard_size = int(args.max_shard_size)
    if args.child:
        args.src, args.dst = args.child
        child(args)
        return

    from benchmarks.common import dir_bytes, fresh_dir, markdown_table, write_results

    if args.small:
        args.max_memory = min(args.max_memory, MiB)
        args.max_shard_size = min(args.max_shard_size, MiB)
    root = fresh_dir(args.dir)
    workloads: dict[str, Any] = {}
    t0 = time.perf_counter()
    workloads["reference"] = build_reference(os.path.join(root, "reference"), 2 if args.small else args.steps, args.small)
    workloads["reference"]["build_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    build_synthetic(os.path.join(root, "synthetic"), args.small)
    workloads["synthetic"] = {"ranks": 4, "layout": {k: [list(s), d, dim] for k, (s, d, dim) in
                                                     _synthetic_layout(args.small).items()},
                              "build_s": round(time.perf_counter() - t0, 2)}
    rows = []
    runs: list[tuple[str, str, str | None]] = [(w, fmt, None) for w in ("reference", "synthetic") for fmt in ("nvdcp", "stock")]
    runs.append(("synthetic", "nvdcp", "bf16"))
    for workload, fmt, dtype in runs:
        src = os.path.join(root, workload, fmt)
        dst = os.path.join(root, "out", f"{workload}_{fmt}_{dtype or 'same'}")
        reps = [run_export(src, dst, args.max_memory, args.max_shard_size, dtype, args.threads)
                for _ in range(1 if args.small else args.repeats)]
        m = max(reps, key=lambda x: x["peak_rss_kib"] - x["baseline_rss_kib"])
        r = m["result"]
        overhead = (m["peak_rss_kib"] - m["baseline_rss_kib"]) * 1024
        m["seconds"] = min(x["seconds"] for x in reps)
        row = {
            "workload": workload, "source": fmt, "dtype": dtype or "as saved", "source_MB": dir_bytes(src) / 1e6,
            "tensors": r["tensors"], "files": len(r["files"]), "output_MB": r["total_size"] / 1e6,
            "largest_chunk_MiB": r["largest_chunk_bytes"] / MiB, "streamed": len(r["streamed"]),
            "seconds": m["seconds"], "MB_per_s": r["source_raw_bytes"] / 1e6 / m["seconds"],
            "baseline_rss_MiB": m["baseline_rss_kib"] / 1024, "peak_rss_MiB": m["peak_rss_kib"] / 1024,
            "overhead_MiB": overhead / MiB, "budget_MiB": args.max_memory / MiB,
            "overhead_x_budget": overhead / args.max_memory, "within_2x_budget": overhead <= 2 * args.max_memory,
            "ru_maxrss_MiB": m["ru_maxrss_kib"] / 1024, "peak_reset": m["peak_reset"],
            "all_seconds": [round(x["seconds"], 3) for x in reps],
            "all_overhead_MiB": [round((x["peak_rss_kib"] - x["baseline_rss_kib"]) / 1024, 1) for x in reps],
            "phases": r["phases"], "streamed_tensors": r["streamed"], "skipped": r["skipped"],
        }
        if not args.no_verify:
            row["bit_exact_tensors"] = check_bit_exact(src, fmt, dst, dtype)
        rows.append(row)
        print(f"{workload}/{fmt}/{row['dtype']}: {row['output_MB']:.1f} MB in {row['seconds']:.2f}s, peak RSS "
              f"{row['peak_rss_MiB']:.0f} MiB = baseline {row['baseline_rss_MiB']:.0f} + {row['overhead_MiB']:.1f} MiB "
              f"({row['overhead_x_budget']:.2f} x budget)", flush=True)
    payload = {"max_memory": args.max_memory, "max_shard_size": args.max_shard_size, "threads": args.threads,
               "workloads": workloads, "rows": rows}
    target = write_results("safetensors_export_bench" + ("_small" if args.small else ""), payload, args.out)
    print()
    print(markdown_table(rows, ["workload", "source", "dtype", "source_MB", "tensors", "files", "largest_chunk_MiB",
                                "streamed", "seconds", "MB_per_s", "baseline_rss_MiB", "peak_rss_MiB",
                                "overhead_MiB", "overhead_x_budget", "within_2x_budget"]))
    print(f"\nwritten {target}")


if __name__ == "__main__":
    main()

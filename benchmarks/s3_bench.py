"""S3 benchmark (issue 4): save and load of the CPU reference workload through an S3 endpoint.

    python -m benchmarks.s3_bench [--size small|tiny] [--variants a,b] [--out DIR]

The workload is the byte-level GPT of benchmarks/workload.py trained a few AdamW steps on the CPU
(``small``: d=256, 8 layers, fp32 params + exp_avg + exp_avg_sq, about 77 MB). The endpoint is a
moto S3 server on loopback, started here, whose WSGI app is wrapped to count every request and
every body byte in and out; moto shares this machine's cores with the client, so the numbers
compare clients against the same server and say nothing about AWS throughput.

Variants, each save and each load in a fresh subprocess (peak RSS is that process's):
  nvdcp-boto3       NvcompWriter/NvcompReader, native boto3 backend (default S3Config)
  nvdcp-fsspec      NvcompWriter/NvcompReader, storage_options={"backend": "fsspec"} (s3fs)
  torch-fsspec      torch's FsspecWriter/FsspecReader (s3fs), uncompressed, sync_files=False
  s3torchconnector  s3torchconnector.dcp.S3StorageWriter/Reader, pointed at the endpoint (only if
                    it imports; its DCP classes take no endpoint, so the client is swapped for an
                    S3Client(endpoint=..., force_path_style=True))

Writes benchmarks/results/s3_<date>.json (or --out DIR) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

VARIANTS = ("nvdcp-boto3", "nvdcp-fsspec", "torch-fsspec", "s3torchconnector")
SIZES = {
    "tiny": {"d_model": 32, "n_layers": 1, "n_heads": 2, "context": 16, "steps": 1, "batch": 2},
    "small": {"d_model": 256, "n_layers": 8, "n_heads": 4, "context": 128, "steps": 3, "batch": 8},
}
BUCKET = "nvdcp-bench"
REGION = "us-east-1"


# -- the counted S3 endpoint -------------------------------------------------------------------
class _CountingInput:
    """Wraps wsgi.input to count the request body bytes moto reads."""

    def __init__(self, inner: Any, counter: RequestCounter) -> None:
        self._inner = inner
        self._counter = counter

    def read(self, *args: Any) -> bytes:
        data = self._inner.read(*args)
        self._counter.add("bytes_up", len(data))
        return data

    def readline(self, *args: Any) -> bytes:
        data = self._inner.readline(*args)
        self._counter.add("bytes_up", len(data))
        return data

    def readinto(self, buf: Any) -> int:
        n = self._inner.readinto(buf)
        self._counter.add("bytes_up", n or 0)
        return n

    def __iter__(self) -> Any:
        return iter(self.readline, b"")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class RequestCounter:
    """WSGI middleware around moto: requests per method/operation and body bytes each way."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.counts: collections.Counter[str] = collections.Counter()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        method, query = environ["REQUEST_METHOD"], environ.get("QUERY_STRING", "")
        op = "UploadPart" if method == "PUT" and "partNumber=" in query else method
        self.add("requests")
        self.add(f"op:{op}")
        environ["wsgi.input"] = _CountingInput(environ["wsgi.input"], self)
        for chunk in self.app(environ, start_response):
            self.add("bytes_down", len(chunk))
            yield chunk


def start_moto() -> tuple[str, RequestCounter, Any]:
    """A threaded moto S3 server on 127.0.0.1 behind the counter; returns (endpoint, counter, server)."""
    import logging

    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    counter = RequestCounter(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, counter, threaded=True, request_handler=MotoRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", counter, server


# -- one save or load, in a worker process -----------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _writer_reader(variant: str, url: str, endpoint: str, phase: str) -> Any:
    import nvdcp

    if variant == "nvdcp-boto3":
        opts = {"endpoint_url": endpoint}
        return nvdcp.NvcompWriter(url, storage_options=opts) if phase == "save" else nvdcp.NvcompReader(url, storage_options=opts)
    if variant == "nvdcp-fsspec":
        opts = {"backend": "fsspec", "endpoint_url": endpoint}
        return nvdcp.NvcompWriter(url, storage_options=opts) if phase == "save" else nvdcp.NvcompReader(url, storage_options=opts)
    if variant == "torch-fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        return FsspecWriter(url, sync_files=False, endpoint_url=endpoint) if phase == "save" else FsspecReader(url, endpoint_url=endpoint)
    if variant == "s3torchconnector":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

        cfg = S3ClientConfig(force_path_style=True)
        obj = S3StorageWriter(REGION, url, s3client_config=cfg) if phase == "save" else S3StorageReader(REGION, url, s3client_config=cfg)
        # Its DCP classes take no endpoint; the S3Client they wrap does.
        obj.fs._client = S3Client(REGION, endpoint=endpoint, s3client_config=cfg)
        return obj
    raise ValueError(f"unknown variant {variant!r}")


def worker(args: argparse.Namespace) -> None:
    """Run one save or load and print a JSON line: wall time, RSS before/peak, verification."""
    import torch
    import torch.distributed.checkpoint as dcp

    from benchmarks.workload import states_equal, zeros_like_state

    state = torch.load(args.state, weights_only=True)
    target = state if args.worker == "save" else zeros_like_state(state)
    io = _writer_reader(args.variant, args.url, args.endpoint, args.worker)
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    before = _rss()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    if args.worker == "save":
        dcp.save(target, storage_writer=io)
    else:
        dcp.load(target, storage_reader=io)
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    import resource

    out = {
        "wall_s": wall, "rss_before_bytes": before, "peak_rss_bytes": max(peak[0], _rss()),
        "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if args.worker == "load":
        out["bit_exact"] = states_equal(target, state)
    print(json.dumps(out))


# -- the driver --------------------------------------------------------------------------------
def build_state(size: str, path: str) -> dict[str, Any]:
    import torch

    from benchmarks.workload import tensor_bytes, train_state
    from nvdcp.demo.model import GPTConfig

    s = SIZES[size]
    cfg = GPTConfig(d_model=s["d_model"], n_layers=s["n_layers"], n_heads=s["n_heads"], context=s["context"])
    torch.set_num_threads(os.cpu_count() or 1)
    state, loss = train_state("cpu", cfg=cfg, steps=s["steps"], batch=s["batch"])
    torch.save(state, path)
    params = sum(t.numel() for t in state["model"].values())
    return {"size": size, **s, "params": params, "state_bytes": tensor_bytes(state), "final_loss": loss}


def _importable(variant: str, env: dict[str, str]) -> str | None:
    """Why a variant cannot run here, or None."""
    module = {"nvdcp-fsspec": "s3fs", "torch-fsspec": "s3fs", "s3torchconnector": "s3torchconnector.dcp"}.get(variant)
    if module is None:
        return None
    probe = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True, check=False)
    if probe.returncode:
        return f"cannot import {module}: {probe.stderr.strip().splitlines()[-1]}"
    return None


def run_phase(variant: str, phase: str, url: str, endpoint: str, state_path: str, env: dict[str, str],
              counter: RequestCounter, timeout: float) -> dict[str, Any]:
    counter.reset()
    cmd = [sys.executable, "-m", "benchmarks.s3_bench", "--worker", phase, "--variant", variant, "--url", url,
           "--endpoint", endpoint, "--state", state_path]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    row: dict[str, Any] = {"variant": variant, "phase": phase, **counter.snapshot()}
    if proc.returncode:
        row["error"] = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return row
    row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return row


def stored_bytes(endpoint: str, prefix: str) -> int:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=REGION)
    total = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        total += sum(o["Size"] for o in page.get("Contents", []))
    return total


NOTES = [
    (
        "One run per variant; save and load each in a fresh subprocess. moto runs in the driver process on "
        "the same cores, so wall times compare clients against one server, not against AWS."
    ),
    "requests/bytes are counted by a WSGI wrapper around moto: every HTTP request and body byte each way.",
    "moto reads a whole object for every ranged GET, so many small ranged GETs cost far more here than on S3.",
    (
        "s3torchconnector: installed with pip install --no-deps --target DIR s3torchconnector==1.5.0 "
        "s3torchconnectorclient==1.5.0 tenacity and put on PYTHONPATH (a plain install would replace the "
        "environment's torch); its DCP classes take no endpoint, so the bench swaps in "
        "S3Client(endpoint=..., force_path_style=True). It stores torch.save bytes uncompressed, like torch-fsspec."
    ),
    (
        "peak_rss_MB is the worker's largest resident set sampled every 5 ms during dcp.save/dcp.load; "
        "rss_before_MB includes torch and the state dict (loads hold the reference state and the target)."
    ),
]


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for dist in ("torch", "boto3", "botocore", "s3fs", "fsspec", "moto", "s3torchconnector"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = "not installed"
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS))
    ap.add_argument("--out", default=None, help="directory for s3_<date>.json (default benchmarks/results)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per save or load")
    ap.add_argument("--worker", choices=("save", "load"), help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--state", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    run(args, variants)


def run(args: argparse.Namespace, variants: list[str]) -> None:
    import boto3

    from benchmarks.common import markdown_table, write_results

    endpoint, counter, server = start_moto()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret",
           "AWS_DEFAULT_REGION": REGION, "AWS_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
           "OMP_NUM_THREADS": "1"}
    os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")})
    boto3.client("s3", endpoint_url=endpoint, region_name=REGION).create_bucket(Bucket=BUCKET)
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        state_path = os.path.join(tmp, "state.pt")
        workload = build_state(args.size, state_path)
        for variant in variants:
            reason = _importable(variant, env)
            if reason:
                skipped.append({"variant": variant, "reason": reason})
                continue
            url = f"s3://{BUCKET}/{variant}/step{workload['steps']}"
            for phase in ("save", "load"):
                row = run_phase(variant, phase, url, endpoint, state_path, env, counter, args.timeout)
                row["stored_bytes"] = stored_bytes(endpoint, f"{variant}/")
                rows.append(row)
                if "error" in row:
                    break
    server.shutdown()
    for r in rows:
        if "wall_s" in r:
            r["MB/s"] = workload["state_bytes"] / r["wall_s"] / 1e6
        for key in ("bytes_up", "bytes_down", "stored_bytes", "peak_rss_bytes", "rss_before_bytes"):
            if key in r:
                r[key.replace("_bytes", "") + "_MB"] = r[key] / 1e6
    columns = ["variant", "phase", "wall_s", "MB/s", "requests", "bytes_up_MB", "bytes_down_MB", "stored_MB",
               "rss_before_MB", "peak_rss_MB", "bit_exact", "error"]
    print(f"workload: {workload['params']:,} params, {workload['state_bytes'] / 1e6:.1f} MB of state; "
          f"endpoint: moto on 127.0.0.1")
    print(markdown_table(rows, columns))
    for s in skipped:
        print(f"skipped {s['variant']}: {s['reason']}")
    payload = {"benchmark": "s3", "endpoint": "moto S3 server on 127.0.0.1 (same machine)", "workload": workload,
               "versions": _versions(), "results": rows, "skipped": skipped, "columns": columns, "notes": NOTES}
    print("written", write_results("s3", payload, args.out))


if __name__ == "__main__":
    main()

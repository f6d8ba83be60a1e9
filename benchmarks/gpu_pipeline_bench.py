"""Host side against GPU speed (issue 18): CRC32C on the host and on the device, and nvdcp's save
and load pipelines against stock DCP on fast storage, in one run.

    python -m benchmarks.gpu_pipeline_bench [--out DIR] [--dir /dev/shm/nvdcp-pipe] [--small]

1. CRC32C GB/s of the same chunks (64 KiB ranges and a mix of compressed-size ranges of one
   buffer): the host (``nvdcp.format.crc.checksum_ranges``: the native batched library when built,
   else the crc32c package) and the device kernel (``nvdcp.gpu.crc32c``, several tile/warp
   settings; each checked equal to the host's values).
2. 4 GB of fp32 state in 64 MiB tensors on the GPU, checkpoint on /dev/shm: nvdcp with default
   arguments (a first save and load, then a second: warm encoders, kernels and pinned pools) and
   with thread_count=4, against stock FileSystemWriter thread_count 1 and 4 and FileSystemReader;
   loads into GPU tensors (zeroed first). GB/s of state, bit-exactness.
3. 20,000 tensors of 4 KiB-1 MiB (log-uniform sizes) on the GPU, same writers: GB/s of state and
   microseconds per item.

Without CUDA it runs a smaller CPU version (state on the host, 256 MB / 2,000 tensors; no device
CRC) as a smoke test. Writes gpu_pipeline_bench_<date>.json under --out (default benchmarks/results/)
with date, machine and command; prints markdown tables.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from benchmarks.common import dir_bytes, markdown_table, write_results
from nvdcp.format.crc import checksum_ranges, native_available
from nvdcp.gpu.config import GpuConfig

GB = 1e9
MiB = 1 << 20


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any]) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


# -- 1. CRC32C ----------------------------------------------------------------------------------
def crc_bench(total: int, on_gpu: bool) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 256, size=total, dtype=np.uint8)
    rows: list[dict[str, Any]] = []
    cases = {
        "64KiB ranges": (np.arange(0, total, 65536, dtype=np.int64), None),
        "mixed 1-64KiB ranges": (None, rng.integers(1, 65537, size=total // 40000)),
    }
    for name, (offs, lens) in cases.items():
        if offs is None:
            assert lens is not None
            lens = lens.astype(np.int64)
            offs = np.zeros(len(lens), dtype=np.int64)
            np.cumsum(lens[:-1], out=offs[1:])
            keep = offs + lens <= total
            offs, lens = offs[keep], lens[keep]
        else:
            lens = np.minimum(65536, total - offs)
        nbytes = int(lens.sum())
        host = checksum_ranges(buf, offs, lens)  # warm
        reps = 3
        t = min(_timed(lambda: checksum_ranges(buf, offs, lens)) for _ in range(reps))
        rows.append({"case": name, "where": "host native" if native_available() else "host crc32c pkg",
                     "ranges": len(offs), "GB": round(nbytes / GB, 3), "GB/s": round(nbytes / t / GB, 2)})
        if not on_gpu:
            continue
        from nvdcp.gpu.crc32c import checksum_ranges_device, device_crc_available

        if not device_crc_available():
            rows.append({"case": name, "where": "device: triton not importable"})
            continue
        dev = torch.from_numpy(buf).cuda()
        doffs, dlens = torch.from_numpy(offs).cuda(), torch.from_numpy(lens).cuda()
        for tile, warps in [(64, 1), (128, 1), (128, 2), (256, 2), (256, 4), (512, 4)]:
            try:
                crcs, _ = checksum_ranges_device(dev, doffs, dlens, tile=tile, num_warps=warps)
                equal = bool((crcs.cpu().numpy().view(np.uint32) == host).all())
                t = min(_timed(lambda: checksum_ranges_device(dev, doffs, dlens, tile=tile, num_warps=warps))
                        for _ in range(5))
                rows.append({"case": name, "where": f"device tile {tile} warps {warps}", "ranges": len(offs),
                             "GB": round(nbytes / GB, 3), "GB/s": round(nbytes / t / GB, 2), "equal_to_host": equal})
            except Exception as exc:  # report, keep going
                rows.append({"case": name, "where": f"device tile {tile} warps {warps}", "error": repr(exc)[:300]})
    return rows


# -- 2./3. save and load ------------------------------------------------------------------------
def big_state(total: int, tensor_bytes: int, device: torch.device) -> dict[str, torch.Tensor]:
    n = max(1, total // tensor_bytes)
    g = torch.Generator(device=device).manual_seed(0)
    sd = {}
    for i in range(n):
        # AdamW-like magnitudes: a spread of exponents, random mantissas
        t = torch.randn(tensor_bytes // 4, generator=g, device=device) * (10.0 ** (-(i % 6)))
        sd[f"layer{i}.w"] = t
    return sd


def small_state(count: int, device: torch.device, seed: int = 1) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(np.log(4096), np.log(1 << 20), size=count)).astype(np.int64) // 4
    g = torch.Generator(device=device).manual_seed(seed)
    flat = torch.randn(int(sizes.sum()), generator=g, device=device) * 0.02
    sd, pos = {}, 0
    for i, n in enumerate(sizes.tolist()):
        sd[f"p{i}"] = flat[pos : pos + n].clone()
        pos += n
    del flat
    return sd


def _stock_reader(path: str) -> Any:
    return dcp.FileSystemReader(path)


WRITERS: dict[str, tuple[Callable[[str], Any], Callable[[str], Any]]] = {
    "stock t1": (lambda p: dcp.FileSystemWriter(p, thread_count=1), _stock_reader),
    "stock t4": (lambda p: dcp.FileSystemWriter(p, thread_count=4), _stock_reader),
    # repeated saves of one state are the benchmark's point: no stale-save warning
    "nvdcp default": (lambda p: nvdcp.NvcompWriter(p, on_identical_save="ignore"), lambda p: nvdcp.NvcompReader(p)),
    "nvdcp t1": (lambda p: nvdcp.NvcompWriter(p, thread_count=1, on_identical_save="ignore"),
                 lambda p: nvdcp.NvcompReader(p)),
    "nvdcp t4": (lambda p: nvdcp.NvcompWriter(p, thread_count=4, on_identical_save="ignore"),
                 lambda p: nvdcp.NvcompReader(p)),
    "nvdcp t8": (lambda p: nvdcp.NvcompWriter(p, thread_count=8, on_identical_save="ignore"),
                 lambda p: nvdcp.NvcompReader(p)),
    # knobs: pinned host budget (GpuConfig.pinned_memory_bytes, 512 MiB by default), reader threads
    "nvdcp pin1g": (lambda p: nvdcp.NvcompWriter(p, on_identical_save="ignore", gpu=GpuConfig(pinned_memory_bytes=1 << 30)),
                    lambda p: nvdcp.NvcompReader(p, gpu=GpuConfig(pinned_memory_bytes=1 << 30))),
    "nvdcp pin2g": (lambda p: nvdcp.NvcompWriter(p, on_identical_save="ignore", gpu=GpuConfig(pinned_memory_bytes=2 << 30)),
                    lambda p: nvdcp.NvcompReader(p, gpu=GpuConfig(pinned_memory_bytes=2 << 30))),
    "nvdcp r4": (lambda p: nvdcp.NvcompWriter(p, on_identical_save="ignore"), lambda p: nvdcp.NvcompReader(p, thread_count=4)),
    "nvdcp r16": (lambda p: nvdcp.NvcompWriter(p, on_identical_save="ignore"), lambda p: nvdcp.NvcompReader(p, thread_count=16)),
}


# -- profiling: every thread's stack, sampled ---------------------------------------------------
class StackSampler:
    """Samples every thread's Python stack every ``interval`` s (``sys._current_frames``), so
    time inside C calls (system calls, CUDA waits, nvCOMP) shows at the Python line that made
    them. ``summary()``: the top lines by samples (self: innermost frame in nvdcp/torch code;
    incl: any frame), per thread-name group, with the share of samples each took."""

    def __init__(self, interval: float = 0.002) -> None:
        import threading

        self.interval = interval
        self.stop = threading.Event()
        self.self_counts: dict[tuple[str, str], int] = {}
        self.incl_counts: dict[tuple[str, str], int] = {}
        self.thread_samples: dict[str, int] = {}
        self.thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self) -> StackSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()

    @staticmethod
    def _group(name: str) -> str:
        import re

        return re.sub(r"[_-]?\d+(_\d+)?$", "", name) or name

    def _run(self) -> None:
        import threading

        me = threading.get_ident()
        while not self.stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                group = self._group(names.get(ident, "?"))
                self.thread_samples[group] = self.thread_samples.get(group, 0) + 1
                seen, innermost = set(), None
                f: Any = frame
                while f is not None:
                    code = f.f_code
                    fn = code.co_filename
                    if "threading.py" not in fn and "concurrent/futures" not in fn and "queue.py" not in fn:
                        short = fn.split("site-packages/")[-1].split("/work/main/")[-1]
                        key = (group, f"{short}:{f.f_lineno} {code.co_name}")
                        if innermost is None:
                            innermost = key
                        fkey = (group, f"{short} {code.co_name}")
                        if fkey not in seen:
                            seen.add(fkey)
                            self.incl_counts[fkey] = self.incl_counts.get(fkey, 0) + 1
                    f = f.f_back
                if innermost is not None:
                    self.self_counts[innermost] = self.self_counts.get(innermost, 0) + 1

    def summary(self, top: int = 25) -> dict[str, Any]:
        """Top lines overall, and (``by_thread``) the top lines of each thread group, so the I/O
        and decode threads of a load are not crowded out by the main thread's DCP frames (which
        every sample of it repeats)."""
        out: dict[str, Any] = {"interval_s": self.interval, "threads": dict(sorted(self.thread_samples.items(), key=lambda kv: -kv[1]))}
        for label, counts in (("self", self.self_counts), ("incl", self.incl_counts)):
            rows = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
            out[label] = [[g, where, n, round(n / max(1, self.thread_samples.get(g, 1)), 3)] for (g, where), n in rows]
        by_thread: dict[str, Any] = {}
        for group, total in self.thread_samples.items():
            entry: dict[str, Any] = {"samples": total}
            for label, counts in (("self", self.self_counts), ("incl", self.incl_counts)):
                rows = sorted(((where, n) for (g, where), n in counts.items() if g == group), key=lambda kv: -kv[1])[:top]
                entry[label] = [[where, n, round(n / max(1, total), 3)] for where, n in rows]
            by_thread[group] = entry
        out["by_thread"] = by_thread
        return out



# -- host I/O: one data file written from several threads vs several files --------------------
def file_probe(root: str, nbytes: int) -> list[dict[str, Any]]:
    """GB/s of one ``LocalStorage`` write stream of ``nbytes`` (64 KiB parts, like chunks) with
    the parallel slices on and off, of the same bytes as 4 and 8 separate files written at once,
    and of reading it back with and without parallel slices. Settles whether one data file per
    rank can reach the write target on this file system (tmpfs, ext4 and XFS serialize buffered
    writes to one file on its inode lock)."""
    from concurrent.futures import ThreadPoolExecutor

    from nvdcp.storage import local

    buf = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    parts = [memoryview(buf)[i : i + (64 << 10)] for i in range(0, nbytes, 64 << 10)]
    storage = local.LocalStorage(os.path.join(root, "file_probe"), sync=False)
    storage.prepare()
    rows: list[dict[str, Any]] = []
    saved = local.IO_THREADS

    def one_file(name: str, views: list[memoryview]) -> None:
        stream = storage.create(name)
        stream.writelines(views)
        stream.commit()

    try:
        for threads in (1, saved):
            local.IO_THREADS = threads
            t = min(_timed(lambda: one_file("one", parts)) for _ in range(3))
            rows.append({"case": f"one file, {threads} I/O threads", "op": "write", "GB/s": round(nbytes / t / GB, 2)})
            out = np.empty_like(buf)
            views = [memoryview(out)[i : i + (64 << 10)] for i in range(0, nbytes, 64 << 10)]
            t = min(_timed(lambda: storage.read_into("one", 0, views)) for _ in range(3))
            rows.append({"case": f"one file, {threads} I/O threads", "op": "read", "GB/s": round(nbytes / t / GB, 2),
                         "equal": bool(np.array_equal(out, buf))})
        local.IO_THREADS = 1
        for files in (4, 8):
            step = -(-len(parts) // files)
            with ThreadPoolExecutor(files) as pool:
                t = min(_timed(lambda: list(pool.map(one_file, [f"f{i}" for i in range(files)],
                                                     [parts[i * step : (i + 1) * step] for i in range(files)])))
                        for _ in range(3))
            rows.append({"case": f"{files} files at once", "op": "write", "GB/s": round(nbytes / t / GB, 2)})
    finally:
        local.IO_THREADS = saved
        shutil.rmtree(os.path.join(root, "file_probe"), ignore_errors=True)
    return rows


# -- GPU encode alone: does it scale with concurrent encoders? ---------------------------------
def encode_probe(sd: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """GB/s of state of ``ItemEncoder.encode_gpu_jobs`` (compress, pack, checksum, copy to pinned
    memory; records consumed, nothing written) over the whole state from one thread, and split
    over 4 and 8 threads (``shares``) as NvcompWriter(thread_count=N) does; with a stack profile
    of the 4-thread run."""
    from concurrent.futures import ThreadPoolExecutor

    from nvdcp.pipeline.encoder import ItemEncoder

    enc = ItemEncoder()
    names = list(sd)
    raw = sum(t.numel() * t.element_size() for t in sd.values())
    rows: list[dict[str, Any]] = []

    def encode(keys: list[str], shares: int) -> None:
        jobs = [enc.gpu_job(k, sd[k], k) for k in keys]
        for _ in enc.encode_gpu_jobs(jobs, shares):
            pass

    try:
        for threads in (1, 4, 8):
            split = [names[i::threads] for i in range(threads)]
            run = (lambda: encode(names, 1)) if threads == 1 else (
                lambda: list(pool.map(encode, split, [threads] * threads)))
            with ThreadPoolExecutor(threads) as pool:
                run()  # warm: encoders, codecs, pinned buffers
                t = min(_timed(run) for _ in range(2))
                row: dict[str, Any] = {"threads": threads, "GB/s": round(raw / t / GB, 2), "s": round(t, 3)}
                if threads == 4:
                    _, row["profile"] = _profiled(run, True)
            rows.append(row)
            print(f"  encode only, {threads} threads: {row['GB/s']} GB/s", flush=True)
    finally:
        enc.close()
    return rows


def _profiled(fn: Callable[[], Any], on: bool) -> tuple[float, dict[str, Any] | None]:
    if not on:
        return _timed(fn), None
    with StackSampler() as sampler:
        seconds = _timed(fn)
    return seconds, sampler.summary()


def save_load(label: str, sd: dict[str, torch.Tensor], root: str, writer: str, repeat: int,
              profile: bool = False) -> list[dict[str, Any]]:
    """``repeat`` timed runs; with ``profile``, one more run under :class:`StackSampler` (its
    times are reported too, marked ``"profiled": true``: the sampler costs a little)."""
    make_writer, make_reader = WRITERS[writer]
    raw = sum(t.numel() * t.element_size() for t in sd.values())
    rows = []
    for run in range(repeat + int(profile)):
        prof = run == repeat
        path = os.path.join(root, f"{label}_{writer.replace(' ', '_')}")
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        gc.collect()
        w = make_writer(path)
        save_s, save_prof = _profiled(lambda: dcp.save(sd, storage_writer=w), prof)
        stored = dir_bytes(path)
        target = {k: torch.zeros_like(v) for k, v in sd.items()}
        r = make_reader(path)
        load_s, load_prof = _profiled(lambda: dcp.load(target, storage_reader=r), prof)
        exact = all(torch.equal(target[k], sd[k]) for k in sd)
        row = {"state": label, "writer": writer, "run": run + 1, "items": len(sd), "GB_state": round(raw / GB, 3),
               "ratio": round(raw / max(stored, 1), 3), "save_s": round(save_s, 3), "load_s": round(load_s, 3),
               "save_GB/s": round(raw / save_s / GB, 2), "load_GB/s": round(raw / load_s / GB, 2),
               "save_us/item": round(save_s / len(sd) * 1e6, 1), "load_us/item": round(load_s / len(sd) * 1e6, 1),
               "bit_exact": exact, "files": _data_files(path)}
        for name, obj in (("save_phases", getattr(w, "last_report", None)), ("load_phases", getattr(r, "last_report", None))):
            phases = getattr(obj, "phases", None)
            if phases:
                row[name] = {k: round(v, 3) for k, v in phases.items()}
        if prof:
            row.update(profiled=True, save_profile=save_prof, load_profile=load_prof)
        rows.append(row)
        print(f"  {label:>10} {writer:>14} run {run + 1}: save {save_s:.3f} s ({row['save_GB/s']} GB/s), "
              f"load {load_s:.3f} s ({row['load_GB/s']} GB/s), ratio {row['ratio']}, exact {exact}", flush=True)
        shutil.rmtree(path, ignore_errors=True)
    return rows


def _data_files(path: str) -> int:
    return sum(n.endswith(".nvdcp") for n in os.listdir(path)) if os.path.isdir(path) else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory of the JSON result (default benchmarks/results/)")
    ap.add_argument("--dir", default="/dev/shm/nvdcp-pipe" if os.path.isdir("/dev/shm") else "/tmp/nvdcp-pipe")
    ap.add_argument("--small", action="store_true", help="smaller sizes (the default without CUDA)")
    ap.add_argument("--big-bytes", type=float, default=None, help="bytes of the large state (default 4e9)")
    ap.add_argument("--small-count", type=int, default=None, help="number of small tensors (default 20000)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: crc,files,encode,big,small")
    ap.add_argument("--writers", default="nvdcp default,stock t1,stock t4,nvdcp t4",
                    help=f"comma-separated writers of the save/load parts, of: {', '.join(WRITERS)}")
    ap.add_argument("--profile", action="store_true",
                    help="one more run per nvdcp writer and state under a stack sampler (save_profile, load_profile)")
    args = ap.parse_args()
    on_gpu = torch.cuda.is_available()
    small = args.small or not on_gpu
    if not on_gpu:
        print("no CUDA device: running the CPU smoke version (state on the host, no device CRC32C)")
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    skip = set(filter(None, args.skip.split(",")))
    big_bytes = int(args.big_bytes or (256e6 if small else 4e9))
    small_count = args.small_count or (2000 if small else 20000)
    os.makedirs(args.dir, exist_ok=True)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "dir": args.dir,
                              "small": small}

    if "crc" not in skip:
        print("CRC32C ...", flush=True)
        result["crc32c"] = crc_bench(256 * MiB if small else 1 << 30, on_gpu)
        print(markdown_table(result["crc32c"], ["case", "where", "ranges", "GB", "GB/s", "equal_to_host"]))

    if "files" not in skip:
        print("file write/read probe ...", flush=True)
        result["files"] = file_probe(args.dir, 256 * MiB if small else 1 << 30)
        print(markdown_table(result["files"], ["case", "op", "GB/s", "equal"]))

    writers = [w.strip() for w in args.writers.split(",") if w.strip()]
    rows: list[dict[str, Any]] = []
    if "big" not in skip:
        tensor_bytes = 8 * MiB if small else 64 * MiB
        print(f"large state: {big_bytes / GB:.2f} GB in {tensor_bytes // MiB} MiB fp32 tensors on {device} ...", flush=True)
        sd = big_state(big_bytes, tensor_bytes, device)
        if on_gpu and "encode" not in skip:
            result["encode_scaling"] = encode_probe(sd)
        for writer in writers:
            nv = writer.startswith("nvdcp")
            rows += save_load("large", sd, args.dir, writer, repeat=2 if nv else 1, profile=args.profile and nv)
        del sd
    if "small" not in skip:
        print(f"small tensors: {small_count} of 4 KiB-1 MiB on {device} ...", flush=True)
        sd = small_state(small_count, device)
        for writer in writers:
            nv = writer.startswith("nvdcp")
            rows += save_load("small", sd, args.dir, writer, repeat=2 if nv else 1, profile=args.profile and nv)
        del sd
    result["save_load"] = rows
    if rows:
        print(markdown_table(rows, ["state", "writer", "run", "items", "GB_state", "ratio", "save_s", "load_s",
                                    "save_GB/s", "load_GB/s", "save_us/item", "load_us/item", "bit_exact",
                                    "files"]))
    path = write_results("gpu_pipeline_bench", result, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

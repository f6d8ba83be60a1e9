"""Wall time of each step of a save and a load of many small tensors, per thread (a diagnostic).

    python -m benchmarks.phase_probe [--device cuda] [--count 20000] [--dir /dev/shm/pp] [--repeats 2]

Why not the stack sampler (``cpu_pipeline_bench --profile``): a sampling thread takes the GIL
every few milliseconds, and on a GIL-bound path its own traffic decides which lines it sees.
Here each listed function (DCP's planner steps, nvdcp's storage methods, the GPU encoder's and
decoder's stages, per-item helpers) is wrapped with a timer: calls, total seconds, microseconds
per call, by thread. Nested functions are counted in their callers too (times are inclusive);
a generator's time is the time spent inside its ``next()`` calls. A timer costs about a
microsecond per call, so per-item rows carry that much overhead. The last repeat is reported
(the first warms caches and the CUDA context); the state is ``cpu_pipeline_bench``'s ``small``.
Prints the table and writes ``benchmarks/results/phase_probe_<date>_<device>.json``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from benchmarks.common import markdown_table, write_results
from benchmarks.cpu_pipeline_bench import small_state
from benchmarks.workload import states_equal, zeros_like_state

#: ``module:Class.method`` or ``module:function`` (module attributes are replaced, so calls
#: through the module's globals are timed too).
TARGETS = [
    # DCP's steps
    "torch.distributed.checkpoint.state_dict_saver:_save_state_dict",
    "torch.distributed.checkpoint.state_dict_loader:_load_state_dict",
    "torch.distributed.checkpoint.state_dict_saver:_stateful_to_state_dict",
    "torch.distributed.checkpoint.default_planner:DefaultSavePlanner.set_up_planner",
    "torch.distributed.checkpoint.default_planner:DefaultLoadPlanner.set_up_planner",
    "torch.distributed.checkpoint.utils:_DistWrapper.reduce_scatter",
    "torch.distributed.checkpoint.utils:_DistWrapper.all_reduce",
    "torch.distributed.checkpoint.utils:_DistWrapper.all_gather",
    "torch.distributed.checkpoint.utils:_DistWrapper.broadcast_object",
    "torch.distributed.checkpoint.default_planner:DefaultSavePlanner.create_local_plan",
    "torch.distributed.checkpoint.default_planner:DefaultSavePlanner.create_global_plan",
    "torch.distributed.checkpoint.default_planner:DefaultSavePlanner.finish_plan",
    "torch.distributed.checkpoint.default_planner:DefaultSavePlanner.resolve_data",
    "torch.distributed.checkpoint.default_planner:DefaultLoadPlanner.create_local_plan",
    "torch.distributed.checkpoint.default_planner:DefaultLoadPlanner.create_global_plan",
    "torch.distributed.checkpoint.default_planner:DefaultLoadPlanner.resolve_tensor",
    "torch.distributed.checkpoint.default_planner:DefaultLoadPlanner.commit_tensor",
    # the writer
    "nvdcp.dcp.writer:NvcompWriter.reset",
    "nvdcp.dcp.writer:NvcompWriter.set_up_storage_writer",
    "nvdcp.dcp.writer:NvcompWriter.storage_meta",
    "nvdcp.dcp.writer:NvcompWriter.prepare_local_plan",
    "nvdcp.dcp.writer:NvcompWriter.prepare_global_plan",
    "nvdcp.dcp.writer:NvcompWriter.write_data",
    "nvdcp.dcp.writer:NvcompWriter.finish",
    "nvdcp.dcp.writer:NvcompWriter._write_files",
    "nvdcp.dcp.writer:NvcompWriter._dispatch_gpu_pass",
    "nvdcp.dcp.writer:NvcompWriter._result",
    "nvdcp.dcp.writer:_FileWriter.write",
    "nvdcp.dcp.writer:_FileWriter.enqueue",
    "nvdcp.dcp.writer:_RecordWriter.append",
    "nvdcp.dcp.writer:_FileWriter.write_batch",
    "nvdcp.dcp.writer:_RecordWriter.append_batch",
    "nvdcp.dcp.writer:NvcompWriter._batch_results",
    "nvdcp.dcp.writer:_spread",
    "nvdcp.dcp.commit:CheckpointCommit.commit",
    "nvdcp.dcp.metadata_io:dump_metadata",
    "nvdcp.pipeline.encoder:ItemEncoder.gpu_job",
    "nvdcp.pipeline.encoder:ItemEncoder.uses_gpu",
    "nvdcp.pipeline.encoder:ItemEncoder.encode_items",
    "nvdcp.pipeline.cpu_batch:_encode_group",
    "nvdcp.gpu.encoder:GpuEncoder._plan",
    "nvdcp.gpu.encoder:GpuEncoder._launch",
    "nvdcp.gpu.encoder:GpuEncoder._slot_table",
    "nvdcp.gpu.encoder:GpuEncoder._split_planes",
    "nvdcp.gpu.encoder:GpuEncoder._to_host",
    "nvdcp.gpu.encoder:GpuEncoder._bucket_items",
    "nvdcp.gpu.encoder:GpuEncoder._item",
    "nvdcp.gpu.encoder:GpuEncoder._whole_records",
    "nvdcp.dcp.writer:_share_out",
    "nvdcp.gpu.encoder:GpuEncoder.encode_buckets",
    "nvdcp.gpu.encoder:split_small_tensors",
    # the reader
    "nvdcp.dcp.reader:NvcompReader.reset",
    "nvdcp.dcp.reader:NvcompReader.read_metadata",
    "nvdcp.dcp.reader:NvcompReader.set_up_storage_reader",
    "nvdcp.dcp.reader:NvcompReader.prepare_local_plan",
    "nvdcp.dcp.reader:NvcompReader.read_data",
    "nvdcp.dcp.reader:NvcompReader._decode_device",
    "nvdcp.dcp.reader:NvcompReader._gpu_batches",
    "nvdcp.dcp.reader:NvcompReader._fetch_and_decode",
    "nvdcp.dcp.reader:NvcompReader._load_gpu_batch",
    "nvdcp.dcp.reader:NvcompReader._record_runs",
    "nvdcp.dcp.reader:NvcompReader._records_in_memory",
    "nvdcp.dcp.reader:NvcompReader._commit_loaded",
    "nvdcp.dcp.reader:NvcompReader._load_cpu_batch",
    "nvdcp.dcp.reader:_header_and_table",
    "nvdcp.gpu.decoder:GpuDecoder.decode_many",
    "nvdcp.gpu.decoder:GpuDecoder._outputs",
    "nvdcp.gpu.decoder:GpuDecoder._plan",
    "nvdcp.gpu.decoder:GpuDecoder._stage",
    "nvdcp.gpu.decoder:GpuDecoder._upload",
    "nvdcp.gpu.decoder:GpuDecoder._decode",
    "nvdcp.gpu.decoder:GpuDecoder._check_decoded",
    "nvdcp.pipeline.cpu_batch:parse_records",
    "nvdcp.pipeline.cpu_batch:decode_records",
]


class Timers:
    """Calls, wall seconds and the thread's CPU seconds per (thread name, target).

    CPU seconds (``time.thread_time``) count what the thread ran, holding the GIL or in C code
    that released it; wall minus CPU is time it waited (for the GIL, a lock, the GPU, I/O)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], list[float]] = {}
        self.lock = threading.Lock()

    def add(self, name: str, seconds: float, cpu_seconds: float) -> None:
        key = (threading.current_thread().name.rsplit("_", 1)[0], name)
        with self.lock:
            row = self.rows.setdefault(key, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += seconds
            row[2] += cpu_seconds

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def gen(*args: Any, **kwargs: Any) -> Any:
                it = fn(*args, **kwargs)
                spent = cpu = 0.0
                try:
                    while True:
                        t, c = time.perf_counter(), time.thread_time()
                        try:
                            value = next(it)
                        except StopIteration as stop:
                            spent += time.perf_counter() - t
                            cpu += time.thread_time() - c
                            return stop.value
                        spent += time.perf_counter() - t
                        cpu += time.thread_time() - c
                        yield value
                finally:
                    self.add(name, spent, cpu)
                    it.close()
            return gen

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t, time.thread_time() - c)
        return run


def install(timers: Timers) -> list[str]:
    """Wrap every target that exists here; returns those that do not."""
    missing = []
    for target in TARGETS:
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(target)
            continue
        owner: Any = module
        *path, leaf = attr.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        fn = getattr(owner, leaf, None) if owner is not None else None
        if fn is None:
            missing.append(target)
            continue
        if isinstance(inspect.getattr_static(owner, leaf), staticmethod):
            setattr(owner, leaf, staticmethod(timers.wrap(attr, fn)))
        else:
            setattr(owner, leaf, timers.wrap(attr, fn))
    return missing


def stock_times(state: dict[str, torch.Tensor], path: str, device: str) -> tuple[float, float]:
    """Seconds of a stock ``FileSystemWriter`` save and ``FileSystemReader`` load of ``state``."""
    shutil.rmtree(path, ignore_errors=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    save_s = time.perf_counter() - t0
    out = zeros_like_state(state)
    sync()
    t0 = time.perf_counter()
    dcp.load(out, storage_reader=dcp.FileSystemReader(path))
    sync()
    load_s = time.perf_counter() - t0
    shutil.rmtree(path, ignore_errors=True)
    return save_s, load_s


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    """Nanoseconds covered by the union of ``(start, end)`` intervals."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def timeline(state: dict[str, torch.Tensor], path: str, op: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """One more save (or load) under ``torch.profiler`` with CUDA activities, summarized: how
    long the GPU was busy (kernels, copies, memsets, per stream and in all), the CUDA runtime
    calls that took longest per host thread (a ``cudaMemcpyAsync`` from pageable memory or a
    synchronize waits for the stream's earlier work), and the kernels that took longest."""
    from torch.profiler import ProfilerActivity, profile

    out = zeros_like_state(state) if op == "load" else None
    if op == "save":
        shutil.rmtree(path, ignore_errors=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        if op == "save":
            dcp.save(state, storage_writer=nvdcp.NvcompWriter(path, on_identical_save="ignore", **knobs))
        else:
            dcp.load(out, storage_reader=nvdcp.NvcompReader(path, **knobs))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.profiler.kineto_results.events()
    device: list[Any] = [e for e in events if str(e.device_type()).endswith("CUDA")]
    host = [e for e in events if not str(e.device_type()).endswith("CUDA") and e.name().startswith("cuda")]
    streams: dict[int, list[tuple[int, int]]] = {}
    kernels: dict[str, list[float]] = {}
    for e in device:
        streams.setdefault(e.device_resource_id(), []).append((e.start_ns(), e.end_ns()))
        row = kernels.setdefault(e.name()[:80], [0, 0.0])
        row[0] += 1
        row[1] += e.duration_ns() / 1e9
    runtime: dict[tuple[int, str], list[float]] = {}
    for e in host:
        row = runtime.setdefault((e.start_thread_id(), e.name()), [0, 0.0])
        row[0] += 1
        row[1] += e.duration_ns() / 1e9
    summary: dict[str, Any] = {
        "op": op, "wall_s": wall,
        "gpu_busy_s": _union_ns([iv for ivs in streams.values() for iv in ivs]) / 1e9,
        "stream_busy_s": {str(k): _union_ns(v) / 1e9 for k, v in streams.items()},
        "runtime_calls": [{"thread": t, "call": n, "calls": int(c), "seconds": round(x, 4)}
                          for (t, n), (c, x) in sorted(runtime.items(), key=lambda kv: -kv[1][1])[:20]],
        "kernels": [{"kernel": n, "calls": int(c), "seconds": round(x, 4)}
                    for n, (c, x) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:15]],
    }
    print(f"\ntimeline of one {op}: {wall:.3f} s wall, GPU busy {summary['gpu_busy_s']:.3f} s; per stream "
          + ", ".join(f"{k}: {v:.3f} s" for k, v in summary["stream_busy_s"].items()))
    print(markdown_table(summary["runtime_calls"], ["thread", "call", "calls", "seconds"]))
    print(markdown_table(summary["kernels"], ["kernel", "calls", "seconds"]))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--count", type=int, default=20_000)
    ap.add_argument("--dir", default="/tmp/nvdcp-phase-probe")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--stock", action="store_true", help="also time stock FileSystemWriter/Reader per repeat")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the run (seconds; Python's default is 0.005)")
    ap.add_argument("--thread-count", type=int, default=None, help="NvcompWriter/Reader thread_count (default: theirs)")
    ap.add_argument("--timeline", action="store_true",
                    help="then one save and one load under torch.profiler with CUDA activities (GPU busy time, "
                         "CUDA runtime calls per thread, kernels)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    state = {k: v.to(args.device) for k, v in small_state(args.count).items()}
    knobs = {"thread_count": args.thread_count} if args.thread_count is not None else {}
    timers = Timers()
    missing = install(timers)
    runs = []
    for rep in range(args.repeats):
        timers.rows.clear()
        shutil.rmtree(args.dir, ignore_errors=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        dcp.save(state, storage_writer=nvdcp.NvcompWriter(args.dir, on_identical_save="ignore", **knobs))
        save_s, save_cpu = time.perf_counter() - t0, time.process_time() - c0
        save_rows = {k: list(v) for k, v in timers.rows.items()}
        timers.rows.clear()
        out = zeros_like_state(state)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        dcp.load(out, storage_reader=nvdcp.NvcompReader(args.dir, **knobs))
        if args.device == "cuda":
            torch.cuda.synchronize()
        load_s, load_cpu = time.perf_counter() - t0, time.process_time() - c0
        assert states_equal(state, out), "load differs from the state saved"
        run: dict[str, Any] = {"save_s": save_s, "load_s": load_s, "save_cpu_s": save_cpu, "load_cpu_s": load_cpu,
               "save": save_rows, "load": {k: list(v) for k, v in timers.rows.items()}}
        if args.stock:
            run["stock_save_s"], run["stock_load_s"] = stock_times(state, args.dir + "-stock", args.device)
        runs.append(run)
        print(f"repeat {rep}: save {save_s:.3f} s (process CPU {save_cpu:.3f} s), "
              f"load {load_s:.3f} s (process CPU {load_cpu:.3f} s)"
              + (f" (stock {run['stock_save_s']:.3f} / {run['stock_load_s']:.3f} s)" if args.stock else ""), flush=True)
    last = runs[-1]
    result: dict[str, Any] = {"count": args.count, "device": args.device, "switch_interval": sys.getswitchinterval(),
                              "thread_count": args.thread_count, "save_s": last["save_s"],
                              "load_s": last["load_s"], "save_cpu_s": last["save_cpu_s"],
                              "load_cpu_s": last["load_cpu_s"], "stock_save_s": last.get("stock_save_s"),
                              "stock_load_s": last.get("stock_load_s"), "missing_targets": missing, "phases": {}}
    for op in ("save", "load"):
        rows = sorted(last[op].items(), key=lambda kv: -kv[1][1])
        table = [{"thread": thread, "step": name, "calls": int(calls), "seconds": f"{secs:.3f}",
                  "cpu s": f"{cpu:.3f}", "us/call": f"{secs / calls * 1e6:.1f}"}
                 for (thread, name), (calls, secs, cpu) in rows]
        print(f"\n{op}: {last[op + '_s']:.3f} s wall, {last[op + '_cpu_s']:.3f} s process CPU")
        print(markdown_table(table, ["thread", "step", "calls", "seconds", "cpu s", "us/call"]))
        result["phases"][op] = [{"thread": t, "step": n, "calls": int(c), "seconds": s, "cpu_seconds": u}
                                for (t, n), (c, s, u) in rows]
    if args.timeline and args.device == "cuda":
        result["timeline"] = {op: timeline(state, args.dir, op, knobs) for op in ("save", "load")}
    write_results(f"phase_probe_{args.device}", result, out_dir=args.out)


if __name__ == "__main__":
    main()

"""Wall and CPU time of each step of a save and a load of many small tensors, per thread (a diagnostic).

    python -m benchmarks.phase_probe [--device cuda] [--count 20000] [--dir /dev/shm/pp] [--repeats 2]
        [--stock] [--timeline] [--gc-off] [--gc-freeze]

Why not the stack sampler (``cpu_pipeline_bench --profile``): a sampling thread takes the GIL
every few milliseconds, and on a GIL-bound path its own traffic decides which lines it sees.
Here each listed function (DCP's planner steps, nvdcp's storage methods, the GPU encoder's and
decoder's stages, per-item helpers) is wrapped with a timer: calls, total seconds, microseconds
per call, by thread, with the thread's CPU seconds beside the wall seconds; the process's CPU
time and Python's collector pauses for the whole save and load. Nested functions are counted in their callers too (times are inclusive);
a generator's time is the time spent inside its ``next()`` calls. A timer costs about a
microsecond per call, so per-item rows carry that much overhead. The last repeat is reported
(the first warms caches and the CUDA context); the state is ``cpu_pipeline_bench``'s ``small``.
Prints the table and writes ``benchmarks/results/phase_probe_<date>_<device>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import inspect
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
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
    "nvdcp.dcp.commit:dump_metadata",
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
    "nvdcp.dcp.reader:NvcompReader._read_table",
    "nvdcp.dcp.reader:NvcompReader._decode_devices",
    "nvdcp.dcp.reader:NvcompReader._whole_on_gpu",
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
    "nvdcp.gpu.decoder:GpuDecoder.decode_columns",
    "nvdcp.gpu.decoder:GpuDecoder._plan_columns",
    "nvdcp.gpu.decoder:GpuDecoder._stage_columns",
    "nvdcp.dcp.record_columns:ColumnBatch.add_run",
    "nvdcp.dcp.record_columns:ColumnBatch.columns",
    "nvdcp.pipeline.cpu_batch:parse_records",
    "nvdcp.pipeline.cpu_batch:decode_records",
]


#: ``--gc-off``: the collector paused around each timed dcp.save / dcp.load
GC_OFF = False


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


class CollectorTimer:
    """Seconds Python's cyclic collector ran, and how many collections, per generation
    (``gc.callbacks``): a pause of whichever thread triggered it, counted in that step's times."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self.full: list[dict[str, Any]] = []  # each full collection: seconds, thread, where
        self._started: float | None = None
        self._where = ""

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            if info["generation"] == 2:
                self._where = _caller_in_checkpointing()
        elif self._started is not None:
            spent = time.perf_counter() - self._started
            self.seconds[info["generation"]] += spent
            self.counts[info["generation"]] += 1
            if info["generation"] == 2:
                self.full.append({"seconds": round(spent, 4), "thread": threading.current_thread().name,
                                  "where": self._where})
            self._started = None

    def take(self) -> dict[str, Any]:
        """What was counted since the last take, and start again."""
        out = {"seconds": round(sum(self.seconds), 4), "by_generation_s": [round(x, 4) for x in self.seconds],
               "collections": list(self.counts), "full": self.full}
        self.seconds, self.counts, self.full = [0.0, 0.0, 0.0], [0, 0, 0], []
        return out


def _caller_in_checkpointing() -> str:
    """The innermost frame of nvdcp's or DCP's code on this thread's stack (what allocated when
    the collector started), as ``module:function``."""
    try:
        frame = sys._getframe(2)
    except ValueError:  # called from the interpreter's shutdown, with no Python caller
        return "?"
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(("nvdcp", "torch.distributed.checkpoint")):
            return f"{module}:{frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


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
    with collector_paused(GC_OFF):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    save_s = time.perf_counter() - t0
    out = zeros_like_state(state)
    sync()
    t0 = time.perf_counter()
    with collector_paused(GC_OFF):
        dcp.load(out, storage_reader=dcp.FileSystemReader(path))
    sync()
    load_s = time.perf_counter() - t0
    shutil.rmtree(path, ignore_errors=True)
    return save_s, load_s


@contextlib.contextmanager
def collector_paused(paused: bool) -> Iterator[None]:
    """Python's cyclic collector off for the block when ``paused`` (``--gc-off``: what a training
    loop can do around ``dcp.save``/``dcp.load``; the objects it would have freed are freed by the
    next collection after)."""
    if not paused or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


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
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() once the state is built (what docs/TRAINING.md suggests after setup)")
    ap.add_argument("--gc-off", action="store_true",
                    help="Python's collector off during each dcp.save and dcp.load (nvdcp's and stock's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    global GC_OFF
    GC_OFF = args.gc_off
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    state = {k: v.to(args.device) for k, v in small_state(args.count).items()}
    knobs = {"thread_count": args.thread_count} if args.thread_count is not None else {}
    timers = Timers()
    missing = install(timers)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    collector = CollectorTimer()
    gc.callbacks.append(collector)
    runs = []
    for rep in range(args.repeats):
        timers.rows.clear()
        shutil.rmtree(args.dir, ignore_errors=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        collector.take()
        t0, c0 = time.perf_counter(), time.process_time()
        with collector_paused(GC_OFF):
            dcp.save(state, storage_writer=nvdcp.NvcompWriter(args.dir, on_identical_save="ignore", **knobs))
        save_s, save_cpu = time.perf_counter() - t0, time.process_time() - c0
        save_gc = collector.take()
        save_rows = {k: list(v) for k, v in timers.rows.items()}
        timers.rows.clear()
        out = zeros_like_state(state)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        with collector_paused(GC_OFF):
            dcp.load(out, storage_reader=nvdcp.NvcompReader(args.dir, **knobs))
        if args.device == "cuda":
            torch.cuda.synchronize()
        load_s, load_cpu = time.perf_counter() - t0, time.process_time() - c0
        load_gc = collector.take()
        assert states_equal(state, out), "load differs from the state saved"
        run: dict[str, Any] = {"save_s": save_s, "load_s": load_s, "save_cpu_s": save_cpu, "load_cpu_s": load_cpu,
               "save_gc": save_gc, "load_gc": load_gc,
               "save": save_rows, "load": {k: list(v) for k, v in timers.rows.items()}}
        if args.stock:
            collector.take()
            run["stock_save_s"], run["stock_load_s"] = stock_times(state, args.dir + "-stock", args.device)
            run["stock_gc"] = collector.take()  # save and load together
        runs.append(run)
        print(f"repeat {rep}: save {save_s:.3f} s (process CPU {save_cpu:.3f} s, collector {save_gc['seconds']:.3f} s "
              f"in {sum(save_gc['collections'])}), load {load_s:.3f} s (process CPU {load_cpu:.3f} s, collector "
              f"{load_gc['seconds']:.3f} s in {sum(load_gc['collections'])})"
              + (f" (stock {run['stock_save_s']:.3f} / {run['stock_load_s']:.3f} s, collector "
                 f"{run['stock_gc']['seconds']:.3f} s in {sum(run['stock_gc']['collections'])})" if args.stock else ""),
              flush=True)
    last = runs[-1]
    result: dict[str, Any] = {"count": args.count, "device": args.device, "gc_freeze": args.gc_freeze,
                              "gc_off": args.gc_off, "switch_interval": sys.getswitchinterval(),
                              "thread_count": args.thread_count, "save_s": last["save_s"],
                              "load_s": last["load_s"], "save_cpu_s": last["save_cpu_s"],
                              "load_cpu_s": last["load_cpu_s"], "save_gc": last["save_gc"], "load_gc": last["load_gc"],
                              "stock_gc": last.get("stock_gc"), "stock_save_s": last.get("stock_save_s"),
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

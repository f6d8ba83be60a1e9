"""nvdcp's own host cost on the CPU path against stock DCP, in one run (issue 18, parts 2 and 3).

    python -m benchmarks.cpu_pipeline_bench [--repeats 3] [--cases small,large,demo] [--dir /tmp/nvdcp-cpu-pipeline]
    python -m benchmarks.cpu_pipeline_bench --profile small-load   # stack samples of one nvdcp op
    python -m benchmarks.cpu_pipeline_bench --device cuda --cases small --dir /dev/shm/x   # GPU tensors

Cases (local disk, warm page cache; default arguments for both writers and readers):

- ``small``: 20,000 fp32/bf16 tensors of 4 KiB-1 MiB (~666 MB; sizes 4 KiB x 2^k, k drawn with
  weight 0.6^k, so most are small): per-item cost. Each tensor is a top-level key of the state
  dict, and ``dcp.save`` wraps every top-level key in its method logger (58-79 µs a key on the
  CPU machine, ``benchmarks.dcp_key_cost``), a cost stock and nvdcp share.
- ``small_model``: the same 20,000 tensors under one key (``{"model": ...}``), as training code
  passes a model's ``state_dict()``: the per-item cost without that per-key logging.
- ``moe``: 100,000 fp32/bf16 tensors of 1-64 KiB under one key (~370 MB; sizes 1 KiB x 2^k,
  weight 0.6^k), named like a mixture-of-experts layer's shards: the item count an MoE model
  under FSDP gives each rank (issue 18, part 3), to show the per-item cost stays flat from 20,000
  items to 100,000. Its stock rounds take minutes: run it with ``--repeats 1``.
- ``large``: 268 MB of fp32 in 3 tensors: per-byte cost and the extra RSS of a load.
- ``one_large``: 1 GB of fp32 in one tensor: a single record, whose write can overlap its own
  compression only when it is written as it compresses (no issue target; for A/B runs).
- ``demo``: the state of ``make demo``'s model (GPT d=256, 4 layers, with AdamW moments).

For every case, ``dcp.save`` then ``dcp.load`` (into a preallocated state dict) with torch's
``FileSystemWriter``/``FileSystemReader`` and with ``NvcompWriter``/``NvcompReader``, alternating
within each repeat so machine noise hits both alike. Per op: wall time (median over repeats),
*own* time (wall time inside the storage writer's/reader's methods, less the time they spent in
planner callbacks: what the storage layer itself costs; total minus own is DCP's planning), its
cost per item, ``read_metadata`` time (loads), and the peak RSS above the RSS before the op
(sampled every millisecond; for ``large`` loads, in a fresh process, since this one reuses
memory freed earlier without it showing in RSS). Every load is checked bit-exact. Prints a markdown table and
writes ``benchmarks/results/cpu_pipeline_bench_<date>.json``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

import nvdcp
from benchmarks.common import dir_bytes, fresh_dir, machine, markdown_table, write_results
from benchmarks.workload import states_equal, tensor_bytes, zeros_like_state
from nvdcp.gpu.config import GpuConfig

KiB, MiB = 1 << 10, 1 << 20

TARGETS = {
    "small": {"save_vs_stock": 0.35, "load_vs_stock": 0.35, "own_us_per_item": 30.0, "read_metadata_vs_stock": 1.2},
    "small_model": {"save_vs_stock": 0.35, "load_vs_stock": 0.35, "own_us_per_item": 30.0,
                    "read_metadata_vs_stock": 1.2},
    "moe": {"save_vs_stock": 0.35, "load_vs_stock": 0.35, "own_us_per_item": 30.0, "read_metadata_vs_stock": 1.2},
    "large": {"save_vs_stock": 1.0, "load_vs_stock": 1.2, "load_rss_vs_stock": 1.0},
    "demo": {"load_vs_stock": 1.0},
}


# -- workloads ---------------------------------------------------------------------------------
def small_state(count: int = 20_000, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights = torch.tensor([0.6**k for k in range(9)])  # 4 KiB .. 1 MiB
    ks = torch.multinomial(weights, count, replacement=True, generator=g).tolist()
    state = {}
    for i, k in enumerate(ks):
        nbytes = (4 * KiB) << k
        if i % 4 == 3:
            t = torch.randn(nbytes // 2, generator=g).to(torch.bfloat16)
        else:
            t = torch.randn(nbytes // 4, generator=g)
        state[f"layers.{i // 8}.p{i % 8}"] = t.reshape(-1, 64) if t.numel() >= 128 else t
    return state


def small_model_state(seed: int = 0) -> dict[str, Any]:
    return {"model": small_state(seed=seed)}


def moe_state(count: int = 100_000, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    weights = torch.tensor([0.6**k for k in range(7)])  # 1 KiB .. 64 KiB
    ks = torch.multinomial(weights, count, replacement=True, generator=g).tolist()
    experts: dict[str, torch.Tensor] = {}
    for i, k in enumerate(ks):
        nbytes = KiB << k
        if i % 4 == 3:
            t = torch.randn(nbytes // 2, generator=g).to(torch.bfloat16)
        else:
            t = torch.randn(nbytes // 4, generator=g)
        experts[f"layers.{i // 64}.experts.{(i // 4) % 16}.w{i % 4}"] = t
    return {"model": experts}


def large_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = 268_000_000 // 4 // 3
    return {f"w{i}": torch.randn(n // 1024, 1024, generator=g) for i in range(3)}


def one_large_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(250_000_000 // 1024, 1024, generator=g) * 0.02}


def demo_state() -> dict[str, Any]:
    from nvdcp.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict()}


WORKLOADS: dict[str, Callable[[], dict[str, Any]]] = {
    "small": small_state, "small_model": small_model_state, "moe": moe_state, "large": large_state, "one_large": one_large_state, "demo": demo_state,
}


# -- measuring ---------------------------------------------------------------------------------
class RssPeak:
    """Peak resident set size above the level at ``start``.

    On Linux, the kernel's own high-water mark: ``VmHWM`` reset to the current RSS through
    ``/proc/self/clear_refs`` on entry and read on exit, so nothing runs beside the measured
    operation. Elsewhere (or where clear_refs is refused) a thread samples ``/proc/self/statm``
    every millisecond; it takes the GIL each time, which slowed nvdcp's GIL-sharing threads and
    not stock's single one (CPU machine, 268 MB in 3 tensors: nvdcp's save 0.295 s under the
    sampler, 0.21-0.24 s without it, stock 0.21-0.28 s either way)."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak = 0
        self.base = 0
        self.method = "sampled"

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    @staticmethod
    def _hwm() -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def __enter__(self) -> RssPeak:
        self.base = self.peak = self._rss()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5\n")  # VmHWM := VmRSS
            if self._hwm() is not None:
                self.method = "VmHWM"
                return self
        except OSError:
            pass
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        hwm = self._hwm() if self.method == "VmHWM" else None
        self.peak = max(self.peak, self._rss(), hwm or 0)

    @property
    def extra(self) -> int:
        return self.peak - self.base

    @classmethod
    def method_here(cls) -> str:
        """How peaks are measured on this machine: ``VmHWM`` or ``sampled``."""
        with cls() as probe:
            pass
        return probe.method


_STORAGE_METHODS = ("reset", "set_up_storage_reader", "set_up_storage_writer", "read_metadata",
                    "prepare_local_plan", "prepare_global_plan", "read_data", "write_data", "finish",
                    "storage_meta")
_PLANNER_CALLBACKS = ("resolve_tensor", "commit_tensor", "load_bytes", "resolve_data")


class Clock:
    """Time spent in instrumented methods, by name; nested planner callbacks are subtracted."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.callbacks = 0.0

    def wrap(self, obj: Any, names: tuple[str, ...], callback: bool = False) -> Any:
        for name in names:
            fn = getattr(obj, name, None)
            if fn is not None and callable(fn):
                setattr(obj, name, self._timed(name, fn, callback))
        return obj

    def _timed(self, name: str, fn: Callable[..., Any], callback: bool) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                if callback:
                    self.callbacks += dt
                else:
                    self.seconds[name] = self.seconds.get(name, 0.0) + dt
        return run

    @property
    def own(self) -> float:
        return sum(self.seconds.values()) - self.callbacks


def _writer(kind: str, path: str) -> Any:
    return FileSystemWriter(path) if kind == "stock" else nvdcp.NvcompWriter(path)


#: Where NvcompReader decodes items bound for host memory on a GPU machine (``--decode-device``).
DECODE_DEVICE = "auto"


def _reader(kind: str, path: str) -> Any:
    if kind == "stock":
        return FileSystemReader(path)
    return nvdcp.NvcompReader(path, gpu=GpuConfig(decode_device=DECODE_DEVICE))


def save_once(kind: str, state: dict[str, Any], path: str) -> dict[str, float]:
    fresh_dir(path)
    clock = Clock()
    writer = clock.wrap(_writer(kind, path), _STORAGE_METHODS)
    planner = clock.wrap(DefaultSavePlanner(), _PLANNER_CALLBACKS, callback=True)
    gc.collect()
    with RssPeak() as rss:
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=writer, planner=planner)
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "own_s": clock.own, "rss_extra": rss.extra}


def load_once(kind: str, target: dict[str, Any], path: str) -> dict[str, float]:
    clock = Clock()
    reader = clock.wrap(_reader(kind, path), _STORAGE_METHODS)
    planner = clock.wrap(DefaultLoadPlanner(), _PLANNER_CALLBACKS, callback=True)
    gc.collect()
    with RssPeak() as rss:
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=reader, planner=planner)
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "own_s": clock.own, "read_metadata_s": clock.seconds.get("read_metadata", 0.0),
            "rss_extra": rss.extra}


def _warm(path: str) -> None:
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            while f.read(16 * MiB):
                pass


def measure(case: str, root: str, repeats: int, device: str = "cpu") -> list[dict[str, Any]]:
    state = _to_device(WORKLOADS[case](), device)
    items = sum(1 for _ in _leaves(state))
    paths = {kind: os.path.join(root, f"{case}_{kind}") for kind in ("stock", "nvdcp")}
    targets = {kind: zeros_like_state(state) for kind in paths}
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    exact = dict.fromkeys(paths, True)
    for rep in range(repeats + 1):  # the first round warms imports, pools and pages: not counted
        for kind, path in paths.items():
            saved = save_once(kind, state, path)
            _warm(path)
            loaded = load_once(kind, targets[kind], path)
            exact[kind] &= states_equal(state, targets[kind])
            if rep:
                runs.setdefault((kind, "save"), []).append(saved)
                runs.setdefault((kind, "load"), []).append(loaded)
    rows = []
    raw = tensor_bytes(state)
    fresh_rss = (
        {kind: fresh_load_rss(case, kind, path) for kind, path in paths.items()}
        if case == "large" and device == "cpu" else {}
    )
    for (kind, op), rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        rows.append({
            "case": case, "device": device, "writer": kind, "op": op, "items": items, "raw_bytes": raw,
            "stored_bytes": dir_bytes(paths[kind]), "median_s": med["wall_s"], "min_s": min(r["wall_s"] for r in rs),
            "own_s": med["own_s"], "own_us_per_item": med["own_s"] / items * 1e6,
            "dcp_planning_s": med["wall_s"] - med["own_s"],
            "read_metadata_s": med.get("read_metadata_s"),
            "rss_extra_mib": fresh_rss[kind] if op == "load" and kind in fresh_rss else med["rss_extra"] / MiB,
            "rss_fresh_process": op == "load" and kind in fresh_rss,
            "bit_exact": exact[kind] if op == "load" else None, "runs": rs,
        })
    for row in rows:
        stock = next(r for r in rows if r["writer"] == "stock" and r["op"] == row["op"])
        row["vs_stock"] = row["median_s"] / stock["median_s"]
        row["min_vs_stock"] = row["min_s"] / stock["min_s"]
        if row["read_metadata_s"] is not None and stock["read_metadata_s"]:
            row["read_metadata_vs_stock"] = row["read_metadata_s"] / stock["read_metadata_s"]
        if stock["rss_extra_mib"] > 0:
            row["rss_vs_stock"] = row["rss_extra_mib"] / stock["rss_extra_mib"]
    return rows


def _to_device(state: Any, device: str) -> Any:
    """``state`` with its tensors on ``device`` (``--device cuda``: the same states as GPU
    tensors, saved from and loaded into GPU memory)."""
    if device == "cpu":
        return state
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: _to_device(v, device) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_device(v, device) for v in state]
    return state


def fresh_load_rss(case: str, kind: str, path: str) -> float:
    """Extra RSS (MiB) of one load in a fresh process: in this one, memory freed by earlier
    steps is reused without showing in RSS. The child builds its targets, lets the source state
    go, then loads with the sampler running."""
    import json
    import subprocess
    import sys

    child = subprocess.run(
        [sys.executable, "-m", "benchmarks.cpu_pipeline_bench", "--rss-child", f"{case},{kind},{path}"],
        check=True, capture_output=True, text=True,
    )
    return float(json.loads(child.stdout.strip().splitlines()[-1])["rss_extra_mib"])


def _rss_child(spec: str) -> None:
    import json
    import warnings

    warnings.filterwarnings("ignore")
    case, kind, path = spec.split(",")
    state = WORKLOADS[case]()
    target = zeros_like_state(state)
    del state
    gc.collect()
    result = load_once(kind, target, path)
    print(json.dumps({"rss_extra_mib": result["rss_extra"] / MiB}))


def _leaves(obj: Any) -> Any:
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


def profile(what: str, root: str, device: str, out: str | None) -> None:
    """One nvdcp save or load (``small-load``, ``large-save``...) after an unprofiled one, under
    the stack sampler (every thread, so codec and I/O threads show): prints each thread group's
    top lines and records them in ``cpu_pipeline_profile_<date>_<what>[_<device>].json``."""
    from benchmarks.gpu_pipeline_bench import StackSampler

    case, op = what.split("-")
    state = _to_device(WORKLOADS[case](), device)
    path = os.path.join(root, f"{case}_nvdcp")
    save_once("nvdcp", state, path)
    target = zeros_like_state(state)
    load_once("nvdcp", target, path)
    if op == "save":
        fresh_dir(path)  # the old checkpoint's removal is not the save's: outside the samples
    with StackSampler() as sampler:
        result = save_once("nvdcp", state, path) if op == "save" else load_once("nvdcp", target, path)
    summary = sampler.summary()
    print(f"{what} on {device}: {result['wall_s']:.3f} s (own {result['own_s']:.3f} s)")
    for group, entry in summary["by_thread"].items():
        print(f"\n[{group}] {entry['samples']} samples")
        for where, _n, share in entry["self"][:15]:
            print(f"  {share:6.1%}  {where}")
    target_file = write_results("cpu_pipeline_profile", {
        "machine_note": f"{os.cpu_count()} cores, torch {torch.__version__}, tensors on {device}",
        "what": what, "device": device, "decode_device": DECODE_DEVICE, "result": result, "profile": summary,
    }, out, suffix=f"_{what}" + ("" if device == "cpu" else f"_{device}"))
    print(f"\n-> {target_file}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default="small,large,demo")
    ap.add_argument("--dir", default="/tmp/nvdcp-cpu-pipeline")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--profile", default=None, help="stack-sample one nvdcp op instead: CASE-save or CASE-load")
    ap.add_argument("--decode-device", default="auto", choices=["auto", "cuda", "cpu"],
                    help="NvcompReader's GpuConfig(decode_device=...) on a GPU machine")
    ap.add_argument("--device", default="cpu", help="where the state's tensors live (cpu, or cuda: GPU tensors)")
    ap.add_argument("--no-early-writeback", action="store_true",
                    help="nvdcp data files start no writeback before their fsync (an A/B of "
                         "nvdcp.storage.local.WRITEBACK_BYTES; JSON suffix _no_writeback)")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.no_early_writeback:
        from nvdcp.storage import local

        local.WRITEBACK_BYTES = 1 << 62
    if args.rss_child:
        _rss_child(args.rss_child)
        return
    global DECODE_DEVICE
    DECODE_DEVICE = args.decode_device
    if args.profile:
        profile(args.profile, args.dir, args.device, args.out)
        return
    rows: list[dict[str, Any]] = []
    columns = ["case", "op", "writer", "items", "median_s", "vs_stock", "min_vs_stock", "own_s", "own_us_per_item",
               "dcp_planning_s", "read_metadata_s", "read_metadata_vs_stock", "rss_extra_mib", "rss_vs_stock",
               "bit_exact"]
    for case in args.cases.split(","):
        case_rows = measure(case, args.dir, args.repeats, args.device)
        rows += case_rows
        print(markdown_table(case_rows, columns), flush=True)
    print()
    print(markdown_table(rows, columns))
    load = os.getloadavg()
    target = write_results("cpu_pipeline_bench", {
        "machine_note": f"{os.cpu_count()} cores, torch {torch.__version__}, tensors on {args.device}, storage at "
                        f"{args.dir}, page cache warm; load average at the end {load}",
        "settings": vars(args), "targets": TARGETS, "rows": rows,
        "rss_method": f"peak RSS over the level before each op: {RssPeak.method_here()} "
                      "(VmHWM: the kernel's mark reset via /proc/self/clear_refs; sampled: a 1 ms thread); "
                      "loads' rss_extra_mib from a fresh process where rss_fresh_process",
    }, args.out, suffix=("" if args.device == "cpu" else f"_{args.device}")
       + ("" if args.decode_device == "auto" else f"_decode_{args.decode_device}")
       + ("_no_writeback" if args.no_early_writeback else ""))
    print(f"\n-> {target}  (machine: {machine()})")


if __name__ == "__main__":
    main()

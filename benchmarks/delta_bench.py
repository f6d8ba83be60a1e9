"""Delta checkpoints (issue 15): bytes, save and load time, and memory of delta nvdcp against
full nvdcp and stock DCP, on the reference GPT's training run.

    python -m benchmarks.delta_bench [--device cpu|cuda] [--out DIR] [--root DIR]
        [--intervals 10,100] [--checkpoints 12] [--keep 10] [--ks 4,8,16]
        [--variants fp32_adamw,bf16_weights] [--batch N] [--warm-steps 100] [--lr-total 10000] [--delta-chunk-kib N]
        [--lr-peak 6e-4] [--stock-saves 3] [--load-repeats N] [--verify-all] [--small] [--suffix _cpu]

Workload: the demo's byte-level GPT (nvdcp/demo/model.py) trained with AdamW on the stdlib's
sources in this process, as nvdcp/demo/workload.py does. CUDA: ``GPTConfig.reference()`` (85.6 M
parameters), batch 32 x 512, bf16 autocast, fused AdamW; CPU: ``GPTConfig()`` (3.3 M), batch 4 x
128. The learning rate follows ``lr_at(step, base=--lr-peak, total=--lr-total)``: with the default
10,000 the checkpoints see the peak rate of a long run (a schedule that decayed to zero over the
benchmark's own steps would make deltas look better than they are). Deltas depend mostly on how
much each step moves the weights: at the demo's 6e-4 on weights of |w| ~ 0.014, about 90% of the
bf16 weights change within 10 steps; ``--lr-peak`` explores smaller rates.

One run of ``--warm-steps + max(interval) * (checkpoints - 1)`` steps; for each interval the
chain is the last ``--checkpoints`` states at multiples of that interval (interval 10 reuses the
run's last 110 steps, interval 100 all of it), snapshotted on the training device. Variants:

- ``fp32_adamw``: ``{"model": model.state_dict(), "optim": optim.state_dict()}`` (params and both
  AdamW moments in fp32);
- ``bf16_weights``: ``{name: param.to(torch.bfloat16)}``, weights only.

For each variant and interval the chain is saved, in step order, with

- ``stock``: ``FileSystemWriter`` (its bytes are the baseline, "stock's bytes"; only the first
  ``--stock-saves`` are saved: stock's size does not change along the chain);
- ``nvdcp``: ``NvcompWriter(path)``, every checkpoint whole;
- ``delta K`` (``delta-full K`` with ``--against full``): ``NvcompWriter(path,
  delta=DeltaPolicy(full_every=K, against=...))`` for each K of ``--ks``:
  a whole save every K saves, deltas against the previous save in between;
- ``delta-gpucache K`` (``--gpu-cache-gib G``, CUDA): the same with ``DeltaPolicy(...,
  gpu_cache_bytes=G GiB)``: the last save's bytes kept in GPU memory, not host memory.

Per checkpoint: bytes stored (every file of its folder), save seconds (the device synchronized
before and after), the delta depth from its metadata, the peak host RSS the save added (VmHWM,
reset through /proc/self/clear_refs before each save) and on CUDA the peak of
``torch.cuda.max_memory_allocated`` over what was allocated before the save. Per writer: the
ratio to stock's bytes over the delta saves only (steady state) and over the whole chain (the
periodic whole saves included), the bytes of keeping the last ``--keep`` checkpoints (with the
older checkpoints their deltas need: a delta is useless without its base chain), save time
against a full nvdcp save, and ``policy.cache.used`` (the host copy of the last save a policy
keeps between saves). Loads (``dcp.load`` into freshly allocated state on the training device,
``no_dist=True``): the full nvdcp checkpoint and, for each K, the delta at depth 1 and the
deepest delta of the chain (its load reads the whole chain back to the whole save), each checked
bit for bit against the state that was saved; ``--verify-all`` also loads every checkpoint of
every chain (untimed). Checkpoints go under ``--root`` (default a new temporary folder, removed
afterwards; pass a tmpfs such as /dev/shm/... to time the library rather than the disk); each
chain's folders are removed once measured.

Prints the tables and each issue-15 target with whether it is met, and writes
``delta_bench_<date><suffix>.json`` (date, machine, command) to ``--out`` (default
benchmarks/results). Defaults took 2.3 minutes on the 2-core CPU machine when it was otherwise idle
(7 minutes while other jobs shared its cores; training is most of it: ``--batch 2`` or
``--intervals 10`` shorten it), and should take
about 3 minutes on an H200 with ``--root /dev/shm/...`` (``--ks 8`` or ``--batch 16`` if not).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from benchmarks.common import dir_bytes, fresh_dir, markdown_table, write_results
from benchmarks.workload import states_equal, tensor_bytes, tensors, zeros_like_state
from nvdcp.demo.model import GPT, GPTConfig, batch_for_step, lr_at, stdlib_bytes

MiB = 1 << 20
VARIANTS = ("fp32_adamw", "bf16_weights")
#: issue 15's ratio targets over stock's bytes, per variant and interval (steps)
RATIO_TARGETS = {("fp32_adamw", 100): 1.33, ("fp32_adamw", 10): 1.45,
                 ("bf16_weights", 100): 3.5, ("bf16_weights", 10): 7.0}
SAVE_TARGET = 1.1  # delta save time over a full nvdcp save
LOAD_TARGET = 1.5  # delta load time (its chain included) over a full nvdcp load


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when there is one")
    p.add_argument("--out", default=None, help="folder for the JSON (default benchmarks/results)")
    p.add_argument("--suffix", default=None, help="JSON name suffix (default _cpu / _cuda)")
    p.add_argument("--root", default=None, help="checkpoint folder (default: a new temporary folder)")
    p.add_argument("--intervals", default="10,100", help="steps between checkpoints, comma separated")
    p.add_argument("--checkpoints", type=int, default=12, help="checkpoints per chain")
    p.add_argument("--keep", type=int, default=10, help="'keep the last N checkpoints' retention")
    p.add_argument("--ks", default="4,8,16", help="DeltaPolicy full_every values, comma separated")
    p.add_argument("--against", default="previous", help="DeltaPolicy against= values, comma separated "
                   "(previous: chains; full: every delta against the last full save)")
    p.add_argument("--gpu-cache-gib", type=float, default=0.0,
                   help="also run each K with DeltaPolicy(gpu_cache_bytes=this many GiB) (CUDA; label delta-gpucache)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch", type=int, default=None, help="default 32 on CUDA, 4 on the CPU")
    p.add_argument("--warm-steps", type=int, default=100, help="steps before the first checkpoint")
    p.add_argument("--lr-total", type=int, default=10_000, help="length of the LR schedule (lr_at's total)")
    p.add_argument("--lr-peak", type=float, default=6e-4, help="peak learning rate (lr_at's base; the demo's 6e-4)")
    p.add_argument("--min-gain", type=float, default=0.02, help="DeltaPolicy min_gain")
    p.add_argument("--delta-chunk-kib", type=int, default=None,
                   help="chunk_bytes (KiB) of the writers with a DeltaPolicy (default: the writer's)")
    p.add_argument("--min-item-bytes", type=int, default=None,
                   help="DeltaPolicy min_item_bytes (default: the policy's, 64 KiB unless $NVDCP_DELTA_MIN_ITEM_BYTES)")
    p.add_argument("--stock-saves", type=int, default=3, help="stock saves per chain (its bytes are constant)")
    p.add_argument("--load-repeats", type=int, default=None,
                   help="timed loads per checkpoint, the fastest kept (default 2 on the CPU, 1 on CUDA)")
    p.add_argument("--verify-all", action="store_true", help="also load every checkpoint of every chain")
    p.add_argument("--small", action="store_true", help="tiny model and chains (smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="per variant, one more delta save and load (against the checkpoint --profile-gap "
                        "steps earlier) and a full save and load of the same state, each under a stack "
                        "sampler, with each one's phase times (JSON: profiles); with --gpu-cache-gib, "
                        "its delta policies keep the base on the GPU")
    p.add_argument("--profile-gap", type=int, default=10, help="steps between the two states --profile uses")
    p.add_argument("--cuda-trace", action="store_true",
                   help="with --profile on CUDA: the delta and full saves once more under torch.profiler, "
                        "summed per stream, copy direction and kernel (JSON: profiles.<variant>.*_trace)")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    args.interval_list = sorted({int(x) for x in args.intervals.split(",") if x})
    args.k_list = [int(x) for x in args.ks.split(",") if x]
    args.against_list = [x for x in args.against.split(",") if x]
    if not set(args.against_list) <= {"previous", "full"}:
        raise SystemExit(f"--against: previous and/or full, got {args.against!r}")
    args.variant_list = [v for v in args.variants.split(",") if v]
    for v in args.variant_list:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r} (have {', '.join(VARIANTS)})")
    if args.small:
        args.cfg = GPTConfig(d_model=64, n_layers=2, n_heads=2, context=32)
        args.batch = args.batch or 2
    else:
        args.cfg = GPTConfig.reference() if args.device == "cuda" else GPTConfig()
        args.batch = args.batch or (32 if args.device == "cuda" else 4)
    if args.load_repeats is None:
        args.load_repeats = 1 if args.device == "cuda" else 2
    if args.suffix is None:
        args.suffix = "_" + args.device
    if args.checkpoints < 2:
        p.error("--checkpoints must be >= 2")
    return args


# -- training and snapshots --------------------------------------------------------------------
def clone_state(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_state(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_state(v) for v in obj)
    return obj


def train(args: argparse.Namespace) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """Train, snapshotting the fp32 state at every step a chain needs: ``{step: state}``."""
    device, cfg = args.device, args.cfg
    last = args.warm_steps + max(args.interval_list) * (args.checkpoints - 1)
    wanted = {last - i * k for i in range(args.checkpoints) for k in args.interval_list}
    if getattr(args, "profile", False):
        wanted.add(last - args.profile_gap)
        if getattr(args, "cuda_trace", False):
            wanted.update({last - 2 * args.profile_gap, last - 3 * args.profile_gap})
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    cuda = device == "cuda"
    optim = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, fused=cuda)
    data = stdlib_bytes(32 << 20)
    snaps: dict[int, dict[str, Any]] = {}
    t0 = time.perf_counter()
    loss = torch.tensor(0.0)
    for step in range(1, last + 1):
        x, y = batch_for_step(data, step, 0, 1, args.batch, cfg.context, args.seed)
        x, y = x.to(device), y.to(device)
        for g in optim.param_groups:
            g["lr"] = lr_at(step, base=args.lr_peak, total=args.lr_total)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=cuda):
            loss = model(x, y)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if step in wanted:  # the state after `step` optimizer steps
            snaps[step] = clone_state({"model": model.state_dict(), "optim": optim.state_dict()})
    sync(device)
    info = {"config": vars(cfg), "batch": args.batch, "steps": last, "final_loss": round(float(loss.detach()), 4),
            "train_s": round(time.perf_counter() - t0, 2), "snapshots": len(snaps),
            "params": sum(p.numel() for p in model.parameters())}
    return snaps, info


def variant_state(name: str, snap: dict[str, Any]) -> dict[str, Any]:
    if name == "fp32_adamw":
        return snap
    return {k: v.to(torch.bfloat16) for k, v in snap["model"].items()}


# -- measuring ---------------------------------------------------------------------------------
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field_name}:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


@dataclass
class Probe:
    """Host peak RSS and (CUDA) allocator peak added by one operation."""

    device: str
    host_peak_added: int | None = None
    host_retained: int | None = None
    gpu_peak_added: int | None = None
    _rss0: int | None = None
    _gpu0: int = 0

    def __enter__(self) -> Probe:
        sync(self.device)
        self._rss0 = _status_kib("VmRSS") if _reset_hwm() else None
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            self._gpu0 = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc: Any) -> None:
        sync(self.device)
        hwm, rss = _status_kib("VmHWM"), _status_kib("VmRSS")
        if self._rss0 is not None and hwm is not None and rss is not None:
            self.host_peak_added = (hwm - self._rss0) * 1024
            self.host_retained = (rss - self._rss0) * 1024
        if self.device == "cuda":
            self.gpu_peak_added = torch.cuda.max_memory_allocated() - self._gpu0


@dataclass
class Ckpt:
    index: int
    step: int
    path: str
    bytes: int
    save_s: float
    depth: int  # 0: whole
    base: str | None
    host_peak_added: int | None
    host_retained: int | None
    gpu_peak_added: int | None

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "path"}


@dataclass
class Chain:
    writer: str
    k: int | None
    ckpts: list[Ckpt] = field(default_factory=list)
    cache_used: int | None = None
    loads: list[dict[str, Any]] = field(default_factory=list)


def save_one(state: dict[str, Any], path: str, writer: Any, device: str) -> tuple[float, Probe]:
    probe = Probe(device)
    gc.collect()  # outside the timing: see benchmarks.common.timed
    with probe:
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=writer, no_dist=True)
        sync(device)
        seconds = time.perf_counter() - t0
    return seconds, probe


def delta_record(path: str) -> dict[str, Any] | None:
    md = nvdcp.NvcompReader(path).read_metadata()
    rec = getattr(md, "nvdcp_delta", None)
    return rec if isinstance(rec, dict) else None


def delta_writer_options(args: argparse.Namespace, policy: Any) -> dict[str, Any]:
    """``NvcompWriter`` keywords of a writer with ``policy`` (none without one): ``chunk_bytes``
    from ``--delta-chunk-kib`` when given."""
    if policy is None or args.delta_chunk_kib is None:
        return {}
    return {"chunk_bytes": args.delta_chunk_kib << 10}


def run_chain(name: str, k: int | None, states: list[tuple[int, dict[str, Any]]], folder: str,
              args: argparse.Namespace) -> Chain:
    chain = Chain(name, k)
    against = "full" if name.startswith("delta-full") else "previous"
    gpu_cache = int(args.gpu_cache_gib * (1 << 30)) if name.startswith("delta-gpucache") else 0
    policy = nvdcp.DeltaPolicy(full_every=k, min_gain=args.min_gain, against=against, min_item_bytes=args.min_item_bytes,
                               gpu_cache_bytes=gpu_cache) if k is not None else None
    for i, (step, state) in enumerate(states):
        path = os.path.join(folder, f"ckpt_{i:02d}_step{step}")
        if name == "stock":
            writer: Any = dcp.FileSystemWriter(path)
        else:
            writer = nvdcp.NvcompWriter(path, delta=policy, **delta_writer_options(args, policy))
        seconds, probe = save_one(state, path, writer, args.device)
        rec = delta_record(path) if name != "stock" else None
        chain.ckpts.append(Ckpt(i, step, path, dir_bytes(path), seconds, int(rec["depth"]) if rec else 0,
                                rec.get("base") if rec else None, probe.host_peak_added, probe.host_retained,
                                probe.gpu_peak_added))
    if policy is not None:
        chain.cache_used = policy.cache.used
        policy.forget()  # frees the cache before the next chain
    return chain


def timed_load(path: str, expected: dict[str, Any], stock: bool, args: argparse.Namespace) -> dict[str, Any]:
    best, exact, probe = float("inf"), True, Probe(args.device)
    for _ in range(max(1, args.load_repeats)):
        dest = zeros_like_state(expected)
        reader: Any = dcp.FileSystemReader(path) if stock else nvdcp.NvcompReader(path)
        gc.collect()
        with probe:
            t0 = time.perf_counter()
            dcp.load(dest, storage_reader=reader, no_dist=True)
            sync(args.device)
            best = min(best, time.perf_counter() - t0)
        exact = exact and states_equal(dest, expected)
        del dest
    return {"load_s": best, "bit_exact": exact, "host_peak_added": probe.host_peak_added,
            "gpu_peak_added": probe.gpu_peak_added}


def retained(chain: Chain, keep: int) -> tuple[int, int]:
    """Bytes and count of the checkpoints kept to keep the last ``keep`` loadable."""
    by_path = {c.path: c for c in chain.ckpts}
    need = {c.index for c in chain.ckpts[-keep:]}
    todo = list(chain.ckpts[-keep:])
    while todo:
        c = todo.pop()
        if c.base is not None:
            base = by_path.get(c.base) or next((b for b in chain.ckpts if os.path.samefile(b.path, c.base)), None)
            if base is None:
                raise RuntimeError(f"{c.path}: base {c.base} is not in the chain")
            if base.index not in need:
                need.add(base.index)
                todo.append(base)
    return sum(chain.ckpts[i].bytes for i in need), len(need)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _max(xs: list[int | None]) -> int | None:
    vals = [x for x in xs if x is not None]
    return max(vals) if vals else None


def profile_delta(variant: str, base_state: dict[str, Any], state: dict[str, Any], root: str,
                  args: argparse.Namespace, earlier: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One delta save and load of ``state`` against ``base_state``'s checkpoint and a full save
    and load of ``state``, each after an unprofiled warm-up, under a stack sampler: where the
    delta's extra time goes."""
    from benchmarks.gpu_pipeline_bench import StackSampler

    folder = fresh_dir(os.path.join(root, f"profile_{variant}"))
    out: dict[str, Any] = {}

    def run(label: str, fn: Any, owner: Any) -> None:
        sync(args.device)
        with StackSampler() as sampler:
            t0 = time.perf_counter()
            fn()
            sync(args.device)
            seconds = time.perf_counter() - t0
        report = getattr(owner, "last_report", None)
        out[label] = {"s": round(seconds, 4), "phases": report.as_dict() if report is not None else None,
                      "profile": sampler.summary()}
        print(f"  [profile {variant}] {label}: {seconds:.3f} s", flush=True)

    for attempt in ("warm", "timed"):
        policy = nvdcp.DeltaPolicy(full_every=8, min_gain=args.min_gain, min_item_bytes=args.min_item_bytes,
                                   gpu_cache_bytes=_gpu_cache_bytes(args))
        base = os.path.join(folder, f"{attempt}_base")
        options = delta_writer_options(args, policy)
        dcp.save(base_state, storage_writer=nvdcp.NvcompWriter(base, delta=policy, **options), no_dist=True)
        delta, full = os.path.join(folder, f"{attempt}_delta"), os.path.join(folder, f"{attempt}_full")
        writers = (nvdcp.NvcompWriter(delta, delta=policy, **options), nvdcp.NvcompWriter(full))
        if attempt == "warm":
            for w in writers:
                dcp.save(state, storage_writer=w, no_dist=True)
            for path in (delta, full):
                dcp.load(zeros_like_state(state), storage_reader=nvdcp.NvcompReader(path), no_dist=True)
            continue
        run("delta_save", lambda: dcp.save(state, storage_writer=writers[0], no_dist=True), writers[0])
        run("full_save", lambda: dcp.save(state, storage_writer=writers[1], no_dist=True), writers[1])
        if earlier and args.device == "cuda":
            from benchmarks.cuda_timeline import cuda_timeline

            # A fresh chain of saves --profile-gap apart: a full save, a first delta (it tries
            # every item), a delta as a chain's later saves run (items whose deltas did not pay
            # stored whole without a try: stack-sampled), and one more such delta, traced.
            trace_policy = nvdcp.DeltaPolicy(full_every=8, min_gain=args.min_gain, min_item_bytes=args.min_item_bytes,
                                             gpu_cache_bytes=_gpu_cache_bytes(args))
            for i, prior in enumerate(earlier):
                dcp.save(prior, storage_writer=nvdcp.NvcompWriter(os.path.join(folder, f"trace_{i}"),
                                                                  delta=trace_policy, **options), no_dist=True)
            steady = nvdcp.NvcompWriter(os.path.join(folder, "steady_delta"), delta=trace_policy, **options)
            run("steady_delta_save", lambda: dcp.save(base_state, storage_writer=steady, no_dist=True), steady)
            traced = (("delta_save_trace", nvdcp.NvcompWriter(os.path.join(folder, "trace_delta"), delta=trace_policy,
                                                              **options)),
                      ("full_save_trace", nvdcp.NvcompWriter(os.path.join(folder, "trace_full"))))
            for label, w in traced:
                out[label] = cuda_timeline(lambda w=w: dcp.save(state, storage_writer=w, no_dist=True))
                print(f"  [profile {variant}] {label}: {out[label]}", flush=True)
            trace_policy.forget()
        for label, path in (("delta_load", delta), ("full_load", full)):
            reader = nvdcp.NvcompReader(path)
            dest = zeros_like_state(state)
            run(label, lambda: dcp.load(dest, storage_reader=reader, no_dist=True), reader)
            out[label]["bit_exact"] = states_equal(dest, state)
        policy.forget()
    shutil.rmtree(folder, ignore_errors=True)
    return out


def _gpu_cache_bytes(args: argparse.Namespace) -> int:
    """The profiles' DeltaPolicy(gpu_cache_bytes=...): ``--gpu-cache-gib`` on CUDA, else 0."""
    return int(args.gpu_cache_gib * (1 << 30)) if args.device == "cuda" else 0


def run_combo(variant: str, interval: int, states: list[tuple[int, dict[str, Any]]], root: str,
              args: argparse.Namespace) -> dict[str, Any]:
    folder = fresh_dir(os.path.join(root, f"{variant}_every{interval}"))
    label = f"{variant} every {interval}"
    print(f"[{label}] steps {states[0][0]}..{states[-1][0]}", flush=True)
    n_stock = max(1, min(args.stock_saves, len(states)))
    stock = run_chain("stock", None, states[:n_stock], os.path.join(folder, "stock"), args)
    stock_bytes = statistics.mean(c.bytes for c in stock.ckpts)
    last = len(states) - 1
    stock.loads.append({"what": "stock", "index": n_stock - 1, "depth": 0,
                        **timed_load(stock.ckpts[-1].path, states[n_stock - 1][1], True, args)})
    full = run_chain("nvdcp", None, states, os.path.join(folder, "nvdcp"), args)
    full_loads: dict[int, dict[str, Any]] = {}

    def full_load(index: int) -> dict[str, Any]:
        if index not in full_loads:
            full_loads[index] = {"what": "full", "index": index, "depth": 0,
                                 **timed_load(full.ckpts[index].path, states[index][1], False, args)}
        return full_loads[index]

    full_load(last)
    chains = [stock, full]
    kinds = [("delta" if against == "previous" else "delta-full", k) for against in args.against_list for k in args.k_list]
    if args.gpu_cache_gib > 0 and args.device == "cuda":
        kinds += [("delta-gpucache", k) for k in args.k_list]
    for label, k in kinds:
        chain = run_chain(f"{label} K={k}", k, states, os.path.join(folder, f"{label}_k{k}"), args)
        deltas = [c for c in chain.ckpts if c.depth > 0]
        picks: list[tuple[str, Ckpt]] = []
        if deltas:
            picks.append(("depth 1", next(c for c in deltas if c.depth == 1)))
            deepest = max(deltas, key=lambda c: (c.depth, c.index))
            if deepest.depth > 1:
                picks.append(("deepest", deepest))
        for what, c in picks:
            load = {"what": what, "index": c.index, "depth": c.depth,
                    **timed_load(c.path, states[c.index][1], False, args)}
            load["full_load_s"] = full_load(c.index)["load_s"]
            load["over_full"] = load["load_s"] / load["full_load_s"]
            chain.loads.append(load)
        if args.verify_all:
            for c in chain.ckpts:
                dest = zeros_like_state(states[c.index][1])
                dcp.load(dest, storage_reader=nvdcp.NvcompReader(c.path), no_dist=True)
                if not states_equal(dest, states[c.index][1]):
                    chain.loads.append({"what": "verify", "index": c.index, "depth": c.depth, "bit_exact": False})
                    print(f"  !! {chain.writer}: checkpoint {c.index} (depth {c.depth}) does not load bit-exact")
        shutil.rmtree(os.path.join(folder, f"{label}_k{k}"), ignore_errors=True)
        chains.append(chain)
        print(f"  {chain.writer}: {sum(c.bytes for c in chain.ckpts) / MiB:.1f} MiB in {len(chain.ckpts)} checkpoints",
              flush=True)
    full.loads.extend(full_loads[i] for i in sorted(full_loads))
    shutil.rmtree(folder, ignore_errors=True)
    return summarize(variant, interval, states, chains, stock_bytes, args)


def summarize(variant: str, interval: int, states: list[tuple[int, dict[str, Any]]], chains: list[Chain],
              stock_bytes: float, args: argparse.Namespace) -> dict[str, Any]:
    full = next(c for c in chains if c.writer == "nvdcp")
    full_save = _median([c.save_s for c in full.ckpts])
    full_load_s = {ld["index"]: ld["load_s"] for ld in full.loads}
    keep = min(args.keep, len(states))
    rows = []
    for chain in chains:
        cks = chain.ckpts
        deltas = [c for c in cks if c.depth > 0]
        wholes = [c for c in cks if c.depth == 0]
        mean_all = statistics.mean(c.bytes for c in cks)
        if chain.writer == "stock":
            kept_bytes, kept_n = round(stock_bytes * keep), keep  # stock's size is constant
        else:
            kept_bytes, kept_n = retained(chain, keep)
        row: dict[str, Any] = {
            "variant": variant, "interval": interval, "writer": chain.writer, "k": chain.k,
            "saves": len(cks), "whole": len(wholes), "deltas": len(deltas),
            "MiB_per_ckpt": mean_all / MiB,
            "delta_MiB": statistics.mean(c.bytes for c in deltas) / MiB if deltas else None,
            "ratio_all": stock_bytes / mean_all,
            "ratio_delta": stock_bytes / statistics.mean(c.bytes for c in deltas) if deltas else None,
            f"last{keep}_MiB": kept_bytes / MiB, f"last{keep}_kept": kept_n,
            f"last{keep}_ratio": stock_bytes * keep / kept_bytes,
            "save_s": _median([c.save_s for c in cks]),
            "delta_save_s": _median([c.save_s for c in deltas]),
            "whole_save_s": _median([c.save_s for c in wholes]),
            "host_peak_MiB": _mib(_max([c.host_peak_added for c in cks])),
            "gpu_peak_MiB": _mib(_max([c.gpu_peak_added for c in cks])),
            "cache_MiB": _mib(chain.cache_used),
        }
        if full_save and row["delta_save_s"] is not None:
            row["delta_save_over_full"] = row["delta_save_s"] / full_save
        if full_save and row["whole_save_s"] is not None and chain.k is not None:
            row["whole_save_over_full"] = row["whole_save_s"] / full_save
        for ld in chain.loads:
            if ld["what"] in ("depth 1", "deepest"):
                key = "load_d1" if ld["what"] == "depth 1" else "load_deep"
                row[f"{key}_s"] = ld["load_s"]
                row[f"{key}_over_full"] = ld["load_s"] / full_load_s[ld["index"]]
                if key == "load_deep":
                    row["deep_depth"] = ld["depth"]
        if chain.writer in ("stock", "nvdcp"):
            row["load_s"] = next(ld["load_s"] for ld in chain.loads if ld["index"] == (len(cks) - 1))
        row["bit_exact"] = all(ld.get("bit_exact", True) for ld in chain.loads)
        rows.append(row)
    return {"variant": variant, "interval": interval, "steps": [s for s, _ in states],
            "state_bytes": tensor_bytes(states[0][1]), "stock_bytes": stock_bytes, "rows": rows,
            "chains": [{"writer": c.writer, "k": c.k, "cache_used": c.cache_used,
                        "checkpoints": [ck.row() for ck in c.ckpts], "loads": c.loads} for c in chains]}


def _mib(x: int | None) -> float | None:
    return None if x is None else x / MiB


def warm_up(variant: str, state: dict[str, Any], root: str, args: argparse.Namespace) -> float:
    """One stock save, one full nvdcp save and a delta pair with its load: codecs, pools and (on
    CUDA) kernels are ready before anything is timed."""
    folder = fresh_dir(os.path.join(root, f"warmup_{variant}"))
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(folder, "stock")), no_dist=True)
    dcp.save(state, storage_writer=nvdcp.NvcompWriter(os.path.join(folder, "full")), no_dist=True)
    policy = nvdcp.DeltaPolicy(full_every=2, min_gain=args.min_gain, min_item_bytes=args.min_item_bytes)
    nudged = clone_state(state)
    for t in tensors(nudged):
        if t.is_floating_point() and t.numel():
            t.view(-1)[0] += 1
    for i, s in enumerate((state, nudged)):
        writer = nvdcp.NvcompWriter(os.path.join(folder, f"d{i}"), delta=policy, on_identical_save="ignore",
                                    **delta_writer_options(args, policy))
        dcp.save(s, storage_writer=writer, no_dist=True)
    dest = zeros_like_state(nudged)
    dcp.load(dest, storage_reader=nvdcp.NvcompReader(os.path.join(folder, "d1")), no_dist=True)
    sync(args.device)
    if not states_equal(dest, nudged):
        raise RuntimeError(f"warm-up: the delta checkpoint of {variant} did not load bit-exact")
    policy.forget()
    shutil.rmtree(folder, ignore_errors=True)
    return time.perf_counter() - t0


# -- targets and report ------------------------------------------------------------------------
def targets(combos: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for combo in combos:
        goal = RATIO_TARGETS.get((combo["variant"], combo["interval"]))
        for row in combo["rows"]:
            if row["k"] is None:
                continue
            base = {"variant": combo["variant"], "interval": combo["interval"], "writer": row["writer"], "k": row["k"]}
            if goal is not None:
                for measure in ("ratio_delta", "ratio_all"):
                    if row.get(measure) is not None:
                        out.append({**base, "target": f"{measure} >= {goal}", "value": row[measure],
                                    "met": row[measure] >= goal})
            if row.get("delta_save_over_full") is not None:
                out.append({**base, "target": f"delta save <= {SAVE_TARGET}x full", "value": row["delta_save_over_full"],
                            "met": row["delta_save_over_full"] <= SAVE_TARGET})
            for key, what in (("load_d1_over_full", "depth-1"), ("load_deep_over_full", f"depth-{row.get('deep_depth')}")):
                if row.get(key) is not None:
                    out.append({**base, "target": f"{what} load <= {LOAD_TARGET}x full", "value": row[key],
                                "met": row[key] <= LOAD_TARGET})
    return out


BYTES_COLS = ["variant", "interval", "writer", "whole", "deltas", "MiB_per_ckpt", "delta_MiB", "ratio_delta",
              "ratio_all"]
TIME_COLS = ["variant", "interval", "writer", "save_s", "delta_save_s", "whole_save_s", "delta_save_over_full",
             "load_s", "load_d1_s", "load_d1_over_full", "deep_depth", "load_deep_s", "load_deep_over_full",
             "host_peak_MiB", "gpu_peak_MiB", "cache_MiB", "bit_exact"]


def main(argv: list[str] | None = None) -> Path:
    args = parse(argv)
    # dcp.save/load with no_dist=True warn that torch.distributed is not initialized, every call
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    t_start = time.perf_counter()
    own_root = args.root is None
    root = tempfile.mkdtemp(prefix="nvdcp-delta-bench-") if own_root else fresh_dir(args.root)
    try:
        snaps, train_info = train(args)
        print(f"trained {train_info['steps']} steps ({train_info['params']:,} params, batch {args.batch}, "
              f"{args.device}) in {train_info['train_s']} s, loss {train_info['final_loss']}", flush=True)
        last = max(snaps)
        combos, warm = [], {}
        profiles: dict[str, Any] = {}
        for variant in args.variant_list:
            cache: dict[int, dict[str, Any]] = {}

            def state_at(step: int, variant: str = variant, cache: dict[int, dict[str, Any]] = cache) -> dict[str, Any]:
                if step not in cache:
                    cache[step] = variant_state(variant, snaps[step])
                return cache[step]

            warm[variant] = round(warm_up(variant, state_at(last), root, args), 2)
            if args.profile:
                gap = args.profile_gap
                pre = [state_at(last - 3 * gap), state_at(last - 2 * gap)] if args.cuda_trace else None
                profiles[variant] = profile_delta(variant, state_at(last - gap), state_at(last), root, args, pre)
            for interval in args.interval_list:
                steps = [last - interval * i for i in reversed(range(args.checkpoints))]
                combos.append(run_combo(variant, interval, [(s, state_at(s)) for s in steps], root, args))
            cache.clear()
    finally:
        if own_root:
            shutil.rmtree(root, ignore_errors=True)
    rows = [r for c in combos for r in c["rows"]]
    keep = min(args.keep, args.checkpoints)
    print("\nBytes (ratio = stock's bytes / bytes; ratio_delta: delta saves only, ratio_all: the chain "
          "with its whole saves)")
    print(markdown_table(rows, [*BYTES_COLS, f"last{keep}_kept", f"last{keep}_MiB", f"last{keep}_ratio"]))
    print("\nTime (s, medians; load: fastest of --load-repeats, a delta's includes its chain) and memory "
          "(MiB added at peak by one save)")
    print(markdown_table(rows, TIME_COLS))
    checks = targets(combos)
    print("\nIssue 15 targets")
    print(markdown_table(checks, ["variant", "interval", "writer", "target", "value", "met"]))
    exact = all(r["bit_exact"] for r in rows)
    print(f"\nall timed loads bit-exact: {exact}")
    total_s = time.perf_counter() - t_start
    payload = {
        "benchmark": "delta_bench", "issue": 15, "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "args": {k: v for k, v in vars(args).items() if k != "cfg"},
        "workload": {**train_info, "lr": f"lr_at(step, base={args.lr_peak}, total={args.lr_total})",
                     "variants": {"fp32_adamw": "model.state_dict() + optim.state_dict() (fp32)",
                                  "bf16_weights": "{name: param.to(bfloat16)}"}},
        "warm_up_s": warm, "notes": [
            "stock: FileSystemWriter/FileSystemReader defaults; its bytes are the ratio baseline",
            "lastN_MiB includes the older checkpoints the kept deltas need (their base chain)",
            "host_peak: VmHWM over VmRSS before the save (reset via /proc/self/clear_refs); "
            "gpu_peak: torch.cuda.max_memory_allocated over memory_allocated before the save",
            "cache_MiB: DeltaPolicy.cache.used after the chain (copy of the last save kept between saves: host memory, GPU memory for delta-gpucache)",
        ],
        "rows": rows, "targets": checks, "all_bit_exact": exact, "combos": combos, "total_s": round(total_s, 1),
        "profiles": profiles,
    }
    target = write_results("delta_bench", payload, args.out, suffix=args.suffix)
    print(f"\ntotal {total_s:.0f} s; wrote {target}")
    return target


if __name__ == "__main__":
    main()

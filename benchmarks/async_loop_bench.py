"""What a checkpoint costs the training loop (issue 14): extra step time per checkpoint, nvdcp's
overlapped staging against torch's DefaultStager, in one run.

    python -m benchmarks.async_loop_bench --out DIR [--saves 6] [--every 20] [--dir /tmp/nvdcp-loop-bench]
    python -m benchmarks.async_loop_bench --small --out DIR     # tiny CPU config (smoke test)

Workload: an MLP stack (``--depth`` Linear(width, width) + GELU, default 8 x 4096: 134 M fp32
parameters) trained with AdamW (fused), 1.61 GB of state on the GPU; one process, the default
group and a separate gloo group for checkpoints (as docs/TRAINING.md says). Every ``--every``
steps the loop calls ``dcp.async_save`` (THREAD mode) and, when the answer is an
``AsyncSaveResponse``, waits for ``staging_completion`` after the backward pass, right before
``optimizer.step()`` (torch's zero-overhead recipe). Each step ends with a device synchronize, so
step times include the GPU's work.

Variants (same process, one after the other, same model):

- ``nvdcp``: ``NvcompWriter`` + ``NvcompStager(async_staging=True)``, warmed up with
  ``stager.warm_up(state)`` before the loop (its time is reported as ``warm_up_s``);
- ``nvdcp_cold``: the same without warm-up (the first save pays for buffers and codecs);
- ``default_stager``: ``FileSystemWriter`` + a fresh ``DefaultStager`` per save (pinned memory,
  async staging, non-blocking copies; torch < 2.13 cannot reuse one).

Per variant: the undisturbed median step time (steps before the first save); per save:
``extra_s`` (sum over the steps from the save step up to the next save of step time minus the
undisturbed median: what the checkpoint cost the loop), ``call_s`` (time inside ``async_save``,
the secondary "blocked" column), ``durable_s`` (call to committed checkpoint), the median step
while the upload was running (over the undisturbed median), and peak pinned host memory. The
first save is reported apart from the steady state (median of the others). After the loop the
variant saves once more, overwrites the state in place before waiting, and loads that checkpoint
back bit for bit. Writes ``async_loop_bench_<date>.json`` (with the date, machine and command).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import nvdcp
from benchmarks.common import fresh_dir, markdown_table, write_results
from benchmarks.workload import tensors
from nvdcp.dcp.stager import NvcompStager, _pinned_footprint

MiB = 1 << 20
GB = 1e9


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="folder for the JSON (default benchmarks/results)")
    p.add_argument("--dir", default="/tmp/nvdcp-loop-bench", help="checkpoint root (local disk)")
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--every", type=int, default=20, help="steps between saves")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--warm-steps", type=int, default=30, help="steps before the first save (undisturbed)")
    p.add_argument("--variants", default="nvdcp,default_stager,nvdcp_cold")
    p.add_argument("--thread-count", type=int, default=4)
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() after setup (a recipe: full collections skip the model's objects)")
    p.add_argument("--small", action="store_true", help="tiny CPU config (smoke test)")
    p.add_argument("--suffix", default="", help="appended to the result file's name")
    args = p.parse_args(argv)
    if args.small:
        args.width, args.depth, args.batch, args.saves, args.every, args.warm_steps = 64, 2, 32, 3, 3, 4
    return args


class Loop:
    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(args.depth):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*layers).to(device)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda")
        self.x = torch.randn(args.batch, args.width, device=device)
        self.device = device

    def sync(self) -> None:
        # The training stream only, as a loop's ``loss.item()`` does: a device-wide synchronize
        # would also wait for the checkpoint's side-stream work, which training never waits for.
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def step(self, before_optimizer: Any = None) -> None:
        loss = self.model(self.x).float().pow(2).mean()
        loss.backward()
        if before_optimizer is not None:
            before_optimizer()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in tensors(self.state()))


class _CapturingStager(DefaultStager):
    """DefaultStager that keeps its staging future, to measure the pinned memory it staged into."""

    staged: Future[Any] | Any = None

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        self.staged = super().stage(state_dict, **kwargs)
        return self.staged


def _pinned_of(staged: Any) -> int:
    if isinstance(staged, Future):
        staged = staged.result()
    seen: dict[int, int] = {}
    for t in tensors(staged):
        if t.is_pinned():
            s = t.untyped_storage()
            seen[s.data_ptr()] = _pinned_footprint(s.nbytes())
    return sum(seen.values())


class GcPauses:
    """Garbage-collector pauses (every thread stops for them), from ``gc.callbacks``."""

    def __init__(self, min_s: float = 0.005) -> None:
        self.min_s = min_s
        self.pauses: list[tuple[float, float, int]] = []  # (start, seconds, generation)
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._start = now
        elif now - self._start >= self.min_s:
            self.pauses.append((self._start, now - self._start, int(info.get("generation", -1))))

    def between(self, t0: float, t1: float) -> list[dict[str, Any]]:
        return [{"at_s": round(a - t0, 4), "seconds": round(d, 4), "generation": g}
                for a, d, g in self.pauses if t0 <= a < t1]


GC = GcPauses()


class Variant:
    def __init__(self, name: str, loop: Loop, args: argparse.Namespace, root: str, group: Any) -> None:
        self.name, self.loop, self.args, self.root, self.group = name, loop, args, root, group
        self.stager: NvcompStager | None = None
        self.warm_up_s: float | None = None
        self.pinned_peak = 0
        cuda = loop.device.type == "cuda"
        if name.startswith("nvdcp"):
            self.stager = NvcompStager(async_staging=True, buffer_bytes=8 << 30)
            if name == "nvdcp":
                t0 = time.perf_counter()
                self.stager.warm_up(loop.state())
                loop.sync()
                self.warm_up_s = time.perf_counter() - t0
        self.options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                                      use_non_blocking_copy=cuda)
        self._default: _CapturingStager | None = None

    def save(self, step: int) -> Any:
        path = os.path.join(self.root, self.name, f"step_{step:08d}")
        if self.stager is not None:
            writer: Any = nvdcp.NvcompWriter(path, thread_count=self.args.thread_count)
            return dcp.async_save(self.loop.state(), storage_writer=writer, async_stager=self.stager,
                                  process_group=self.group)
        self._default = _CapturingStager(self.options)  # fresh per save: torch < 2.13 cannot reuse one
        writer = dcp.FileSystemWriter(path, thread_count=self.args.thread_count)
        return dcp.async_save(self.loop.state(), storage_writer=writer, async_stager=self._default,
                              process_group=self.group)

    def after_upload(self) -> None:
        if self.stager is not None:
            b = self.stager._buffers
            pinned = (b.pinned_bytes if b is not None else 0) + self.stager.encoder.pinned.peak
        else:
            assert self._default is not None
            pinned = _pinned_of(self._default.staged)
            self._default.close()
            self._default = None
        self.pinned_peak = max(self.pinned_peak, pinned)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def run_variant(name: str, loop: Loop, args: argparse.Namespace, root: str, group: Any) -> dict[str, Any]:
    variant = Variant(name, loop, args, root, group)
    times: list[float] = []
    gc_before = [g["collections"] for g in gc.get_stats()]
    for _ in range(args.warm_steps):
        t0 = time.perf_counter()
        loop.step()
        loop.sync()
        times.append(time.perf_counter() - t0)
    base = statistics.median(times[len(times) // 3:])
    # Collections per generation over ``every`` undisturbed steps: what the loop alone sets off.
    base_gc = [round((g["collections"] - b) * args.every / args.warm_steps, 2) for g, b in zip(gc.get_stats(), gc_before)]
    saves: list[dict[str, Any]] = []
    for k in range(args.saves):
        rec: dict[str, Any] = {}
        step_times: list[float] = []
        uploading: list[float] = []
        done_at: list[float] = []
        collections_before = [g["collections"] for g in gc.get_stats()]
        t_call = time.perf_counter()
        response = variant.save(k)
        rec["call_s"] = time.perf_counter() - t_call
        upload = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        upload.add_done_callback(lambda _f: done_at.append(time.perf_counter()))
        staging = response.staging_completion if isinstance(response, AsyncSaveResponse) else None
        staging_wait = 0.0
        host_times: list[float] = []
        for i in range(args.every):
            t0 = t_call if i == 0 else time.perf_counter()
            running = not upload.done()

            def wait_staging() -> None:
                nonlocal staging_wait
                if staging is not None and not staging.done():
                    w0 = time.perf_counter()
                    staging.result()
                    staging_wait += time.perf_counter() - w0

            loop.step(wait_staging if i == 0 else None)
            host_times.append(time.perf_counter() - t0)  # until the step's kernels were queued
            loop.sync()
            dt = time.perf_counter() - t0
            step_times.append(dt)
            if running and i > 0:
                uploading.append(dt)
        upload.result()
        if staging is not None:
            staging.result()
        variant.after_upload()
        rec["extra_s"] = sum(step_times) - base * len(step_times)
        rec["step_s"] = [round(t, 4) for t in step_times]
        rec["step_host_s"] = [round(t, 4) for t in host_times]
        rec["gc_pauses"] = GC.between(t_call, time.perf_counter())
        rec["gc_collections"] = [g["collections"] - b for g, b in zip(gc.get_stats(), collections_before)]
        rec["staging_wait_s"] = staging_wait
        rec["durable_s"] = (done_at[0] if done_at else time.perf_counter()) - t_call
        rec["upload_steps"] = len(uploading)
        rec["upload_median_over_base"] = statistics.median(uploading) / base if uploading else None
        if variant.stager is not None and variant.stager.last_stats is not None:
            st = variant.stager.last_stats
            rec.update(snapshot_s=st.snapshot_seconds, background_s=st.background_seconds, stage_call_s=st.seconds,
                       grown_bytes=st.grown_bytes, staged_bytes=st.staged_bytes, sync_shards=st.sync_shards)
        saves.append(rec)
        worst = max(range(len(step_times)), key=step_times.__getitem__)
        print(f"  {name} save {k}: extra {rec['extra_s']:.3f}s call {rec['call_s']:.3f}s "
              f"durable {rec['durable_s']:.3f}s upload-median x{rec['upload_median_over_base'] or 0:.3f}; "
              f"worst step {worst} {step_times[worst]:.3f}s (host {host_times[worst]:.3f}s); "
              f"gc pauses {[(p['at_s'], p['seconds'], p['generation']) for p in rec['gc_pauses']]}", flush=True)
    exact = verify(variant, loop)
    host_stats = _host_allocator_bytes()
    variant.close()
    gb = loop.state_bytes() / GB
    rest = saves[1:] or saves
    steady = statistics.median(r["extra_s"] for r in rest)
    upload_ratios = [r["upload_median_over_base"] for r in rest if r["upload_median_over_base"] is not None]
    return {
        "variant": name, "state_GB": gb, "base_step_s": base, "warm_up_s": variant.warm_up_s,
        "first_extra_s": saves[0]["extra_s"], "first_extra_s_per_GB": saves[0]["extra_s"] / gb,
        "steady_extra_s": steady, "steady_extra_s_per_GB": steady / gb,
        "first_call_s": saves[0]["call_s"], "steady_call_s": statistics.median(r["call_s"] for r in rest),
        "steady_durable_s": statistics.median(r["durable_s"] for r in rest),
        "upload_median_over_base": statistics.median(upload_ratios) if upload_ratios else None,
        "peak_pinned_MiB": variant.pinned_peak / MiB, "bit_exact": exact,
        "steady_staged_MiB": statistics.median(r["staged_bytes"] for r in rest) / MiB if "staged_bytes" in rest[0] else None,
        "checkpoint_MiB": _checkpoint_bytes(variant) / MiB,
        "gc_pauses_per_save": sum(len(r["gc_pauses"]) for r in saves) / len(saves),
        "gc_collections_per_interval_undisturbed": base_gc,
        "host_allocator": host_stats, "saves": saves,
    }


def _host_allocator_bytes() -> dict[str, int]:
    """torch's pinned host allocator counters (bytes), where this torch has them."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return {}
    try:
        return {k: int(v) for k, v in stats().items() if "bytes" in k}
    except Exception:  # older torch: not implemented for this build
        return {}


def _checkpoint_bytes(variant: Variant) -> int:
    """Bytes of the first save's checkpoint (data files and .metadata)."""
    from benchmarks.common import dir_bytes

    return dir_bytes(os.path.join(variant.root, variant.name, f"step_{0:08d}"))


def verify(variant: Variant, loop: Loop) -> bool:
    """One more save; the state is overwritten in place before the staging wait (nvdcp's stager
    has its copy by then), or right after it for torch's DefaultStager, whose contract asks the
    caller to leave the state alone until ``staging_completion``: it copies in a background
    thread, and a change before that is a torn checkpoint, not a measurement (it made this check
    fail now and then in CI on the CPU config); load it back."""
    want = {k: v.detach().clone() for k, v in loop.model.state_dict().items()}
    response = variant.save(10_000)
    if variant.stager is None and isinstance(response, AsyncSaveResponse):
        response.staging_completion.result()
    with torch.no_grad():
        for p in loop.model.parameters():
            p.mul_(-2.0)
    if isinstance(response, AsyncSaveResponse):
        response.staging_completion.result()
        response.upload_completion.result()
    else:
        response.result()
    variant.after_upload()
    path = os.path.join(variant.root, variant.name, f"step_{10_000:08d}")
    got = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    reader: Any = nvdcp.NvcompReader(path) if variant.stager is not None else dcp.FileSystemReader(path)
    dcp.load(got, storage_reader=reader)
    with torch.no_grad():
        for p in loop.model.parameters():
            p.div_(-2.0)  # exact: a power of two
    return all(torch.equal(got["model"][k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.small:
        print("async_loop_bench measures GPU staging and needs a CUDA GPU (with nvidia-nvcomp-cu12); "
              "use --small for the tiny CPU smoke config", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if cuda and not args.small else torch.device("cpu")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    group = dist.new_group(backend="gloo")
    root = fresh_dir(args.dir)
    loop = Loop(args, device)
    for _ in range(3):
        loop.step()
    loop.sync()
    if GC not in gc.callbacks:
        gc.callbacks.append(GC)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    print(f"state {loop.state_bytes() / GB:.2f} GB on {device}; saves every {args.every} steps", flush=True)
    rows = [run_variant(name, loop, args, root, group) for name in args.variants.split(",")]
    by = {r["variant"]: r for r in rows}
    if "nvdcp" in by and "default_stager" in by and by["default_stager"]["steady_extra_s"] > 0:
        by["nvdcp"]["vs_default_stager"] = by["nvdcp"]["steady_extra_s"] / by["default_stager"]["steady_extra_s"]
    cols = ["variant", "state_GB", "base_step_s", "warm_up_s", "first_extra_s", "steady_extra_s",
            "steady_extra_s_per_GB", "first_call_s", "steady_call_s", "steady_durable_s", "upload_median_over_base",
            "peak_pinned_MiB", "checkpoint_MiB", "gc_pauses_per_save", "bit_exact"]
    print(markdown_table(rows, cols))
    extra: dict[str, Any] = {"torch": torch.__version__, "device": str(device), "args": vars(args),
                             "NVDCP_SWITCH_INTERVAL": os.environ.get("NVDCP_SWITCH_INTERVAL")}
    if cuda:
        extra["gpu"] = torch.cuda.get_device_name(0)
        extra["stream_priority_range"] = torch.cuda.Stream.priority_range()
    path = write_results("async_loop_bench", {**extra, "results": rows}, args.out, suffix=args.suffix)
    print(f"wrote {path}")
    dist.destroy_process_group()
    return 0 if all(r["bit_exact"] for r in rows) else 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())

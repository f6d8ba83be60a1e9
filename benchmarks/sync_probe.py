"""Which calls on the checkpoint path wait for the training stream (issue 14's step spikes).

    python -m benchmarks.sync_probe --out DIR [--sleep-s 0.5]

A CUDA call that synchronizes the device (``cudaFree``, ``cudaHostAlloc``, a synchronous copy)
made by the background of an overlapped save waits for every kernel queued by training, and
while it waits it may hold the GIL or the driver's lock: the loop stalls. This probe queues a
``--sleep-s`` busy kernel on the current stream before each call and times the call; a call that
takes about the sleep waited for it.

1. Single calls made by the stager and the encoder (allocation, memory queries, streams, events,
   pinned memory, an nvCOMP encode and the release of its result).
2. The background of an overlapped save: a warmed-up ``NvcompStager(async_staging=True)`` stages
   a 1 GB state, a busy kernel is queued right after the call, and the time until the records
   are finished is compared with the same save without the busy kernel. A profile hook on the
   stager's threads lists every call that took longer than ``--slow-s``.
3. The same for a whole ``dcp.async_save`` (staging, upload and commit threads).

Writes ``sync_probe_<date>.json`` (date, machine, command).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import write_results

MiB = 1 << 20


def busy(seconds: float) -> None:
    """Queue about ``seconds`` of a one-block kernel on the current stream."""
    torch.cuda._sleep(int(seconds * _CYCLES_PER_S))


def _cycles_per_second() -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(200_000_000)
    torch.cuda.synchronize()
    return 200_000_000 / (time.perf_counter() - t0)


_CYCLES_PER_S = 1.4e9


def time_behind_busy(fn: Callable[[], Any], sleep_s: float) -> tuple[float, float]:
    """(seconds the call took with the stream busy, seconds until the stream was idle)."""
    torch.cuda.synchronize()
    busy(sleep_s)
    t0 = time.perf_counter()
    fn()
    call = time.perf_counter() - t0
    torch.cuda.synchronize()
    return call, time.perf_counter() - t0


class SlowCalls:
    """A profile hook on every thread (Python 3.12+; before: threads started while it is
    installed) that records calls slower than ``slow_s``."""

    def __init__(self, slow_s: float) -> None:
        self.slow_s = slow_s
        self.found: list[dict[str, Any]] = []
        self._stacks: dict[int, list[tuple[str, float]]] = {}
        self._lock = threading.Lock()

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        tid = threading.get_ident()
        stack = self._stacks.setdefault(tid, [])
        now = time.perf_counter()
        if event == "call":
            stack.append((f"{frame.f_code.co_qualname} ({os.path.basename(frame.f_code.co_filename)}:"
                          f"{frame.f_lineno})", now))
        elif event == "c_call":
            stack.append((f"C {getattr(arg, '__qualname__', repr(arg))} (from {frame.f_code.co_qualname}:"
                          f"{frame.f_lineno})", now))
        elif event in ("return", "c_return", "c_exception") and stack:
            name, t0 = stack.pop()
            if now - t0 >= self.slow_s:
                with self._lock:
                    self.found.append({"thread": threading.current_thread().name, "call": name,
                                       "seconds": round(now - t0, 4), "depth": len(stack)})

    def __enter__(self) -> SlowCalls:
        # Python 3.12+: every running thread too (the stager's pool already exists after warm-up).
        getattr(threading, "setprofile_all_threads", threading.setprofile)(self.hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        getattr(threading, "setprofile_all_threads", threading.setprofile)(None)


def single_calls(sleep_s: float) -> list[dict[str, Any]]:
    import nvidia.nvcomp as nv

    dev = torch.device("cuda", 0)
    rows: list[dict[str, Any]] = []
    keep: list[Any] = []

    def row(name: str, fn: Callable[[], Any]) -> None:
        call, idle = time_behind_busy(fn, sleep_s)
        rows.append({"call": name, "call_s": round(call, 4), "waited": call > 0.5 * sleep_s})
        print(f"  {name:55s} {call:8.4f} s {'WAITED' if call > 0.5 * sleep_s else ''}", flush=True)

    row("torch.cuda.mem_get_info", lambda: torch.cuda.mem_get_info(dev))
    row("torch.cuda.memory_reserved/allocated", lambda: (torch.cuda.memory_reserved(dev), torch.cuda.memory_allocated(dev)))
    row("torch.empty 1 GiB device (new segment)", lambda: keep.append(torch.empty(1 << 30, dtype=torch.uint8, device=dev)))
    keep.clear()
    row("torch.empty 1 GiB device (cached)", lambda: keep.append(torch.empty(1 << 30, dtype=torch.uint8, device=dev)))
    keep.clear()
    row("torch.cuda.Stream(priority=0)", lambda: keep.append(torch.cuda.Stream(dev, priority=0)))
    row("torch.cuda.Event() + record", lambda: torch.cuda.Event().record())
    row("torch.empty 8 MiB pinned (new)", lambda: keep.append(torch.empty(8 * MiB + 4096, dtype=torch.uint8, pin_memory=True)))
    keep.clear()
    gc.collect()
    row("torch.empty 8 MiB pinned (cached)", lambda: keep.append(torch.empty(8 * MiB + 4096, dtype=torch.uint8, pin_memory=True)))
    side = torch.cuda.Stream(dev, priority=0)
    chunk = 1 << 16
    n = 256
    codec = nv.Codec(algorithm="GDeflate", bitstream_kind=nv.BitstreamKind.RAW, uncomp_chunk_size=chunk,
                     device_id=0, cuda_stream=side.cuda_stream, algorithm_type=0)
    probe = nv.as_array(torch.empty(chunk, dtype=torch.uint8, device=dev))
    cap = -(-int(codec.get_max_comp_buffer_size(probe)) // 256) * 256
    arena = torch.randint(0, 4, (n * (chunk + cap),), dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    src = nv.as_arrays(arena, [i * chunk for i in range(n)], [chunk] * n, cuda_stream=side.cuda_stream)
    dst = nv.as_arrays(arena, [n * chunk + i * cap for i in range(n)], [cap] * n, cuda_stream=side.cuda_stream)
    result: list[Any] = []
    row("nvCOMP encode (side stream), first", lambda: result.append(codec.encode(src, out=dst)))
    row("nvCOMP result.buffer_sizes", lambda: result[0].buffer_sizes)
    row("nvCOMP result released", lambda: (result.clear(), gc.collect()))
    row("nvCOMP encode (side stream), again", lambda: result.append(codec.encode(src, out=dst)))
    row("nvCOMP result released, again", lambda: (result.clear(), gc.collect()))
    row("gc.collect() (full)", gc.collect)
    return rows


def _state(gb: float) -> dict[str, Any]:
    dev = torch.device("cuda", 0)
    n = max(1, int(gb * 1e9 / (64 * MiB)))
    g = torch.Generator(device=dev).manual_seed(0)
    return {f"t{i}": torch.randn(16 * MiB, device=dev, generator=g) for i in range(n)}


def background(sleep_s: float, slow_s: float, gb: float) -> dict[str, Any]:
    """Finish time of an overlapped save's background, with and without a busy training stream."""
    from nvdcp.dcp.stager import NvcompStager, _staged_shards, release_staged

    sd = _state(gb)
    stager = NvcompStager(async_staging=True, buffer_bytes=4 << 30)
    stager.warm_up(sd)
    out: dict[str, Any] = {}
    for label, sleep in (("idle", 0.0), ("busy", sleep_s), ("idle_again", 0.0), ("busy_again", sleep_s)):
        torch.cuda.synchronize()
        gc.collect()
        with SlowCalls(slow_s) as slow:
            t0 = time.perf_counter()
            future = stager.stage(sd)
            call = time.perf_counter() - t0
            if sleep:
                busy(sleep)  # training's next step, queued after the snapshot
            staged = future.result() if hasattr(future, "result") else future
            shards = _staged_shards(staged)
            for s in shards:
                s.encoded  # noqa: B018 - waits for the background
            done = time.perf_counter() - t0
            release_staged(shards)
        stats = stager.last_stats
        out[label] = {"call_s": round(call, 4), "finished_s": round(done, 4),
                      "background_s": round(stats.background_seconds, 4) if stats else None,
                      "snapshot_s": round(stats.snapshot_seconds, 4) if stats else None, "slow_calls": slow.found}
        print(f"  background {label:10s}: call {call:.4f} s, records finished after {done:.4f} s "
              f"(busy kernel {sleep:.2f} s); slow calls: {len(slow.found)}", flush=True)
        for c in slow.found[:25]:
            print(f"      {c['seconds']:7.4f} s  {c['thread']:24s} {'  ' * min(c['depth'], 6)}{c['call']}", flush=True)
    stager.close()
    return out


def whole_save(sleep_s: float, slow_s: float, gb: float) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import nvdcp
    from nvdcp.dcp.stager import NvcompStager

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    group = dist.new_group(backend="gloo")
    sd = _state(gb)
    stager = NvcompStager(async_staging=True, buffer_bytes=4 << 30)
    stager.warm_up(sd)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as root:
        for k, sleep in enumerate((0.0, sleep_s, 0.0, sleep_s)):
            torch.cuda.synchronize()
            gc.collect()
            with SlowCalls(slow_s) as slow:
                t0 = time.perf_counter()
                response = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(os.path.join(root, str(k))),
                                          async_stager=stager, process_group=group)
                call = time.perf_counter() - t0
                if sleep:
                    busy(sleep)
                response.upload_completion.result()
                done = time.perf_counter() - t0
            label = f"save{k}_{'busy' if sleep else 'idle'}"
            out[label] = {"call_s": round(call, 4), "durable_s": round(done, 4), "slow_calls": slow.found}
            print(f"  async_save {label}: call {call:.4f} s, durable after {done:.4f} s; slow calls: {len(slow.found)}",
                  flush=True)
            for c in slow.found[:30]:
                print(f"      {c['seconds']:7.4f} s  {c['thread']:24s} {'  ' * min(c['depth'], 6)}{c['call']}", flush=True)
    stager.close()
    dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> int:
    global _CYCLES_PER_S
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--sleep-s", type=float, default=0.5)
    p.add_argument("--slow-s", type=float, default=0.1)
    p.add_argument("--gb", type=float, default=1.0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sync_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    _CYCLES_PER_S = _cycles_per_second()
    print(f"busy kernel: {_CYCLES_PER_S / 1e9:.2f} G cycles/s; sleep {args.sleep_s} s", flush=True)
    payload: dict[str, Any] = {"args": vars(args), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    print("1. single calls behind a busy stream", flush=True)
    payload["single_calls"] = single_calls(args.sleep_s)
    print("2. an overlapped save's background", flush=True)
    payload["background"] = background(args.sleep_s, args.slow_s, args.gb)
    print("3. whole dcp.async_save", flush=True)
    payload["async_save"] = whole_save(args.sleep_s, args.slow_s, args.gb)
    print(f"wrote {write_results('sync_probe', payload, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

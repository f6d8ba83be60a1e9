"""What the GPU did during one call: copies and kernels per stream, from a torch.profiler trace.

:func:`cuda_timeline` runs a function under ``torch.profiler`` (CUDA activity only, so host
overhead stays small) and sums the trace: time in host-to-device and device-to-host copies, in
kernels (top names), how long each stream and the device as a whole were busy (the union of
their events' intervals), and the span from the first GPU event to the last, against the call's
wall time. A save whose GPU was busy for a small share of its wall time is bound on the host.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def _copy_kind(name: str) -> str:
    for kind in ("HtoD", "DtoH", "DtoD"):
        if kind in name:
            return kind
    return "other"


def summarize_trace(events: list[dict[str, Any]], wall_s: float, top: int = 12) -> dict[str, Any]:
    """Sum a chrome trace's GPU events (``cat`` kernel / gpu_memcpy / gpu_memset; µs)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return {"wall_s": round(wall_s, 4), "gpu_events": 0}
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in gpu]
    by_stream: dict[str, list[tuple[float, float]]] = defaultdict(list)
    copies: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0])
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e, span in zip(gpu, spans):
        by_stream[str(e.get("args", {}).get("stream", "?"))].append(span)
        dur = float(e.get("dur", 0))
        if e["cat"] == "gpu_memcpy":
            c = copies[_copy_kind(e.get("name", ""))]
            c[0] += dur
            c[1] += 1
            c[2] += int(e.get("args", {}).get("bytes", 0) or 0)
        else:
            k = kernels[e.get("name", "?")[:90]]
            k[0] += dur
            k[1] += 1
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    return {
        "wall_s": round(wall_s, 4),
        "gpu_events": len(gpu),
        "gpu_span_s": round((last - first) / 1e6, 4),
        "gpu_busy_s": round(_union(spans) / 1e6, 4),
        "stream_busy_s": {s: round(_union(v) / 1e6, 4) for s, v in sorted(by_stream.items())},
        "copies": {k: {"s": round(v[0] / 1e6, 4), "count": int(v[1]), "GB": round(v[2] / 1e9, 3),
                       "GBps": round(v[2] / v[0] / 1e3, 1) if v[0] else None} for k, v in copies.items()},
        "kernel_s": round(sum(v[0] for v in kernels.values()) / 1e6, 4),
        "top_kernels": [{"name": n, "s": round(v[0] / 1e6, 4), "count": int(v[1])}
                        for n, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def cuda_timeline(fn: Any) -> dict[str, Any]:
    """Run ``fn()`` under torch.profiler's CUDA activity and return :func:`summarize_trace`'s sums."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    return summarize_trace(trace.get("traceEvents", []), wall)

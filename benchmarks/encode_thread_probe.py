"""Where the GPU encode thread's time goes in full and delta saves (issue 15): wall time and the
thread's own CPU time per call of the encoder's steps, counted on the ``nvdcp-gpu-encode`` thread.

    python -m benchmarks.encode_thread_probe [--saves 6] [--root /dev/shm/etp] [--out DIR] [--suffix _h100]

``delta_probe``'s chain states (671 MB of 2 M-element tensors, fp32 and bf16) are saved
``--saves`` times whole and ``--saves`` times as deltas against the save before
(``DeltaPolicy(full_every=1000)``). Per kind of save (the first left out): the median wall time
and, per step of :class:`~nvdcp.gpu.encoder.GpuEncoder`, milliseconds of wall time and of the
thread's CPU per save, and calls per save. A step whose wall time is about its CPU time is host
work on the encode thread, which is a GPU save's critical path; a wait shows as wall time
without CPU. Needs CUDA. Writes ``encode_thread_probe_<date><suffix>.json`` (date, machine,
command).
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import shutil
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from benchmarks.common import write_results
from benchmarks.delta_probe import chain_states
from nvdcp.gpu import encoder as encoder_module

THREAD = "nvdcp-gpu-encode"
STEPS = {encoder_module.GpuEncoder: ("_launch", "_to_host", "_split_planes", "_slot_table"),
         encoder_module: ("split_run", "copy_pairs", "pack_chunks"),
         torch.cuda.Event: ("synchronize",)}


class StepTimer:
    """Wall and thread CPU seconds per step, on the encode thread only (wrapped while in use)."""

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
        self._saved: list[tuple[Any, str, Any]] = []

    def _timed(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name != THREAD:
                return fn(*args, **kwargs)
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                total = self.totals[label]
                total[0] += time.perf_counter() - wall
                total[1] += time.thread_time() - cpu
                total[2] += 1
        return timed

    def __enter__(self) -> StepTimer:
        for owner, names in STEPS.items():
            for name in names:
                raw = inspect.getattr_static(owner, name)
                wrapped = self._timed(name, getattr(owner, name))
                setattr(owner, name, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
                self._saved.append((owner, name, raw))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, raw in reversed(self._saved):
            setattr(owner, name, raw)

    def per_save(self, saves: int) -> dict[str, dict[str, float]]:
        return {name: {"wall_ms": wall / saves * 1e3, "cpu_ms": cpu / saves * 1e3, "calls": calls / saves}
                for name, (wall, cpu, calls) in self.totals.items()}


def measure(variant: str, delta: bool, saves: int, root: str) -> dict[str, Any]:
    states = chain_states(variant, saves + 1, "cuda")
    folder = f"{root}/{variant}_{'delta' if delta else 'full'}"
    shutil.rmtree(folder, ignore_errors=True)
    policy = nvdcp.DeltaPolicy(full_every=1000) if delta else None

    def save(i: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dcp.save(states[i], storage_writer=nvdcp.NvcompWriter(f"{folder}/c{i}", delta=policy), no_dist=True)
        torch.cuda.synchronize()
        shutil.rmtree(f"{folder}/c{i - 2}", ignore_errors=True)
        return time.perf_counter() - t0

    save(0)
    save(1)  # untimed: the first delta tries every item
    with StepTimer() as timer:
        walls = [save(i) for i in range(2, saves + 1)]
    shutil.rmtree(folder, ignore_errors=True)
    return {"variant": variant, "save": "delta" if delta else "full", "save_s": statistics.median(walls),
            "saves_s": walls, "steps": timer.per_save(len(walls))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--root", default="/dev/shm/etp")
    p.add_argument("--out", default=None)
    p.add_argument("--suffix", default="")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    warnings.filterwarnings("ignore")
    rows = [measure(variant, delta, args.saves, args.root) for variant in ("fp32", "bf16") for delta in (False, True)]
    for row in rows:
        steps = ", ".join(f"{name} {s['wall_ms']:.1f}/{s['cpu_ms']:.1f} ms" for name, s in row["steps"].items())
        print(f"{row['variant']} {row['save']}: {row['save_s']:.4f} s; wall/cpu per save: {steps}", flush=True)
    print("->", write_results("encode_thread_probe", {"args": vars(args), "rows": rows}, args.out, suffix=args.suffix))
    return 0


if __name__ == "__main__":
    sys.exit(main())

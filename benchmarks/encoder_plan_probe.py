"""Host time of the GPU encoder's per-bucket planning, without a GPU (issue 18: a GPU save's
own cost per item; these run on the encode thread, which a GPU save of many small tensors waits for).

    python -m benchmarks.encoder_plan_probe [--items 20000] [--repeats 5] [--out DIR] [--suffix S]
    PYTHONPATH=/other/tree python benchmarks/encoder_plan_probe.py ...   # another tree's code

20,000 jobs of 4 KiB-1 MiB (bf16 and fp32 alternating, as the ``small`` case), CPU tensors:
``GpuEncoder._plan`` over all of them, then per bucket ``_slot_table`` with its ``SlotLayout``
and ``_split_planes`` with the plane kernel taken as available and its launch stubbed out (the
table is built, not sent). Best of ``repeats``, in µs per item. Built without ``GpuEncoder.__init__`` (no streams).
"""

from __future__ import annotations

import argparse
import timeit
from typing import Any

import numpy as np
import torch

from benchmarks.common import write_results
from nvdcp.gpu import encoder as gpu_encoder
from nvdcp.gpu.nvcomp_codecs import CodecCache
from nvdcp.gpu.plan import SlotLayout
from nvdcp.pipeline.policy import choose_layout


def _jobs(n: int) -> list[Any]:
    rng = np.random.default_rng(0)
    jobs = []
    for i in range(n):
        dtype = torch.float32 if i % 2 else torch.bfloat16
        t = torch.empty(int(rng.integers(4096, 1 << 20)) // 4 * 4 // dtype.itemsize, dtype=dtype)
        jobs.append(gpu_encoder.GpuJob(f"k{i}", t, choose_layout(dtype, "zstd"), dtype, 0, tuple(t.shape)))
    return jobs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--suffix", default="")
    args = ap.parse_args(argv)
    gpu_encoder._kernel_splits = lambda device: True  # type: ignore[assignment]
    gpu_encoder.split_rows = lambda *a: None  # type: ignore[assignment]
    enc = object.__new__(gpu_encoder.GpuEncoder)
    enc.chunk_bytes, enc.granule, enc.bound = 65536, gpu_encoder.granule_for(65536), None
    enc.bucket_budget, enc.pinned_bytes, enc.keep_stream = 1 << 30, 512 << 20, None
    enc.kernel_splits, enc.codecs = True, CodecCache(65536, 0)
    jobs = _jobs(args.items)
    buckets = enc._plan(jobs)

    def layout(b: Any) -> SlotLayout:
        raw_sizes, _, _ = enc._slot_table(b)
        return SlotLayout.of(b, raw_sizes, gpu_encoder._KernelSplit.takes(b), enc.chunk_bytes, enc.granule)

    layouts = [layout(b) for b in buckets]

    def slot_tables() -> None:
        for b in buckets:
            layout(b)

    def splits() -> None:
        for b, lay in zip(buckets, layouts):
            enc._split_planes(jobs, b, torch.empty(lay.end, dtype=torch.uint8), lay)

    us = {name: min(timeit.repeat(fn, number=1, repeat=args.repeats)) * 1e6 / len(jobs)
          for name, fn in (("plan", lambda: enc._plan(jobs)), ("slot_table", slot_tables), ("split_planes", splits))}
    print(f"{len(jobs)} jobs, {len(buckets)} buckets: " + ", ".join(f"{k} {v:.2f} us/item" for k, v in us.items()))
    path = write_results("encoder_plan_probe", {"issue": 18, "items": len(jobs), "buckets": len(buckets),
                                                "nvdcp": gpu_encoder.__file__, "us_per_item": us}, args.out,
                         suffix=args.suffix)
    print(f"-> {path}")


if __name__ == "__main__":
    main()

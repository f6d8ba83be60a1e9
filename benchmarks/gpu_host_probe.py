"""The host side of a GPU load, per item, on a machine without a GPU (issue 18: per-item cost).

A GPU load of many small tensors is bound by Python on the host, not by the GPU (the GIL: its
read threads and its main thread take turns; docs/BENCHMARKS.md "Many small tensors"). This
probe times that host work where device time is not needed, with the device parts stubbed:
nvCOMP, the CRC32C and merge kernels and the host-to-device copies do nothing, and "device"
tensors are CPU tensors. What it times is the Python and numpy work around them:

- ``batch``: one read thread's GPU batch (``NvcompReader._load_gpu_batch``) of ``--batch``
  small records: the runs' reads, parsing, checks against ``.metadata``, the decoder's pass
  planning, slot tables and staging copies;
- ``main``: the main thread's ``read_data`` over every item of the checkpoint (classification,
  destinations, batching, commits), with each GPU batch's decode stubbed out.

The numbers are host costs only (no decode): compare them between code versions on one machine,
not with a real GPU load. The checkpoint is written by the CPU writer (zstd records; a GPU save
stores the same record layout with other codecs)::

    python -m benchmarks.gpu_host_probe [--count 20000] [--batch 2450] [--repeats 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import types
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from benchmarks.common import write_results
from benchmarks.cpu_pipeline_bench import small_state


def _stub_device() -> None:
    """Stand-ins for nvCOMP, the device kernels and copies, and CUDA's device queries."""
    from nvdcp.dcp import reader
    from nvdcp.gpu import decoder
    from nvdcp.gpu.config import GpuConfig

    class _Result:
        def __init__(self, capacities: Any) -> None:
            self.capacities = capacities

        def sizes(self) -> Any:
            return self.capacities

        def failed(self) -> list[int]:
            return []

    class _Codec:
        def decompress(self, src: Any, src_offsets: Any, sizes: Any, dst: Any, dst_offsets: Any, capacities: Any,
                       stream: Any, temp_limit: int | None = None) -> _Result:
            return _Result(capacities)

    class _Codecs:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def get(self, name: str, data_type: Any) -> Any:
            return _Codec()

    def upload(self: Any, p: Any) -> None:  # no copy, no check: the pass is "checked"
        p.bad, p.checked = None, decoder._HostEvent()

    decoder.CodecCache = _Codecs  # type: ignore[misc,assignment]
    decoder.merge_rows = lambda *args, **kwargs: None  # type: ignore[assignment]
    decoder.GpuDecoder._upload = upload  # type: ignore[method-assign]
    reader.gpu_available = lambda: True  # type: ignore[assignment]
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    GpuConfig.gpu_budget = lambda self, device, load=False: 8 << 30  # type: ignore[method-assign]


class _Pool:
    """Reused host buffers in place of pinned ones (as many as sizes asked)."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}

    def acquire(self, n: int) -> torch.Tensor:
        return self.buffers.setdefault(n, torch.empty(n, dtype=torch.uint8))

    def release(self, buf: torch.Tensor) -> None:
        pass


def batch_cost(root: str, state: dict[str, torch.Tensor], batch: int, repeats: int) -> dict[str, Any]:
    """One GPU batch of the first ``batch`` records in file order, into destinations of their shape."""
    import nvdcp
    from nvdcp.gpu.decoder import GpuDecoder
    from nvdcp.report import Report

    rd = nvdcp.NvcompReader(root)
    md = rd.read_metadata()
    rd.set_up_storage_reader(md, True)
    records = md.storage_data
    indexes = sorted(records, key=lambda ix: (records[ix].relative_path, records[ix].offset))[:batch]
    decoder = GpuDecoder(torch.device("cpu"), budget_bytes=2 << 30, pinned=_Pool(), pinned_bytes=512 << 20)  # type: ignore[arg-type]
    decoder.device_crc = decoder.fused = True  # the device path, its kernels stubbed
    rd._gpu_decoder = lambda device: decoder  # type: ignore[method-assign]
    targets = [(torch.empty_like(state[ix.fqn]), state[ix.fqn].nbytes) for ix in indexes]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        rd._load_gpu_batch(indexes, torch.device("cpu"), Report("load", root), targets)
        times.append(time.perf_counter() - t0)
    return _summary(times[1:], len(indexes))


def main_thread_cost(root: str, state: dict[str, torch.Tensor], repeats: int) -> dict[str, Any]:
    """``read_data`` on the main thread, every nvdcp item bound for a GPU batch whose decode is stubbed."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    import nvdcp
    from nvdcp.dcp import reader
    from nvdcp.gpu.config import GpuConfig

    done, header = torch.empty(0), types.SimpleNamespace()  # any header: the commit only needs the tensor
    saved = reader.NvcompReader._load_gpu_batch
    reader.NvcompReader._load_gpu_batch = (  # type: ignore[method-assign]
        lambda self, indexes, device, report, targets=None: [(ix, header, reader._InPlace(done)) for ix in indexes]
    )
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    times = []
    try:
        for _ in range(repeats + 1):
            rd = nvdcp.NvcompReader(root, gpu=GpuConfig(decode_device="cuda"))
            md = rd.read_metadata()
            planner = DefaultLoadPlanner()
            planner.set_up_planner(dest, md, True)
            plan = planner.create_local_plan()
            rd.set_up_storage_reader(md, True)
            t0 = time.perf_counter()
            rd.read_data(plan, planner).wait()
            times.append(time.perf_counter() - t0)
    finally:
        reader.NvcompReader._load_gpu_batch = saved  # type: ignore[method-assign]
    return _summary(times[1:], len(state))


def _summary(times: list[float], items: int) -> dict[str, Any]:
    """Median and best of the timed repeats (this machine's neighbours make the median noisy:
    compare the best of many repeats between code versions)."""
    median, best = statistics.median(times), min(times)
    return {"items": items, "seconds": times, "median_s": median, "best_s": best,
            "us_per_item": median / items * 1e6, "best_us_per_item": best / items * 1e6}


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--count", type=int, default=20_000, help="tensors in the state (cpu_pipeline_bench's small)")
    p.add_argument("--batch", type=int, default=2450, help="records in the timed GPU batch (a load's batches: ~2,450)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--dir", default="/tmp/nvdcp-gpu-host-probe")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    _stub_device()
    import nvdcp

    state = small_state(args.count)
    root = os.path.join(args.dir, f"small{args.count}")
    if not os.path.exists(os.path.join(root, ".metadata")):
        dcp.save(state, storage_writer=nvdcp.NvcompWriter(root), no_dist=True)
    rows = {"batch": batch_cost(root, state, args.batch, args.repeats),
            "main": main_thread_cost(root, state, args.repeats)}
    for name, row in rows.items():
        print(f"{name}: {row['items']} items, median {row['median_s'] * 1e3:.1f} ms ({row['us_per_item']:.1f} us per item), "
              f"best {row['best_s'] * 1e3:.1f} ms ({row['best_us_per_item']:.1f} us per item)")
    return write_results("gpu_host_probe", {
        "issue": 18, "rows": rows, "settings": {"count": args.count, "batch": args.batch, "repeats": args.repeats},
        "note": "host work of a GPU load with the device stubbed (no decode): compare code versions on one machine",
    }, args.out)


if __name__ == "__main__":
    main()

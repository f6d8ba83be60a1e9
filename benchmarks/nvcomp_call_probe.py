"""What one nvCOMP compress call costs against how many chunks it carries (issue 15: GPU delta saves).

    python -m benchmarks.nvcomp_call_probe [--chunks 64,256,1024,4096] [--chunk-kib 64] [--saves]
        [--workspaces] [--out DIR] [--suffix _h100]

Part 1 (always): the top byte plane of the XOR of fp32 / bf16 weights (N(0, 0.02)) with the same
weights after an update of N(0, step) (step 1e-4 and 1e-5: what a delta's top plane holds, mostly
zeros), compressed in 64 KiB chunks (each size of ``--chunk-kib``) by one call of nvCOMP's batched Zstd and GDeflate (type 0)
through :class:`nvdcp.gpu.nvcomp_batch.BatchedCodec`, for each chunk count of ``--chunks``: the
best of three calls (ms, GB/s of input, ratio). Then two calls of 1,024 chunks queued on two
streams, first sharing the process's one workspace (nvdcp's design: the calls run one after the
other) and then each with a workspace of its own (they overlap), twice each.

Part 2 (``--saves``): the reference GPT (``benchmarks.delta_bench``'s CUDA workload, 10 steps
apart near peak LR) saved as a first delta and as a full checkpoint to /dev/shm at scratch
budgets ``GpuConfig(gpu_memory_bytes=None, 2 GiB, 4 GiB)``: medians of three alternating rounds
after one warm-up, and how many nvCOMP calls and chunks each codec got in the delta save.

Part 3 (``--workspaces``): the workspace nvCOMP asks for (``...GetTempSize``), compressing and
decompressing, for each codec (ANS and Bitcomp typed fp32), chunk size of ``--chunk-kib`` and a
call of 1 to 16,384 chunks: what a save's or load's GPU budget has to hold beside its scratch.

Writes ``nvcomp_call_probe_<date><suffix>.json`` (date, machine, command) to ``--out``
(default benchmarks/results). Needs CUDA and nvCOMP.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import write_results

CHUNK = 64 << 10


def xor_top_plane(dtype: torch.dtype, n: int, step: float, seed: int = 0) -> torch.Tensor:
    """The top byte plane (sign and high exponent bits) of ``w XOR (w + N(0, step))``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, generator=g, device="cuda") * 0.02
    moved = w + torch.randn(n, generator=g, device="cuda") * step
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    x = w.to(dtype).view(bits) ^ moved.to(dtype).view(bits)
    size = torch.empty((), dtype=dtype).element_size()
    return x.view(torch.uint8).view(-1, size)[:, size - 1].contiguous()


def time_calls(codec: Any, plane: torch.Tensor, n: int) -> dict[str, float]:
    """Best of three calls compressing the plane's first ``n`` chunks (of ``codec.chunk_bytes``)."""
    from nvdcp.gpu.nvcomp_batch import WORKSPACES

    chunk = codec.chunk_bytes
    src_off = np.arange(n, dtype=np.int64) * chunk
    sizes = np.full(n, chunk, dtype=np.int64)
    dst = torch.empty(n * codec.max_output, dtype=torch.uint8, device="cuda")
    dst_off = np.arange(n, dtype=np.int64) * codec.max_output
    stream = torch.cuda.Stream()
    times, out = [], np.zeros(0)
    with WORKSPACES.held():
        codec.compress(plane, src_off, sizes, dst, dst_off, stream).sizes()  # the workspace's allocation
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = codec.compress(plane, src_off, sizes, dst, dst_off, stream).sizes()
            times.append(time.perf_counter() - t0)
    t = min(times)
    return {"chunk_kib": chunk >> 10, "chunks": n, "ms": round(t * 1e3, 3), "GBps": round(n * chunk / t / 1e9, 2),
            "ratio": round(n * chunk / max(1, int(out.sum())), 2)}


def two_streams(plane: torch.Tensor, n: int = 1024) -> dict[str, list[float]]:
    """Two Zstd calls of ``n`` chunks each on two streams: one shared workspace against two."""
    from nvdcp.gpu import nvcomp_batch

    codec = nvcomp_batch.BatchedCodec("zstd", None, CHUNK)
    offsets = [np.arange(n, dtype=np.int64) * CHUNK + k * n * CHUNK for k in range(2)]
    sizes = np.full(n, CHUNK, dtype=np.int64)
    dsts = [torch.empty(n * codec.max_output, dtype=torch.uint8, device="cuda") for _ in range(2)]
    dst_off = np.arange(n, dtype=np.int64) * codec.max_output
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    pools = [nvcomp_batch.Workspaces(), nvcomp_batch.Workspaces()]
    shared = nvcomp_batch.WORKSPACES

    def both(own: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        results = []
        for k in range(2):
            nvcomp_batch.WORKSPACES = pools[k] if own else pools[0]
            results.append(codec.compress(plane, offsets[k], sizes, dsts[k], dst_off, streams[k]))
        for r in results:
            r.sizes()
        return time.perf_counter() - t0

    out: dict[str, list[float]] = {"one_workspace_ms": [], "two_workspaces_ms": []}
    try:
        with pools[0].held(), pools[1].held():
            both(True)
            both(False)
            for own in (False, True, False, True):
                out["two_workspaces_ms" if own else "one_workspace_ms"].append(round(both(own) * 1e3, 2))
    finally:
        nvcomp_batch.WORKSPACES = shared
    return out


def part_calls(chunks: list[int], chunk_sizes: list[int]) -> list[dict[str, Any]]:
    from nvdcp.gpu.nvcomp_batch import BatchedCodec

    rows = []
    for label, dtype, step in (("fp32 1e-4", torch.float32, 1e-4), ("bf16 1e-4", torch.bfloat16, 1e-4),
                               ("fp32 1e-5", torch.float32, 1e-5)):
        plane = xor_top_plane(dtype, max(chunks) * max(chunk_sizes) * torch.empty((), dtype=dtype).element_size(), step)
        for name in ("zstd", "gdeflate"):
            for size in chunk_sizes:
                codec = BatchedCodec(name, None, size, 0)
                for n in chunks:
                    row = {"plane": label, "codec": name, **time_calls(codec, plane, n)}
                    print(row, flush=True)
                    rows.append(row)
        if plane.numel() >= 2048 * CHUNK:
            row = {"plane": label, "codec": "zstd", "two_streams_1024_chunks": two_streams(plane)}
            print(row, flush=True)
            rows.append(row)
    return rows


def part_saves() -> list[dict[str, Any]]:
    import torch.distributed.checkpoint as dcp

    import nvdcp
    from benchmarks import delta_bench
    from benchmarks.delta_save_ab import timed
    from nvdcp.gpu import nvcomp_batch
    from nvdcp.gpu.config import GpuConfig

    calls: collections.Counter[str] = collections.Counter()
    compress = nvcomp_batch.BatchedCodec.compress

    def counted(self: Any, src: Any, src_offsets: Any, sizes: Any, *rest: Any) -> Any:
        calls[self.name] += 1
        calls[f"{self.name}_chunks"] += len(sizes)
        return compress(self, src, src_offsets, sizes, *rest)

    nvcomp_batch.BatchedCodec.compress = counted  # type: ignore[method-assign, assignment]
    args = delta_bench.parse(["--device", "cuda", "--intervals", "10", "--checkpoints", "2"])
    snaps, _ = delta_bench.train(args)
    first, last = sorted(snaps)
    root = "/dev/shm/nvdcp-call-probe"
    rows = []
    try:
        for variant in ("fp32_adamw", "bf16_weights"):
            base, state = delta_bench.variant_state(variant, snaps[first]), delta_bench.variant_state(variant, snaps[last])
            for scratch in (None, 2 << 30, 4 << 30):
                cfg = GpuConfig(gpu_memory_bytes=scratch)
                times: dict[str, list[float]] = {"delta": [], "full": []}
                counts: dict[str, int] = {}
                for r in range(4):
                    shutil.rmtree(root, ignore_errors=True)
                    policy = nvdcp.DeltaPolicy(full_every=100)
                    dcp.save(base, storage_writer=nvdcp.NvcompWriter(f"{root}/base", delta=policy, gpu=cfg), no_dist=True)
                    calls.clear()
                    delta_s = timed(lambda: dcp.save(state, storage_writer=nvdcp.NvcompWriter(
                        f"{root}/delta", delta=policy, gpu=cfg), no_dist=True))
                    counts = dict(calls)
                    full_s = timed(lambda: dcp.save(state, storage_writer=nvdcp.NvcompWriter(f"{root}/full", gpu=cfg),
                                                    no_dist=True))
                    if r:  # the first round warms up
                        times["delta"].append(delta_s)
                        times["full"].append(full_s)
                med = {k: statistics.median(v) for k, v in times.items()}
                row = {"variant": variant, "scratch_MiB": scratch and scratch >> 20, "seconds": times,
                       "median_s": med, "delta_over_full": round(med["delta"] / med["full"], 3), "calls": counts}
                print({k: v for k, v in row.items() if k != "seconds"}, flush=True)
                rows.append(row)
    finally:
        nvcomp_batch.BatchedCodec.compress = compress  # type: ignore[method-assign]
        shutil.rmtree(root, ignore_errors=True)
    return rows


def part_workspaces(chunk_sizes: list[int]) -> list[dict[str, Any]]:
    from nvdcp.gpu.nvcomp_batch import BatchedCodec

    rows = []
    for name, data_type in (("zstd", None), ("gdeflate", None), ("ans", "<f4"), ("bitcomp", "<f4")):
        for size in chunk_sizes:
            codec = BatchedCodec(name, data_type, size, 0)
            for n in (1, 64, 1024, 16384):
                row = {"codec": name, "chunk_kib": size >> 10, "chunks": n,
                       "compress_MiB": round(codec.compress_temp_bytes(n, n * size) / 2**20, 2),
                       "decompress_MiB": round(codec.decompress_temp_bytes(n, n * size) / 2**20, 2)}
                print(row, flush=True)
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", default="64,256,1024,4096", help="chunks per call, comma separated")
    p.add_argument("--chunk-kib", default="64", help="chunk sizes in KiB (1-64), comma separated")
    p.add_argument("--saves", action="store_true", help="also part 2: the reference model's delta and full saves")
    p.add_argument("--workspaces", action="store_true", help="also part 3: nvCOMP's workspace sizes")
    p.add_argument("--out", default=None)
    p.add_argument("--suffix", default="")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("nvcomp_call_probe needs CUDA")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    payload: dict[str, Any] = {"benchmark": "nvcomp_call_probe", "issue": 15, "chunk_bytes": CHUNK,
                               "calls": part_calls(sorted(int(x) for x in args.chunks.split(",") if x),
                                                   [int(x) << 10 for x in args.chunk_kib.split(",") if x])}
    chunk_sizes = [int(x) << 10 for x in args.chunk_kib.split(",") if x]
    if args.workspaces:
        payload["workspaces"] = part_workspaces(chunk_sizes)
    if args.saves:
        payload["saves"] = part_saves()
    path = write_results("nvcomp_call_probe", payload, args.out, args.suffix)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()

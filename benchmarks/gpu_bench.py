"""GPU benchmark (issue 3): nvdcp against stock DCP writers on the reference workload, tensors on the GPU.

    python -m benchmarks.gpu_bench [--steps 400] [--dir /tmp/nvdcp-bench] [--out DIR]

For the fp32 AdamW state and its bf16 variant, one run each of: stock FileSystemWriter
(thread_count 1 and 4), FileSystemWriter + torch's ZStandard extension, a naive per-tensor nvCOMP
writer (one ANS encode call per tensor, then write; NVIDIA's blog recipe), and nvdcp. Reports
bytes, ratio, save and load wall time (saves fsync; loads go to GPU tensors), the codec stage
alone (GPU compress/decompress GB/s of uncompressed state), peak extra GPU memory and peak pinned
memory. Writes benchmarks/results/gpu_bench_<date>.json (or --out) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from benchmarks.common import (
    dir_bytes,
    drop_page_cache,
    fresh_dir,
    markdown_table,
    pinned_peak,
    write_results,
)
from benchmarks.workload import states_equal, tensor_bytes, to_bf16, train_state, zeros_like_state
from nvdcp.demo.model import GPTConfig
from nvdcp.gpu.config import GpuConfig

sync = torch.cuda.synchronize


def flat_tensors(state: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    out = []
    if isinstance(state, torch.Tensor):
        return [(prefix, state)]
    if isinstance(state, dict):
        for k, v in state.items():
            out += flat_tensors(v, f"{prefix}.{k}")
    elif isinstance(state, list):
        for i, v in enumerate(state):
            out += flat_tensors(v, f"{prefix}.{i}")
    return out


def encoder_jobs(state: Any) -> list[Any]:
    """One GpuJob per non-empty CUDA tensor of ``state`` (codec auto), keyed by position."""
    from nvdcp.format.dtypes import dtype_code
    from nvdcp.gpu.encoder import GpuJob
    from nvdcp.pipeline.policy import GPU_AUTO_CODEC, choose_layout

    tensors = [t for _, t in flat_tensors(state) if t.is_cuda and t.numel()]
    return [GpuJob(i, t.reshape(-1).view(torch.uint8), choose_layout(t.dtype, "auto", GPU_AUTO_CODEC), t.dtype,
                   dtype_code(t.dtype), tuple(t.shape)) for i, t in enumerate(tensors)]


def naive_nvcomp_save(state: Any, path: str) -> None:
    """One nvCOMP ANS encode per tensor (NATIVE bitstream), copy to host, append to one file."""
    import nvidia.nvcomp as nv

    codecs: dict[str, Any] = {}
    with open(os.path.join(path, "naive.bin"), "wb") as f:
        for _, t in flat_tensors(state):
            if t.numel() == 0:
                continue
            dt = "<f4" if t.dtype == torch.float32 else "<f2" if t.dtype in (torch.bfloat16, torch.float16) else "|u1"
            codec = codecs.setdefault(dt, nv.Codec(algorithm="ANS", data_type=dt))
            src = t.contiguous().reshape(-1).view(torch.uint8)
            enc = codec.encode(nv.as_array(src))
            enc_host = enc.cpu()
            host = np.asarray(enc_host).tobytes()
            f.write(len(host).to_bytes(8, "little"))
            f.write(host)
        f.flush()
        os.fsync(f.fileno())


def naive_nvcomp_load(state: Any, path: str) -> None:
    import nvidia.nvcomp as nv

    codec = nv.Codec()
    with open(os.path.join(path, "naive.bin"), "rb") as f:
        for _, t in flat_tensors(state):
            if t.numel() == 0:
                continue
            n = int.from_bytes(f.read(8), "little")
            blob = torch.frombuffer(bytearray(f.read(n)), dtype=torch.uint8).cuda()
            dec = codec.decode(nv.as_array(blob))
            t.reshape(-1).view(torch.uint8).copy_(torch.as_tensor(dec, device="cuda").view(torch.uint8).reshape(-1))
            torch.cuda.synchronize()  # keep dec alive until the copy is done


def stock_zstd_writer(path: str, threads: int) -> Any:
    from torch.distributed.checkpoint._extension import ZStandard

    return dcp.FileSystemWriter(path, thread_count=threads, _extensions=[ZStandard()])


def save(state: Any, writer: Any) -> Any:
    dcp.save(state, storage_writer=writer)
    return writer


def load(state: Any, reader: Any) -> Any:
    dcp.load(state, storage_reader=reader)
    return reader


def run_variant(name: str, state: Any, root: str, save_fn: Any, load_fn: Any) -> dict[str, Any]:
    """``save_fn(state, path)`` and ``load_fn(state, path)`` return the writer and reader they used
    (their pinned pools are measured) or None."""
    path = fresh_dir(os.path.join(root, name.replace(" ", "_")))
    sync()
    base_mem = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    nvdcp.release_resources()  # earlier variants' pinned pools: freed, so this variant's peak is its own
    used: list[Any] = []
    save_s = timed_sync(lambda: used.append(save_fn(state, path)))
    peak_gpu = torch.cuda.max_memory_allocated() - base_mem
    stored = dir_bytes(path)
    cache_dropped = drop_page_cache()
    target = zeros_like_state(state)
    sync()
    load_s = timed_sync(lambda: used.append(load_fn(target, path)))
    exact = states_equal(state, target)
    return {"writer": name, "bytes": stored, "save_s": round(save_s, 3), "load_s": round(load_s, 3),
            "peak_extra_gpu_MiB": round(peak_gpu / 2**20, 1), "peak_pinned_MiB": round(pinned_peak(*used) / 2**20, 1),
            "bit_exact": exact, "page_cache_dropped": cache_dropped}


def timed_sync(fn: Any) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def codec_stage(state: Any, cfg: GpuConfig) -> dict[str, float]:
    """GPU compress and decompress of the whole state, no storage: GB/s of uncompressed bytes."""
    from nvdcp.codecs import codec_name
    from nvdcp.gpu.decoder import GpuDecoder
    from nvdcp.gpu.encoder import GpuEncoder

    device = torch.device("cuda", 0)
    jobs = encoder_jobs(state)
    raw = sum(j.data.numel() for j in jobs)

    encoder = GpuEncoder(device, chunk_bytes=65536, budget_bytes=cfg.gpu_budget(device), gdeflate_type=0)
    items = [(j, bytes(e.header_bytes), [bytes(c) for c in e.chunks], e.header) for j, e in encoder.encode(jobs)]
    items.sort(key=lambda it: it[0].key)
    t_enc = timed_sync(lambda: [None for _ in encoder.encode(jobs)])

    def kernels_only() -> None:
        # plane split + nvCOMP encode of every bucket, nothing copied to the host
        launched = [encoder._launch(jobs, b, k % 2) for k, b in enumerate(encoder._plan(jobs))]
        for lch in launched:
            lch.stream.synchronize()

    kernels_only()
    t_kernels = timed_sync(kernels_only)
    decoder = GpuDecoder(device, budget_bytes=cfg.gpu_budget(device))
    import numpy as np

    payloads = [(np.frombuffer(b"".join(chunks), dtype=np.uint8), header, job) for job, _, chunks, header in items]
    from nvdcp.gpu.decoder import DecodeRequest

    requests = [DecodeRequest(h, j.dtype, "bench", payload=p) for p, h, j in payloads]
    decoder.decode_many(requests)  # warm-up: codec creation
    t_dec = timed_sync(lambda: decoder.decode_many(requests))
    stored = sum(h.stored_nbytes + len(hb) for _, hb, _, h in items)
    codecs = sorted({codec_name(c) for _, _, _, h in items for c in h.plane_codecs})
    return {"raw_bytes": raw, "stored_bytes": stored, "ratio": round(raw / stored, 4), "codecs": codecs,
            "compress_GBps": round(raw / t_enc / 1e9, 1), "decompress_GBps": round(raw / t_dec / 1e9, 1),
            "compress_kernels_only_GBps": round(raw / t_kernels / 1e9, 1),
            "note": "compress: planes + nvCOMP + packing + D2H of stored bytes + host CRC32C (batched) + headers; "
                    "kernels_only: planes + nvCOMP on the GPU; decompress: host staging + CRC + H2D + nvCOMP + merge"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dir", default="/tmp/nvdcp-bench")
    ap.add_argument("--out", default=None)
    ap.add_argument("--small", action="store_true", help="tiny model (smoke test)")
    args = ap.parse_args()
    cfg = GPTConfig(d_model=128, n_layers=2, n_heads=4, context=128) if args.small else GPTConfig.reference()
    t0 = time.perf_counter()
    state, loss = train_state("cuda", cfg=cfg, steps=args.steps, batch=args.batch)
    train_s = time.perf_counter() - t0
    gcfg = GpuConfig()
    results: dict[str, Any] = {"workload": {"config": cfg.__dict__, "steps": args.steps, "final_loss": round(loss, 3),
                                            "train_s": round(train_s, 1)}, "variants": {}}
    for label, st in (("fp32_adamw", state), ("bf16", to_bf16(state))):
        raw = tensor_bytes(st)
        variants = [
            ("stock t1", lambda s, p: save(s, dcp.FileSystemWriter(p, thread_count=1)),
             lambda s, p: load(s, dcp.FileSystemReader(p))),
            ("stock t4", lambda s, p: save(s, dcp.FileSystemWriter(p, thread_count=4)),
             lambda s, p: load(s, dcp.FileSystemReader(p))),
            ("stock+ZStandard t1", lambda s, p: save(s, stock_zstd_writer(p, 1)),
             lambda s, p: load(s, dcp.FileSystemReader(p))),
            ("nvdcp t1", lambda s, p: save(s, nvdcp.NvcompWriter(p, thread_count=1)),
             lambda s, p: load(s, nvdcp.NvcompReader(p))),
            ("nvdcp t4", lambda s, p: save(s, nvdcp.NvcompWriter(p, thread_count=4)),
             lambda s, p: load(s, nvdcp.NvcompReader(p))),
            ("naive nvCOMP ANS per tensor", naive_nvcomp_save, naive_nvcomp_load),
        ]
        rows = []
        results["variants"][label] = {"raw_bytes": raw, "rows": rows}
        for name, save_fn, load_fn in variants:
            try:
                row = run_variant(name, st, args.dir, save_fn, load_fn)
            except Exception as exc:
                row = {"writer": name, "error": repr(exc)[:300]}
            row["ratio"] = round(raw / row["bytes"], 4) if row.get("bytes") else None
            rows.append(row)
            print(label, row, flush=True)
            write_results("gpu_bench", results, args.out)  # incremental: a crash keeps what ran
        # CPU destinations on a GPU machine: decode on the GPU or on the CPU?
        path = os.path.join(args.dir, "nvdcp_t1")
        dcp.save(st, storage_writer=nvdcp.NvcompWriter(path))
        host_target = zeros_like_state({k: v for k, v in st.items()})
        host_target = {k: _to_cpu(v) for k, v in host_target.items()}
        cpu_dest = {}
        for dev in ("cuda", "cpu"):
            drop_page_cache()
            cpu_dest[dev] = round(timed_sync(lambda: dcp.load(host_target, storage_reader=nvdcp.NvcompReader(
                path, gpu=GpuConfig(decode_device=dev)))), 3)
        results["variants"][label].update(codec_stage=codec_stage(st, gcfg), load_into_cpu_tensors_s=cpu_dest)
        print(label, "codec stage", results["variants"][label]["codec_stage"], "cpu dest", cpu_dest, flush=True)
        print(markdown_table(rows, ["writer", "bytes", "ratio", "save_s", "load_s", "peak_extra_gpu_MiB",
                                    "peak_pinned_MiB", "bit_exact"]), flush=True)
    print("written", write_results("gpu_bench", results, args.out))


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


if __name__ == "__main__":
    main()

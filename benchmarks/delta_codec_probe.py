"""Which codec each byte plane of a delta should get: ratios and speeds on real training deltas.

    python -m benchmarks.delta_codec_probe [--device cuda] [--lr-total 1200] [--intervals 10,100] [--cpu-frames]

Trains the reference GPT as ``benchmarks/delta_bench.py`` does (same arguments, same snapshots),
then for each variant (fp32 AdamW state, bf16 weights) and interval takes the last state and the
one ``interval`` steps before it, forms every item's delta as nvdcp stores it (the zigzag
difference of the bit patterns, ``nvdcp.transform.delta``), splits it into byte planes and
compresses every plane, gathered over the items of one class (weights, ``exp_avg``,
``exp_avg_sq``) that deltas are written for (>= 64 KiB), with each candidate codec in 64 KiB RAW
chunks (a chunk that does not shrink is stored raw, as the format does). On the GPU: nvCOMP
GDeflate with each ``algorithm_type``, Zstd, and ANS (for reference: ANS chunks have no CPU
decoder, so nvdcp cannot use it). On the CPU, on a sample of every plane: zstd levels (what the
CPU path writes: level 1). Reports, per class and plane, stored bytes and encode GB/s, and per
variant the delta ratio (raw / stored) with today's choice (GDeflate type 0 for every plane) and
with the best CPU-decodable codec per plane. ``--cpu-frames``: per plane, the CPU path's zstd frames with the match
search (what a delta plane gets) against literals-only frames, ratio and speed on one thread.
JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from benchmarks import delta_bench
from benchmarks.common import markdown_table, write_results
from nvdcp.transform import delta as delta_transform

C = 64 << 10
MIN_ITEM_BYTES = 64 << 10
#: GPU candidates: (label, nvCOMP algorithm, options, decodable on the CPU by nvdcp)
GPU_CODECS = [
    *[(f"gdeflate{t}", "GDeflate", {"algorithm_type": t}, True) for t in range(6)],
    ("zstd-gpu", "Zstd", {}, True),
    ("ans", "ANS", {"data_type": "|u1"}, False),
]
CPU_ZSTD_LEVELS = (1, 3, 9)
CPU_SAMPLE_BYTES = 4 << 20
#: ``--cpu-frames``: compare the CPU path's two zstd frame kinds on every plane, in the chunks of
#: a delta writer (nvdcp.dcp.delta.DELTA_CHUNK_BYTES).
CPU_FRAMES = False
CPU_FRAMES_CHUNK = 32 << 10
TIMED_BYTES = 64 << 20


def item_class(key: str) -> str:
    for suffix in ("exp_avg_sq", "exp_avg"):
        if key.endswith(suffix):
            return suffix
    return "weights"


def flat_items(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, torch.Tensor):
        out[prefix] = state
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(flat_items(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(flat_items(v, f"{prefix}.{i}"))
    return out


def delta_planes(new: dict[str, Any], old: dict[str, Any], device: str) -> dict[str, list[torch.Tensor]]:
    """Per item class: the byte planes of every eligible item's delta, each plane concatenated
    over the class's items (plane 0 = lowest byte)."""
    a, b = flat_items(new), flat_items(old)
    parts: dict[str, list[list[torch.Tensor]]] = {}
    for key, t in a.items():
        if not t.is_floating_point() or t.numel() * t.element_size() < MIN_ITEM_BYTES or key not in b:
            continue
        size = t.element_size()
        raw = t.detach().to(device).contiguous().view(-1).view(torch.uint8)
        base = b[key].detach().to(device).contiguous().view(-1).view(torch.uint8)
        d = delta_transform.encode_torch(raw, base, delta_transform.kind_for(t.dtype), size)
        planes = d.view(-1, size).t()
        group = parts.setdefault(item_class(key), [[] for _ in range(size)])
        for p in range(size):
            group[p].append(planes[p].contiguous())
    return {cls: [torch.cat(p) for p in planes] for cls, planes in parts.items()}


def gpu_stored_bytes(name: str, opts: dict[str, Any], plane: torch.Tensor, stream: torch.cuda.Stream) -> dict[str, Any]:
    """Stored bytes of ``plane`` in 64 KiB chunks (a chunk stored raw where it does not shrink)
    and encode GB/s on its first TIMED_BYTES."""
    import nvidia.nvcomp as nv

    from benchmarks.gpu_probe import encode_raw

    codec = nv.Codec(algorithm=name, bitstream_kind=nv.BitstreamKind.RAW, uncomp_chunk_size=C,
                     cuda_stream=stream.cuda_stream, **opts)
    n = plane.numel()
    cap = -(-codec.get_max_comp_buffer_size(nv.as_array(plane[:C])) // 16) * 16
    res, _, _, sizes = encode_raw(codec, plane, n, cap, stream)
    comp = np.asarray(res.buffer_sizes, dtype=np.int64)
    stored = int(np.minimum(comp, np.asarray(sizes)).sum())
    part = plane[: min(n, TIMED_BYTES)]
    encode_raw(codec, part, part.numel(), cap, stream)  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        r, *_ = encode_raw(codec, part, part.numel(), cap, stream)
        _ = r.buffer_sizes
    torch.cuda.synchronize()
    return {"stored": stored, "encode_GBps": round(3 * part.numel() / (time.perf_counter() - t0) / 1e9, 2)}


def cpu_zstd_ratio(plane: torch.Tensor, level: int) -> float:
    import zstandard

    data = plane[:CPU_SAMPLE_BYTES].cpu().numpy().tobytes()
    cctx = zstandard.ZstdCompressor(level=level)
    stored = sum(min(len(cctx.compress(data[i : i + C])), len(data[i : i + C])) for i in range(0, len(data), C))
    return len(data) / stored


def cpu_frames(plane: torch.Tensor, chunk: int) -> dict[str, Any]:
    """The CPU path's two zstd frame kinds on ``plane`` in ``chunk``-byte ranges, one thread:
    what delta planes get (``for_sparse_planes``: level 1's search, a 64-entry table) against
    frames without the search (``for_float_planes``: Huffman-coded literals only), each a
    chunk stored raw where it does not shrink. Ratio and encode / decode MB/s (fastest of 3)."""
    from nvdcp.codecs.zstd import ZstdCodec

    data = np.ascontiguousarray(plane[:CPU_SAMPLE_BYTES * 4].cpu().numpy())
    offsets = np.arange(0, len(data), chunk, dtype=np.int64)
    lengths = np.minimum(chunk, len(data) - offsets)
    base = ZstdCodec()
    out: dict[str, Any] = {}
    for label, codec in (("search", base.for_sparse_planes()), ("literals", base.for_float_planes())):
        enc = dec = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            frames = codec.encode_ranges(data, offsets, lengths)
            enc = min(enc, time.perf_counter() - t0)
        sizes = np.fromiter((len(f) for f in frames), dtype=np.int64, count=len(frames))
        keep = sizes < lengths  # the others are stored raw
        packed = np.frombuffer(b"".join(bytes(f) for f, k in zip(frames, keep) if k), dtype=np.uint8)
        starts = np.concatenate(([0], np.cumsum(sizes[keep])[:-1])).astype(np.int64)
        for _ in range(3):
            t0 = time.perf_counter()
            codec.decode_ranges(packed, starts, sizes[keep], lengths[keep])
            dec = min(dec, time.perf_counter() - t0)
        stored = int(np.where(keep, sizes, lengths).sum())
        out[f"cpu_{label}_ratio"] = round(len(data) / stored, 4)
        out[f"cpu_{label}_encode_MBps"] = round(len(data) / enc / 1e6, 1)
        out[f"cpu_{label}_decode_MBps"] = round(int(lengths[keep].sum()) / max(dec, 1e-9) / 1e6, 1)
    return out


def probe_pair(variant: str, interval: int, new: dict[str, Any], old: dict[str, Any], device: str) -> list[dict[str, Any]]:
    rows = []
    stream = torch.cuda.Stream() if device == "cuda" else None
    for cls, planes in delta_planes(new, old, device).items():
        for p, plane in enumerate(planes):
            row: dict[str, Any] = {"variant": variant, "interval": interval, "class": cls, "plane": p,
                                   "raw": plane.numel()}
            for level in CPU_ZSTD_LEVELS:
                row[f"cpu_zstd{level}_ratio"] = round(cpu_zstd_ratio(plane, level), 4)
            if CPU_FRAMES:
                row.update(cpu_frames(plane, CPU_FRAMES_CHUNK))
            if stream is not None:
                with torch.cuda.stream(stream):
                    for label, name, opts, _ in GPU_CODECS:
                        try:
                            got = gpu_stored_bytes(name, opts, plane, stream)
                        except Exception as exc:  # an algorithm_type this nvCOMP lacks
                            row[f"{label}_error"] = repr(exc)[:200]
                            continue
                        row[f"{label}_ratio"] = round(plane.numel() / got["stored"], 4)
                        row[f"{label}_stored"] = got["stored"]
                        row[f"{label}_GBps"] = got["encode_GBps"]
            print(f"  {variant} {interval:>4} {cls:>10} plane {p}: "
                  + " ".join(f"{k[:-6]}={v}" for k, v in row.items() if k.endswith("_ratio")), flush=True)
            rows.append(row)
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant, interval and class: the delta ratio with GDeflate 0 everywhere and with the
    best CPU-decodable GPU codec per plane (and which)."""
    decodable = [label for label, _, _, ok in GPU_CODECS if ok]
    out: dict[tuple[str, int, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["variant"], r["interval"], r["class"])
        s = out.setdefault(key, {"variant": key[0], "interval": key[1], "class": key[2], "raw": 0,
                                 "gdeflate0": 0, "best": 0, "ans": 0, "choice": []})
        s["raw"] += r["raw"]
        if "gdeflate0_stored" not in r:
            continue
        s["gdeflate0"] += r["gdeflate0_stored"]
        s["ans"] += r.get("ans_stored", r["raw"])
        label = min((lb for lb in decodable if f"{lb}_stored" in r), key=lambda lb: r[f"{lb}_stored"])
        s["best"] += r[f"{label}_stored"]
        s["choice"].append(f"p{r['plane']}:{label}")
    result = []
    for s in out.values():
        if s["gdeflate0"]:
            s["ratio_gdeflate0"] = round(s["raw"] / s["gdeflate0"], 4)
            s["ratio_best"] = round(s["raw"] / s["best"], 4)
            s["ratio_ans"] = round(s["raw"] / s["ans"], 4)
        s["choice"] = " ".join(s["choice"])
        result.append(s)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--suffix", default=None)
    p.add_argument("--cpu-frames", action="store_true",
                   help="also time the CPU path's zstd frames with and without the match search per plane")
    own, rest = p.parse_known_args(argv)
    global CPU_FRAMES
    CPU_FRAMES = own.cpu_frames
    args = delta_bench.parse(rest)
    args.profile = False
    t0 = time.perf_counter()
    snaps, info = delta_bench.train(args)
    last = max(snaps)
    print(f"trained {info['steps']} steps in {info['train_s']} s", flush=True)
    rows: list[dict[str, Any]] = []
    for variant in args.variant_list:
        for interval in args.interval_list:
            new = delta_bench.variant_state(variant, snaps[last])
            old = delta_bench.variant_state(variant, snaps[last - interval])
            rows += probe_pair(variant, interval, new, old, args.device)
    summary = summarize(rows)
    print(markdown_table(summary, ["variant", "interval", "class", "raw", "ratio_gdeflate0", "ratio_best",
                                   "ratio_ans", "choice"]))
    payload = {"benchmark": "delta_codec_probe", "issue": 15, "device": args.device,
               "args": {k: v for k, v in vars(args).items() if k != "cfg"}, "workload": info,
               "chunk_bytes": C, "rows": rows, "summary": summary, "total_s": round(time.perf_counter() - t0, 1)}
    target = write_results("delta_codec_probe", payload, own.out, suffix=own.suffix or f"_{args.device}")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()

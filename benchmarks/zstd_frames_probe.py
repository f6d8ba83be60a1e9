"""zstd frames with and without the match search, on the planes nvdcp compresses on the CPU.

    python -m benchmarks.zstd_frames_probe [--repeats 3] [--threads 1] [--out DIR]

Compares, per plane set, the frames of ``ZstdCodec.for_sparse_planes()`` (level 1, the hash
table cut to 64 entries: the search-based frames) with those of ``for_float_planes()`` (no match
search, literals Huffman-coded: ``nvdcp.codecs.zstd_literals``): stored ratio, compression and
decompression time (fastest of ``--repeats``), each plane set's 64 KiB chunks in one
``encode_ranges`` / ``decode_ranges`` call. Plane sets:

- ``small_top``: the sign+exponent planes of ``cpu_pipeline_bench``'s small state (20,000 fp32 and
  bf16 tensors of 4 KiB-1 MiB): mostly 1-2 KiB chunks, what a small-tensor save compresses;
- ``fp32_top`` / ``bf16_top``: the top plane of 16 M weights (std 0.02): large tensors;
- ``delta_fp32_p2`` / ``delta_fp32_p3``: the two high planes of the XOR of fp32 weights before
  and after a step of ``2e-4 x randn`` (what a delta stores; runs of zero bytes).

Writes ``benchmarks/results/zstd_frames_probe_<date>.json``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from benchmarks.common import markdown_table, write_results
from nvdcp.codecs.base import PackedStreams
from nvdcp.codecs.zstd import ZstdCodec

CHUNK = 64 << 10


def _top(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.view(torch.uint8).numpy().reshape(-1, t.element_size())[:, -1])


def _chunked(planes: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The planes back to back, with each 64 KiB chunk's offset and length (chunks per plane)."""
    buf = np.ascontiguousarray(np.concatenate(planes))
    lengths = [min(CHUNK, p.size - at) for p in planes for at in range(0, p.size, CHUNK)]
    lengths_a = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(len(lengths_a), dtype=np.int64)
    np.cumsum(lengths_a[:-1], out=offsets[1:])
    return buf, offsets, lengths_a


def plane_sets() -> dict[str, list[np.ndarray]]:
    from benchmarks.cpu_pipeline_bench import small_state

    g = torch.Generator().manual_seed(0)
    weights = torch.randn(1 << 24, generator=g) * 0.02
    stepped = weights + torch.randn(1 << 24, generator=g) * 2e-4
    xor = (weights.view(torch.int32) ^ stepped.view(torch.int32)).view(torch.uint8).numpy().reshape(-1, 4)
    return {
        "small_top": [_top(t) for t in small_state().values()],
        "fp32_top": [_top(weights)],
        "bf16_top": [_top(weights.bfloat16())],
        "delta_fp32_p2": [np.ascontiguousarray(xor[:, 2])],
        "delta_fp32_p3": [np.ascontiguousarray(xor[:, 3])],
    }


def _best(fn: Any, repeats: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def measure(name: str, planes: list[np.ndarray], repeats: int, threads: int) -> list[dict[str, Any]]:
    buf, offsets, lengths = _chunked(planes)
    rows = []
    base = ZstdCodec()
    for frames, codec in (("search", base.for_sparse_planes()), ("literals", base.for_float_planes())):
        encode_s, streams = _best(lambda c=codec: c.encode_ranges(buf, offsets, lengths, threads), repeats)
        if isinstance(streams, PackedStreams):
            sizes, packed = streams.lengths, streams.data
        else:
            sizes = np.fromiter(map(len, streams), dtype=np.int64, count=len(lengths))
            packed = np.frombuffer(b"".join(streams), dtype=np.uint8)
        at = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1], out=at[1:])
        decode_s, _ = _best(lambda: base.decode_ranges(packed, at, sizes, lengths, threads), repeats)
        rows.append({
            "planes": name, "frames": frames, "chunks": len(lengths), "MB": buf.size / 1e6,
            "ratio": buf.size / int(sizes.sum()), "encode_s": encode_s, "encode_GB/s": buf.size / encode_s / 1e9,
            "decode_s": decode_s, "decode_GB/s": buf.size / decode_s / 1e9,
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--suffix", default="")
    args = ap.parse_args(argv)
    codec = ZstdCodec()
    if codec.for_float_planes() is codec.for_sparse_planes():
        raise SystemExit("zstandard's cffi backend is missing (pip install zstandard[cffi]): nothing to compare")
    rows = [r for name, planes in plane_sets().items() for r in measure(name, planes, args.repeats, args.threads)]
    print(markdown_table(rows, ["planes", "frames", "chunks", "MB", "ratio", "encode_s", "encode_GB/s",
                                "decode_s", "decode_GB/s"]))
    path = write_results("zstd_frames_probe", {"threads": args.threads, "repeats": args.repeats, "rows": rows},
                         args.out, suffix=args.suffix)
    print(f"-> {path}")


if __name__ == "__main__":
    main()

"""Should a CPU delta plane's zstd frames depend on how many of its bytes are zero? (issue 15)

    python -m benchmarks.delta_zero_share_probe [--elements 1048576] [--no-real] [--out DIR] [--suffix S]

A CPU delta plane is coded as zstd frames with the match search (``ZstdCodec.for_sparse_planes``),
a float's sign+exponent plane in a full save as literal frames (no search,
``nvdcp.codecs.zstd_literals``). Both are ordinary zstd frames, so a writer could pick either per
plane without a format change. This probe measures, in 64 KiB chunks on one thread, both frame
kinds' ratio and encode speed on:

- ``synthetic``: the zigzag differences (``nvdcp.transform.delta``) of randn * 0.02 weights and
  the same weights moved by randn * 0.02 * rel, fp32 and bf16, rel from 1e-1 to 1e-5: planes
  from almost no zero bytes to almost all, with the share of zero bytes in the plane's first
  chunk beside each row;
- ``real`` (unless ``--no-real``): the deltas of ``benchmarks.delta_bench``'s CPU model 10 steps
  apart near peak LR, each class's tensors joined (as ``delta_save_ab --large-items`` does), with
  the range of the zero share over the plane's chunks.

Prints both tables and writes ``delta_zero_share_probe_<date><suffix>.json``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

import numpy as np
import torch

from benchmarks.common import markdown_table, write_results
from nvdcp.codecs.zstd import ZstdCodec
from nvdcp.codecs.zstd_literals import literals_compressor
from nvdcp.pipeline.cpu import split_planes
from nvdcp.transform import delta as delta_transform

CHUNK = 64 << 10


def _stored(streams: Any) -> int:
    data = getattr(streams, "data", None)
    return int(data.size) if data is not None else sum(len(bytes(s)) for s in streams)


def _frames(plane: np.ndarray) -> dict[str, Any]:
    """Both frame kinds on ``plane``'s chunks: ratio and GB/s, and the zero shares of its chunks."""
    plane = np.ascontiguousarray(plane)
    offsets = np.arange(0, plane.size, CHUNK, dtype=np.int64)
    lengths = np.minimum(CHUNK, plane.size - offsets)
    zeros = [1 - np.count_nonzero(plane[o : o + n]) / n for o, n in zip(offsets.tolist(), lengths.tolist())]
    row: dict[str, Any] = {"mb": plane.size / 1e6, "zeros_first": zeros[0], "zeros_min": min(zeros),
                           "zeros_max": max(zeros)}
    sparse, literals = ZstdCodec().for_sparse_planes(), literals_compressor()
    coders = {"search": lambda: sparse.encode_ranges(plane, offsets, lengths, 1),
              "literals": lambda: literals.compress_ranges(plane, offsets, lengths, 1)}  # type: ignore[union-attr]
    for name, code in coders.items():
        code()  # warm: contexts, first touch of the output
        t = time.perf_counter()
        n = _stored(code())
        row[f"{name}_ratio"] = plane.size / n
        row[f"{name}_GBps"] = plane.size / (time.perf_counter() - t) / 1e9
    row["smaller"] = "literals" if row["literals_ratio"] >= row["search_ratio"] else "search"
    return row


def _delta_planes(old: torch.Tensor, new: torch.Tensor) -> np.ndarray:
    size = old.element_size()
    diff = delta_transform.encode_np(new.contiguous().view(torch.uint8).numpy().reshape(-1),
                                     old.contiguous().view(torch.uint8).numpy().reshape(-1),
                                     delta_transform.kind_for(old.dtype), size)
    return split_planes(diff, size)


def synthetic(elements: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(elements, generator=g) * 0.02
    rows = []
    for rel in np.geomspace(1e-1, 1e-5, 13).tolist():
        moved = weights - torch.randn(elements, generator=g) * 0.02 * rel
        for dtype in (torch.float32, torch.bfloat16):
            for p, plane in enumerate(_delta_planes(weights.to(dtype), moved.to(dtype))):
                rows.append({"dtype": str(dtype).replace("torch.", ""), "rel": rel, "plane": p, **_frames(plane)})
    return rows


def real() -> list[dict[str, Any]]:
    from benchmarks import delta_bench
    from benchmarks.delta_save_ab import joined

    snaps, _ = delta_bench.train(delta_bench.parse(["--device", "cpu", "--intervals", "10", "--checkpoints", "2"]))
    first, last = sorted(snaps)
    rows = []
    for variant in ("fp32_adamw", "bf16_weights"):
        old = joined(delta_bench.variant_state(variant, snaps[first]))
        new = joined(delta_bench.variant_state(variant, snaps[last]))
        for key in new:
            for p, plane in enumerate(_delta_planes(old[key], new[key])):
                rows.append({"variant": variant, "items": key, "plane": p, **_frames(plane)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 20)
    ap.add_argument("--no-real", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--suffix", default="")
    args = ap.parse_args(argv)
    if literals_compressor() is None:
        raise SystemExit("zstd's cffi backend is missing: no literal frames to compare")
    warnings.filterwarnings("ignore", category=UserWarning)
    columns = ["zeros_first", "zeros_min", "zeros_max", "search_ratio", "search_GBps", "literals_ratio",
               "literals_GBps", "smaller"]
    rows = sorted(synthetic(args.elements), key=lambda r: r["zeros_first"])
    print(markdown_table(rows, ["dtype", "rel", "plane", *columns]))
    real_rows = [] if args.no_real else real()
    if real_rows:
        print(markdown_table(real_rows, ["variant", "items", "plane", *columns]))
    path = write_results("delta_zero_share_probe", {"benchmark": "delta_zero_share_probe", "issue": 15,
                                                    "chunk_bytes": CHUNK, "synthetic": rows, "real": real_rows},
                         args.out, args.suffix)
    print(f"-> {path}")


if __name__ == "__main__":
    main()

"""Would a scaled base help AdamW's moments? Delta sizes against ``base`` and against ``s * base`` (issue 15).

    python -m benchmarks.delta_predictor_probe [--device cpu|cuda] [--warm-steps 200] [--gap 10]
        [--lr-total 1200] [--out DIR] [--suffix _cpu]

AdamW decays its moments every step (``exp_avg`` by beta1, ``exp_avg_sq`` by beta2), so ``gap``
steps later each is close to ``beta^gap`` times its old value plus the new gradients' part. A
delta taken against the old value scaled that way (``fl(s * base)`` in fp32, then the zigzag
difference of the bit patterns, as nvdcp's ``ZIGZAG_DIFF`` takes against the base itself) would
be smaller if the decay were most of the change. This probe trains ``delta_bench``'s model
(``GPTConfig()`` on the CPU, the reference on CUDA), takes the fp32 AdamW state at
``warm-steps`` and ``warm-steps + gap``, and codes every tensor of at least 16,384 elements as
nvdcp's CPU path would code a delta record's planes (4 byte planes, zstd level 1 with the sparse
planes' settings in 64 KiB chunks, a chunk kept raw where zstd does not shrink it): whole, the
delta against the base, against ``beta^gap * base`` and against a least-squares scale. Prints
the ratios per kind and for the state (each kind whole where that is smaller), writes
``delta_predictor_probe_<date><suffix>.json``. A measurement for a format decision, not a feature.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from benchmarks import delta_bench
from benchmarks.common import write_results
from nvdcp.codecs.zstd import SPARSE_PLANE_HASH_LOG
from nvdcp.transform.delta import ZIGZAG_DIFF, delta_np

BETAS = {"exp_avg": 0.9, "exp_avg_sq": 0.999}  # torch.optim.AdamW's defaults, which delta_bench trains with
CHUNK = 64 << 10
MIN_ELEMENTS = 16_384


def _coded(raw: np.ndarray, compressor: zstandard.ZstdCompressor) -> int:
    """Bytes of ``raw`` (fp32 bit patterns as uint8) in 4 planes, each zstd-coded per chunk."""
    total = 0
    for plane in raw.reshape(-1, 4).T:
        plane = np.ascontiguousarray(plane)
        for at in range(0, len(plane), CHUNK):
            chunk = plane[at : at + CHUNK]
            total += min(len(compressor.compress(chunk.data)), len(chunk))
    return total


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().reshape(-1)


def _delta_size(x: torch.Tensor, base: torch.Tensor, scale: float | None, compressor: zstandard.ZstdCompressor) -> int:
    predicted = base if scale is None else base * torch.tensor(scale, dtype=torch.float32, device=base.device)
    diff, _ = delta_np(_bytes(x), _bytes(predicted), ZIGZAG_DIFF, 4)
    return _coded(diff, compressor)


def probe(args: argparse.Namespace) -> dict[str, Any]:
    bench_args = delta_bench.parse(["--device", args.device, "--intervals", str(args.gap), "--checkpoints", "2",
                                    "--warm-steps", str(args.warm_steps), "--lr-total", str(args.lr_total),
                                    "--variants", "fp32_adamw"])
    t0 = time.perf_counter()
    snaps, info = delta_bench.train(bench_args)
    info["train_s"] = round(time.perf_counter() - t0, 1)
    old, new = snaps[min(snaps)], snaps[max(snaps)]
    compressor = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters.from_level(
        1, hash_log=SPARSE_PLANE_HASH_LOG, write_content_size=True))
    kinds: dict[str, dict[str, int]] = {k: dict.fromkeys(("raw", "whole", "delta", "beta", "fit"), 0)
                                        for k in ("param", *BETAS)}

    def add(kind: str, x: torch.Tensor, base: torch.Tensor, beta: float | None) -> None:
        if x.numel() < MIN_ELEMENTS or x.dtype != torch.float32:
            return
        xs, bs = x.double().flatten(), base.double().flatten()
        fit = float((xs * bs).sum() / (bs * bs).sum()) if bool((bs != 0).any()) else 1.0
        row = kinds[kind]
        row["raw"] += x.numel() * 4
        row["whole"] += _coded(_bytes(x), compressor)
        row["delta"] += _delta_size(x, base, None, compressor)
        row["beta"] += _delta_size(x, base, beta, compressor)
        row["fit"] += _delta_size(x, base, fit, compressor)

    for name, x in new["model"].items():
        add("param", x, old["model"][name], None)
    for key, state in new["optim"]["state"].items():
        for kind, beta in BETAS.items():
            add(kind, state[kind], old["optim"]["state"][key][kind], beta ** args.gap)
    modes = ("whole", "delta", "beta", "fit")
    ratios = {kind: {m: round(row["raw"] / row[m], 4) for m in modes} for kind, row in kinds.items()}
    raw = sum(row["raw"] for row in kinds.values())
    state = {m: round(raw / sum(min(row[m], row["whole"]) for row in kinds.values()), 4) for m in modes}
    return {"training": info, "steps": sorted(snaps), "bytes": kinds, "ratios": ratios, "state_ratio": state,
            "notes": ["param rows: 'beta' is the plain delta (no decay); 'fit': least-squares scale per tensor",
                      "state_ratio: each kind stored whole where that is smaller, as DeltaPolicy's min_gain does"]}


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--warm-steps", type=int, default=200)
    p.add_argument("--gap", type=int, default=10)
    p.add_argument("--lr-total", type=int, default=1200)
    p.add_argument("--out", default=None)
    p.add_argument("--suffix", default="")
    args = p.parse_args(argv)
    result = probe(args)
    for kind, r in result["ratios"].items():
        print(f"{kind:11s} whole {r['whole']:.3f}x  delta {r['delta']:.3f}x  beta^gap-scaled {r['beta']:.3f}x  "
              f"fitted scale {r['fit']:.3f}x")
    print("state:", result["state_ratio"])
    path = write_results("delta_predictor_probe", {"benchmark": "delta_predictor_probe", "issue": 15,
                                                   "device": args.device, "args": vars(args), **result},
                         args.out, args.suffix)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()

"""Codec benchmark (issue 7): ratio and GB/s of every codec this machine runs, per dtype.

    python -m benchmarks.codec_bench [PATH_OR_URL] [--steps 20] [--d-model 256] [--layers 4] [--out DIR]

Without PATH: the CPU reference workload (tiny GPT + AdamW, fp32 state and a bf16 copy); with
PATH: every tensor of that checkpoint. Each tensor is encoded and decoded by the writer's item
pipeline (byte planes + codec + CRC32C), checked bit-exact. Writes
benchmarks/results/codec_bench_<date>.json (schema ``nvdcp.codec_bench/1``, as ``nvdcp bench
--json``) and a PNG chart beside it, and prints a markdown table. ``nvdcp bench`` is the same
measurement for users; this script records it for the repository.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import markdown_table, write_results
from nvdcp import codec_bench as bench


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", help="a checkpoint to bench instead of the reference workload")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--codec", action="append", choices=[*bench.CPU_CODECS, *bench.GPU_CODECS])
    p.add_argument("--no-bf16", action="store_true")
    p.add_argument("--out", help="results folder (default benchmarks/results)")
    args = p.parse_args(argv)

    if args.path:
        source = {"name": Path(args.path.rstrip("/")).name, "path": args.path}
        result = bench.run_bench(lambda: bench.checkpoint_tensors(args.path, None), source, codecs=args.codec)
    else:
        state = bench.reference_state(steps=args.steps, d_model=args.d_model, layers=args.layers)
        source = {"name": "reference workload", "workload": "tiny GPT + AdamW", "steps": args.steps,
                  "d_model": args.d_model, "layers": args.layers, "bf16_copy": not args.no_bf16}
        result = bench.run_bench(lambda: bench.workload_tensors(state, not args.no_bf16), source, codecs=args.codec)
    payload = result.as_dict()
    target = write_results("codec_bench", payload, args.out)
    chart = target.with_suffix(".png")
    bench.plot(result, str(chart))
    rows = [r.as_dict() for r in result.rows + result.totals()]
    print(markdown_table(rows, ["codec", "device", "dtype", "items", "raw_bytes", "stored_bytes", "ratio",
                                "encode_gbps", "decode_gbps"]))
    print(f"\nwrote {target} and {chart}")
    return target


if __name__ == "__main__":
    main()

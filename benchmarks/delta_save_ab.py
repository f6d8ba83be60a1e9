"""A delta save's time against a full save's, at the default settings, for comparing two trees.

    python benchmarks/delta_save_ab.py [--rounds 5] [--root /dev/shm/dsab] [--out DIR] [--suffix _new_r1]
        [--device cpu] [--loads] [--switch NVDCP_SOME_SWITCH] [--train "--lr-total 200"] [--large-items]

Trains the reference GPT (``benchmarks.delta_bench``'s workload on ``--device``, two snapshots 10
steps apart near peak LR), then per variant (fp32 AdamW state, bf16 weights) saves, each round: the
first snapshot whole with a ``DeltaPolicy``, the second as a delta against it (timed) and the
second as a full checkpoint (timed); with ``--loads`` each is then loaded into a preallocated
state (timed; the delta's load reads its base too) and checked bit-exact. The first round warms
up; medians of the rest, their ratios and the stored bytes are printed and written to
``delta_save_ab_<date><suffix>.json``. ``--switch ENV`` times one tree twice, in one process: each
round with ``ENV=1`` and ``ENV=0`` in turn (the order alternating), one row per setting.

Run as a file, it takes ``nvdcp`` and ``benchmarks`` from ``PYTHONPATH``: point that at another
checkout to time its code with the same driver (``PYTHONPATH=/old/tree python
benchmarks/delta_save_ab.py``), one process per tree, alternating rounds (the machines are noisy).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import time
import warnings
from typing import Any

import torch


def timed(fn: Any) -> float:
    gc.collect()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def stored_bytes(path: str) -> int:
    import os

    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def joined(state: Any) -> dict[str, torch.Tensor]:
    """The state's floating-point tensors of each class (weights, ``exp_avg``, ``exp_avg_sq``)
    joined into one flat tensor per class and dtype: items whose byte planes run to hundreds of
    chunks, as a large model's do, with the same bytes as the small model's deltas."""
    from benchmarks.delta_codec_probe import flat_items, item_class

    groups: dict[str, list[torch.Tensor]] = {}
    for key, t in flat_items(state).items():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            groups.setdefault(f"{item_class(key)}.{t.dtype}".replace("torch.", ""), []).append(t.reshape(-1))
    return {k: torch.cat(v) for k, v in groups.items()}


def one_round(variant: str, base: Any, state: Any, root: str, loads: bool) -> tuple[dict[str, float], dict[str, int]]:
    """One round: the base saved whole, then the state as a delta (timed) and whole (timed);
    with ``loads`` each loaded back (timed, checked bit-exact). Seconds and stored bytes."""
    import torch.distributed.checkpoint as dcp

    import nvdcp
    from benchmarks.workload import states_equal, zeros_like_state

    shutil.rmtree(root, ignore_errors=True)
    policy = nvdcp.DeltaPolicy(full_every=100)
    dcp.save(base, storage_writer=nvdcp.NvcompWriter(f"{root}/base", delta=policy), no_dist=True)
    got = {"delta": timed(lambda: dcp.save(state, storage_writer=nvdcp.NvcompWriter(f"{root}/delta", delta=policy),
                                           no_dist=True)),
           "full": timed(lambda: dcp.save(state, storage_writer=nvdcp.NvcompWriter(f"{root}/full"), no_dist=True))}
    for name in ("delta", "full") if loads else ():
        target = zeros_like_state(state)
        got[f"{name}_load"] = timed(lambda: dcp.load(target, storage_reader=nvdcp.NvcompReader(f"{root}/{name}"),
                                                     no_dist=True))
        if not states_equal(target, state):
            raise SystemExit(f"{variant}: the {name} checkpoint did not load bit-exact")
    return got, {k: stored_bytes(f"{root}/{k}") for k in ("delta", "full")}


def summary(variant: str, setting: str | None, times: dict[str, list[float]], nbytes: dict[str, int]) -> dict[str, Any]:
    """A row of medians and ratios, printed."""
    med = {k: statistics.median(v) for k, v in times.items()}
    row: dict[str, Any] = {"variant": variant, "setting": setting, "seconds": times, "median_s": med,
                           "stored_bytes": nbytes, "delta_over_full": round(med["delta"] / med["full"], 3)}
    line = f"{variant}: delta {med['delta']:.4f} s, full {med['full']:.4f} s, ratio {row['delta_over_full']}"
    if "delta_load" in med:
        row["load_delta_over_full"] = round(med["delta_load"] / med["full_load"], 3)
        line += f"; loads delta {med['delta_load']:.4f} s, full {med['full_load']:.4f} s, ratio {row['load_delta_over_full']}"
    label = f"[{setting}] " if setting is not None else ""
    print(f"{label}{line}; stored delta {nbytes['delta']:,} B, full {nbytes['full']:,} B", flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--root", default="/dev/shm/dsab")
    p.add_argument("--out", default=None)
    p.add_argument("--suffix", default="")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--loads", action="store_true", help="also time loads of the delta and the full checkpoint")
    p.add_argument("--switch", default=None, metavar="ENV",
                   help="an environment switch of nvdcp: every round runs with ENV=1 and ENV=0, alternating")
    p.add_argument("--large-items", action="store_true",
                   help="join each class's tensors into one (planes of hundreds of chunks; see joined())")
    p.add_argument("--train", default="", help="extra benchmarks.delta_bench arguments, e.g. '--lr-total 200' (one option alone: --train=--small)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("delta_save_ab --device cuda needs CUDA")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    import os

    import nvdcp
    from benchmarks import delta_bench
    from benchmarks.common import write_results

    train = ["--device", args.device, "--intervals", "10", "--checkpoints", "2", *args.train.split()]
    snaps, _ = delta_bench.train(delta_bench.parse(train))
    first, last = sorted(snaps)
    settings: list[str | None] = ["1", "0"] if args.switch else [None]
    rows = []
    try:
        for variant in ("fp32_adamw", "bf16_weights"):
            base, state = delta_bench.variant_state(variant, snaps[first]), delta_bench.variant_state(variant, snaps[last])
            if args.large_items:
                base, state = joined(base), joined(state)
            times: dict[str | None, dict[str, list[float]]] = {s: {} for s in settings}
            nbytes: dict[str | None, dict[str, int]] = {}
            for r in range(args.rounds):
                for setting in settings if r % 2 == 0 else settings[::-1]:
                    if setting is not None:
                        os.environ[args.switch] = setting
                    got, nbytes[setting] = one_round(variant, base, state, args.root, args.loads)
                    for k, v in got.items():
                        times[setting].setdefault(k, []).extend([v] if r else [])
            rows += [summary(variant, s, times[s], nbytes[s]) for s in settings]
    finally:
        shutil.rmtree(args.root, ignore_errors=True)
        if args.switch:
            os.environ.pop(args.switch, None)
    path = write_results("delta_save_ab", {"benchmark": "delta_save_ab", "issue": 15, "nvdcp": nvdcp.__file__,
                                           "device": args.device, "switch": args.switch, "train": train,
                                           "large_items": args.large_items,
                                           "rows": rows}, args.out, args.suffix)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())

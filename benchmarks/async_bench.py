"""async_save benchmark (issue 5): how long training is blocked, peak pinned host memory, time
until the checkpoint is durable; nvdcp's stager against torch's DefaultStager.

    python -m benchmarks.async_bench [--steps 400] [--saves 3] [--dir /tmp/nvdcp-async-bench] [--out DIR]
    python -m benchmarks.async_bench --small          # tiny model on the CPU (smoke test)

Workload: the GPU reference (benchmarks/workload.py ``train_state("cuda", GPTConfig.reference(),
batch=32)``: 1.03 GB of fp32 params + AdamW moments, on the GPU). Each variant saves it
``--saves`` times with ``dcp.async_save`` (THREAD mode, one process). After each call returns,
the benchmark waits until the staged copy is safe (DefaultStager's staging future, when it has
one), then does what the next training step would: overwrites every tensor of the live state
in place; then it waits for the upload. Per save:

- ``blocked_s``: from the async_save call until training may modify the state again;
- ``durable_s``: from the call until the checkpoint is committed (data fsynced, ``.metadata``
  renamed into place);
- ``peak_pinned_MiB``: page-locked host memory held for the save (DefaultStager: the pinned
  storages of the state dict it staged, measured with ``is_pinned``; nvdcp: the stager's kept
  buffers, whose pinned segments are powers of two, plus the GPU encoder's pinned pool).

The first save of a variant allocates (and pins) its buffers; later saves reuse them: the table
shows the first save and the mean of the others (on torch < 2.13 each DefaultStager serves one
save only: reusing one crashes there). The last save of each variant is loaded back and
compared bit for bit with a snapshot taken before the state was overwritten. Prints a table and
writes benchmarks/results/async_bench_<date>.json (or --out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import nvdcp
from benchmarks.common import dir_bytes, fresh_dir, markdown_table, pinned_peak, write_results
from benchmarks.workload import states_equal, tensor_bytes, train_state, zeros_like_state
from nvdcp.dcp.stager import NvcompStager
from nvdcp.demo.model import GPTConfig

MiB = 1 << 20


def snapshot(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [snapshot(v) for v in state]
    return state


def next_step(state: Any) -> None:
    """Overwrite every tensor in place, as the optimizer step after a save would."""
    if isinstance(state, torch.Tensor):
        if state.is_floating_point():
            state.mul_(0.5)
        else:
            state.add_(1)
    elif isinstance(state, dict):
        for v in state.values():
            next_step(v)
    elif isinstance(state, list):
        for v in state:
            next_step(v)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def pinned_bytes_of(state: Any) -> int:
    """Page-locked bytes behind the tensors of ``state`` (each storage counted once)."""
    seen: dict[int, int] = {}

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu" and obj.numel() and obj.is_pinned():
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(state)
    return sum(seen.values())


class MeasuredDefaultStager(DefaultStager):
    """torch's DefaultStager, unchanged, plus a measurement: the pinned bytes of what it staged
    (it pins every host copy of 5 bytes or more with cudaHostRegister)."""

    pinned_peak = 0

    def stage(self, state_dict: Any) -> Any:
        staged = super().stage(state_dict)
        if isinstance(staged, Future):
            staged.add_done_callback(lambda f: self._measure(f.result()))
        else:
            self._measure(staged)
        return staged

    def _measure(self, staged: Any) -> None:
        self.pinned_peak = max(self.pinned_peak, pinned_bytes_of(staged))


#: torch 2.11 crashes when one DefaultStager serves several saves (fixed in 2.13): a fresh one per save there.
REUSE_DEFAULT_STAGER = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


class Variant:
    """One way of saving: a writer factory and a stager factory (none: plain dcp.save)."""

    def __init__(self, name: str, writer: Callable[[str], Any], reader: Callable[[str], Any],
                 make_stager: Callable[[], Any] | None = None, sync_save: bool = False,
                 reuse_stager: bool = REUSE_DEFAULT_STAGER) -> None:
        self.name, self.writer, self.reader, self.sync_save = name, writer, reader, sync_save
        self.reuse_stager = reuse_stager
        self.make_stager = make_stager
        self.stager: Any = None
        self.peak_pinned = 0
        self.default_stager_peak = 0

    def _stager(self) -> Any:
        if self.make_stager is None:
            return None
        if self.stager is not None and isinstance(self.stager, DefaultStager) and not self.reuse_stager:
            self.close()
        if self.stager is None:
            self.stager = self.make_stager()
        return self.stager

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def _pinned_now(self, writer: Any) -> int:
        encoders = pinned_peak(writer, self.stager)  # the GPU encoders' pinned pools
        if isinstance(self.stager, NvcompStager):
            buffers = self.stager._buffers
            return (buffers.pinned_bytes if buffers is not None else 0) + encoders
        if isinstance(self.stager, MeasuredDefaultStager):
            self.default_stager_peak = max(self.default_stager_peak, self.stager.pinned_peak)
            return self.default_stager_peak + encoders
        return encoders

    def save(self, state: Any, path: str) -> tuple[float, float]:
        """One save; returns (blocked_s, durable_s)."""
        sync()
        writer = self.writer(path)
        t0 = time.perf_counter()
        if self.sync_save:
            dcp.save(state, storage_writer=writer)
            sync()
            done = time.perf_counter() - t0
            self.peak_pinned = max(self.peak_pinned, self._pinned_now(writer))
            return done, done
        response = dcp.async_save(state, storage_writer=writer, async_stager=self._stager())
        if isinstance(response, Future):
            upload = response
        else:  # AsyncSaveResponse: staging runs in the background too
            response.staging_completion.result()
            upload = response.upload_completion
        blocked = time.perf_counter() - t0
        next_step(state)
        upload.result()
        durable = time.perf_counter() - t0
        self.peak_pinned = max(self.peak_pinned, self._pinned_now(writer))
        return blocked, durable


def run(variant: Variant, state: Any, root: str, saves: int) -> dict[str, Any]:
    path = fresh_dir(os.path.join(root, variant.name.replace(" ", "_").replace("/", "_")))
    nvdcp.release_resources()  # earlier variants' pinned pools: freed, so this variant's peak is its own
    blocked, durable = [], []
    want = None
    for i in range(saves):
        if i == saves - 1:
            want = snapshot(state)
        b, d = variant.save(state, os.path.join(path, f"save{i}"))
        blocked.append(b)
        durable.append(d)
    last = os.path.join(path, f"save{saves - 1}")
    target = zeros_like_state(want)
    dcp.load(target, storage_reader=variant.reader(last))
    exact = states_equal(want, target)
    del target, want
    row = {
        "variant": variant.name, "bytes": dir_bytes(last),
        "blocked_first_s": round(blocked[0], 4), "durable_first_s": round(durable[0], 4),
        "blocked_s": round(statistics.mean(blocked[1:] or blocked), 4),
        "durable_s": round(statistics.mean(durable[1:] or durable), 4),
        "peak_pinned_MiB": round(variant.peak_pinned / MiB, 1), "bit_exact": exact,
    }
    if isinstance(variant.stager, NvcompStager) and variant.stager.last_stats is not None:
        s = variant.stager.last_stats
        row["stage"] = {"gpu_shards": s.gpu_shards, "compressed_shards": s.compressed_shards,
                        "copied_shards": s.copied_shards, "staged_bytes": s.staged_bytes,
                        "temp_bytes": s.temp_bytes}
    variant.close()
    return row


def variants(small: bool, reuse_default_stager: bool = False) -> list[Variant]:
    stock_reader = dcp.FileSystemReader
    ours_reader = nvdcp.NvcompReader
    cuda = torch.cuda.is_available()
    out = [
        Variant("stock sync dcp.save", dcp.FileSystemWriter, stock_reader, sync_save=True),
        Variant("nvdcp sync dcp.save", nvdcp.NvcompWriter, ours_reader, sync_save=True),
        # torch's stager: a host copy of the whole state, pinned with CUDA (blocking; then also async).
        Variant("stock + DefaultStager", dcp.FileSystemWriter, stock_reader,
                lambda: MeasuredDefaultStager(StagingOptions(cuda, False, False, cuda))),
        Variant("nvdcp writer + DefaultStager", nvdcp.NvcompWriter, ours_reader,
                lambda: MeasuredDefaultStager(StagingOptions(cuda, False, False, cuda))),
        Variant("nvdcp + NvcompStager", nvdcp.NvcompWriter, ours_reader, NvcompStager),
    ]
    if cuda:
        out.insert(3, Variant("stock + DefaultStager, async staging", dcp.FileSystemWriter, stock_reader,
                              lambda: MeasuredDefaultStager(StagingOptions(True, False, True, True))))
    if reuse_default_stager and not REUSE_DEFAULT_STAGER:
        # One DefaultStager for every save, as torch >= 2.13 allows: its pinned copies are reused,
        # so later saves pay only the copy. Tried on older torch on request (it may fail there).
        out.insert(3, Variant("stock + DefaultStager, reused", dcp.FileSystemWriter, stock_reader,
                              lambda: MeasuredDefaultStager(StagingOptions(cuda, False, False, cuda)),
                              reuse_stager=True))
    if small or not cuda:
        out.append(Variant("nvdcp + NvcompStager cpu compress", nvdcp.NvcompWriter, ours_reader,
                           lambda: NvcompStager(cpu_mode="compress")))
    return out


def profile_stage(state: Any, repeats: int = 4) -> None:
    """Stage ``state`` with NvcompStager a few times (no saves) and print where the last took time."""
    import cProfile
    import pstats

    from nvdcp.dcp.stager import StagedTensor, release_staged

    def shards(obj: Any) -> list[Any]:
        if isinstance(obj, StagedTensor):
            return obj.staged_shards
        if isinstance(obj, dict):
            return [s for v in obj.values() for s in shards(v)]
        if isinstance(obj, list):
            return [s for v in obj for s in shards(v)]
        return []

    stager = NvcompStager()
    profiler = cProfile.Profile()
    for i in range(repeats):
        sync()
        if i == repeats - 1:
            profiler.enable()
        staged = stager.stage(state)
        if i == repeats - 1:
            profiler.disable()
        held = shards(staged)
        for shard in held:
            _ = shard.encoded  # waits for the background records (GPU staging)
        release_staged(held)
        del staged, held
        print(f"stage {i}: {stager.last_stats}", flush=True)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
    stager.close()


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 5's targets: NvcompStager blocks no longer than DefaultStager (pinned) and pins at
    most DefaultStager's pinned bytes / 1.15 (mean of the saves after the first, peak pinned)."""
    by_name = {r["variant"]: r for r in rows if "error" not in r}
    ours, theirs = by_name.get("nvdcp + NvcompStager"), by_name.get("stock + DefaultStager")
    if ours is None or theirs is None or not theirs["peak_pinned_MiB"]:
        return {}
    return {
        "blocked_s": [ours["blocked_s"], theirs["blocked_s"]],
        "blocked_met": ours["blocked_s"] <= theirs["blocked_s"],
        "pinned_MiB": [ours["peak_pinned_MiB"], theirs["peak_pinned_MiB"]],
        "pinned_reduction": round(theirs["peak_pinned_MiB"] / max(ours["peak_pinned_MiB"], 1e-9), 3),
        "pinned_met": ours["peak_pinned_MiB"] * 1.15 <= theirs["peak_pinned_MiB"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="training steps before the saves")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--saves", type=int, default=3, help="saves per variant (the first allocates buffers)")
    ap.add_argument("--dir", default="/tmp/nvdcp-async-bench")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    ap.add_argument("--small", action="store_true", help="tiny model, a few steps, on the CPU (smoke test)")
    ap.add_argument("--reuse-default-stager", action="store_true",
                    help="on torch < 2.13 also try one DefaultStager for every save (torch >= 2.13 always does)")
    ap.add_argument("--only", default=None, help="run only the variants whose name contains this text")
    ap.add_argument("--profile-stage", action="store_true",
                    help="profile NvcompStager.stage on the workload first (prints the hot spots)")
    args = ap.parse_args(argv)
    if args.small:
        device, cfg = "cpu", GPTConfig(d_model=64, n_layers=2, n_heads=4, context=32)
        steps, batch, saves = min(args.steps, 2), min(args.batch, 4), min(args.saves, 2)
    else:
        if not torch.cuda.is_available():
            print("the reference workload needs a GPU; use --small on the CPU", file=sys.stderr)
            return 2
        device, cfg, steps, batch, saves = "cuda", GPTConfig.reference(), args.steps, args.batch, args.saves
    t0 = time.perf_counter()
    state, loss = train_state(device, cfg=cfg, steps=steps, batch=batch)
    results: dict[str, Any] = {
        "workload": {"device": device, "config": cfg.__dict__, "steps": steps, "batch": batch,
                     "final_loss": round(loss, 3), "train_s": round(time.perf_counter() - t0, 1),
                     "raw_bytes": tensor_bytes(state), "saves_per_variant": saves},
        "rows": [],
    }
    raw = tensor_bytes(state)
    if args.profile_stage:
        profile_stage(state)
    for variant in [v for v in variants(args.small, args.reuse_default_stager)
                    if args.only is None or args.only in v.name]:
        try:
            row = run(variant, state, args.dir, saves)
            row["ratio"] = round(raw / row["bytes"], 4)
        except Exception as exc:
            row = {"variant": variant.name, "error": repr(exc)[:300]}
        results["rows"].append(row)
        print(row, flush=True)
        write_results("async_bench", results, args.out)  # incremental: a crash keeps what ran
    columns = ["variant", "blocked_first_s", "blocked_s", "durable_s", "bytes", "ratio", "peak_pinned_MiB",
               "bit_exact"]
    print(f"\nasync_save of {raw / 1e9:.3f} GB ({device}), {saves} saves per variant; "
          "blocked/durable: mean of the saves after the first\n")
    print(markdown_table(results["rows"], columns))
    results["targets"] = targets(results["rows"])
    print(f"\ntargets (issue 5): {results['targets']}")
    target = write_results("async_bench", results, args.out)
    print(f"\nwrote {target}")
    return 0 if all(r.get("bit_exact") for r in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())

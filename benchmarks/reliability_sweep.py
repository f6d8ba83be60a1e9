"""Reliability sweep (issue 6): the heavy versions of tests/reliability, with figures.

    python -m benchmarks.reliability_sweep [--workers 2] [--fuzz-examples 2000] [--tiny] [--out DIR]

Sections (``--only crash,corruption,...`` runs a subset):

- crash: SIGKILL rank 1 or the coordinator of a 2-process gloo save at every named phase and
  after N bytes (every 2% of a rank's bytes, and small counts inside the file and item headers),
  over an existing checkpoint and into an empty location; then a retry. Counts what the target
  held after each kill (old / new / nothing / a mix) and whether the retry loaded bit-exactly and
  left only referenced files.
- corruption: every byte of every data file of a small checkpoint per codec flipped (a random
  non-zero xor), every record boundary +-1 and random cuts as truncations, every byte of
  ``.metadata`` flipped; each loaded and verified.
- chain: every byte of a delta checkpoint's data files and of its base's flipped, the delta
  loaded and verified: damage in a record the load reads is named (the damaged checkpoint's
  file, the item, the chunk) and found by ``verify_checkpoint`` down the chain; none returns
  wrong tensors.
- fuzz: the hypothesis targets of nvdcp/testing/fuzz_targets.py with many more examples,
  each in a worker with a capped address space.
- gdeflate: mutated, random and truncated streams straight into the guarded CPU GDeflate decoder.
- concurrency: processes and threads racing saves on one location, a reader loading meanwhile.
- disk: a 4 MiB tmpfs filled to leave 0..1 MiB free before a save over an existing checkpoint.

Writes benchmarks/results/reliability_sweep_<date>.json (numbers quoted in docs/RELIABILITY.md).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import random
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import nvdcp
from benchmarks.common import write_results
from nvdcp.testing import damage as D
from nvdcp.testing import failure_of, random_tensor
from nvdcp.testing import faults as F
from nvdcp.testing import fuzz_targets as T

OLD, NEW, RETRY = 1, 2, 3
COORDINATOR_ONLY = {"global_plan", "finish_start", "metadata_tmp", "after_commit", "during_cleanup"}


# -- crash -----------------------------------------------------------------------------------

def crash(root: Path, tiny: bool) -> dict[str, Any]:
    states = {s: F.full_state(s) for s in (OLD, NEW, RETRY)}
    old, prev, probe = root / "old", root / "previous", root / "probe"
    for path, seed in ((old, OLD), (prev, OLD), (probe, NEW)):
        assert F.run_group(path, seed) == [0, 0]
    per_rank = {r: sum(p.stat().st_size for p in probe.iterdir() if p.name.startswith(f"__{r}_")) for r in (0, 1)}
    prev_digest = F.tree_digest(prev)

    stops: list[dict[str, Any]] = []
    for phase in F.PHASES:
        for rank in (0,) if phase in COORDINATOR_ONLY else (0, 1):
            stops.append({"rank": rank, "at": phase})
    steps = 5 if tiny else 50
    for rank in (0, 1):
        counts = {0, 1, 8, 19, 20, 21, 100, 200, 400, 1000}
        counts |= {max(1, per_rank[rank] * k // steps) for k in range(1, steps + 1)}
        stops += [{"rank": rank, "after_bytes": n} for n in sorted(counts)]
    cases = [(s, True) for s in stops] + [(s, False) for s in stops[:: 1 if tiny else 4]]

    tally: Counter[str] = Counter()
    problems: list[str] = []
    started = time.perf_counter()
    for i, (stop, had_old) in enumerate(cases):
        target = root / f"case{i}"
        if had_old:
            shutil.copytree(old, target)
        codes = F.run_group(target, NEW, stop)
        victim = stop["rank"]
        got = F.outcome(target, {"old": states[OLD], "new": states[NEW]})
        committed = stop.get("at") in F.COMMITTED_PHASES
        # A byte count the rank never reaches means it was not killed: the save completed.
        expected = "new" if committed or codes == [0, 0] else ("old" if had_old else "incomplete")
        key = "after_commit" if committed else "before_commit"
        tally[f"{key}: target {got}"] += 1
        if codes[victim] != -9 and codes != [0, 0]:
            problems.append(f"{stop}: exit codes {codes}")
        if codes[1 - victim] is None:
            problems.append(f"{stop}: survivor hung")
        if got != expected:
            problems.append(f"{stop} had_old={had_old}: target holds {got}, expected {expected}")
        if F.tree_digest(prev) != prev_digest:
            problems.append(f"{stop}: the previous checkpoint changed")
        retry = F.run_group(target, RETRY)
        after = F.outcome(target, {"retry": states[RETRY]})
        referenced, present = F.checkpoint_files(target) if after == "retry" else (set(), {"?"})
        tally["retry: loads bit-exactly" if retry == [0, 0] and after == "retry" else "retry: FAILED"] += 1
        tally["retry: only referenced files left" if present == referenced else "retry: leftovers"] += 1
        if present != referenced:
            problems.append(f"{stop}: left behind {sorted(present - referenced)}")
        shutil.rmtree(target)
    return {
        "cases": len(cases), "kill_points": len(stops), "phases": list(F.PHASES),
        "bytes_per_rank": per_rank, "outcomes": dict(tally), "problems": problems,
        "previous_checkpoint_intact": F.outcome(prev, {"old": states[OLD]}) == "old",
        "seconds": round(time.perf_counter() - started, 1),
    }


# -- corruption ------------------------------------------------------------------------------

def _in_workers(run: Any, src: Path, shares: list[list[Any]]) -> tuple[int, Counter[str], list[str]]:
    """``run(src, share)`` for each share in its own worker process (``nvdcp.testing.damage``'s
    runners): the cases run, their outcomes and their failures, added up."""
    with F.context().Pool(len(shares)) as pool:
        parts = pool.starmap(run, [(str(src), share) for share in shares])
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    for part in parts:
        outcomes.update(part["outcomes"])
        failures += part["failures"]
    return sum(p["cases"] for p in parts), outcomes, failures


def corruption(root: Path, tiny: bool, workers: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    codecs = ["zstd", "none"] + (["gdeflate"] if nvdcp.codecs.gdeflate.GDeflateCodec.available() else [])
    for codec in codecs:
        started = time.perf_counter()
        src = root / f"damage-{codec}"
        D.save_sample(src, codec)
        regions = D.regions(src)
        rng = random.Random(codec)
        per_kind = {"file header": 20, "item header": 100, "payload": 200} if tiny else {
            "file header": -1, "item header": -1, "payload": -1}
        cases: list[tuple[str, Any, int, int]] = [
            ("flip", r, p, x) for r, p, x in D.sample_positions(regions, per_kind, seed=rng.randrange(1 << 30))]
        cases += [("cut", f, n, 0) for f, n in D.truncation_lengths(regions, 20 if tiny else 200, seed=1)]
        meta = (src / ".metadata").stat().st_size
        positions = sorted(random.Random(1).sample(range(meta), 30)) if tiny else range(meta)
        cases += [("meta", None, p, rng.randrange(1, 256)) for p in positions]
        random.Random(0).shuffle(cases)
        shares = [cases[i::workers] for i in range(workers)]
        n_cases, outcomes, failures = _in_workers(D.run_cases, src, shares)
        sizes: Counter[str] = Counter()
        for r in regions:
            sizes[r.kind] += r.stop - r.start
        out[codec] = {
            "bytes": dict(sizes) | {".metadata": meta}, "cases": n_cases,
            "flips": sum(1 for c in cases if c[0] == "flip"), "truncations": sum(1 for c in cases if c[0] == "cut"),
            "metadata_flips": sum(1 for c in cases if c[0] == "meta"),
            "outcomes": dict(sorted(outcomes.items())), "failures": failures[:50], "failure_count": len(failures),
            "seconds": round(time.perf_counter() - started, 1),
        }
        print(f"corruption {codec}: {out[codec]['cases']} cases, {len(failures)} failures, "
              f"{out[codec]['seconds']} s", flush=True)
    return out


def chain_corruption(root: Path, tiny: bool, workers: int) -> dict[str, Any]:
    """Every byte of a delta checkpoint's data files and of its base's, flipped one at a time
    (a random non-zero xor), the delta loaded and verified (``nvdcp.testing.damage.check_chain_flip``)."""
    out: dict[str, Any] = {}
    codecs = ["zstd"] + (["gdeflate"] if nvdcp.codecs.gdeflate.GDeflateCodec.available() else [])
    for codec in codecs:
        started = time.perf_counter()
        src = root / f"chain-damage-{codec}"
        _, delta, _ = D.save_delta_sample(src, codec)
        rng = random.Random(codec)
        cases = [(where.name, region, pos, rng.randrange(1, 256), read)
                 for where, region, read in D.chain_regions(delta) for pos in range(region.start, region.stop)]
        if tiny:
            cases = rng.sample(cases, min(60, len(cases)))
        rng.shuffle(cases)
        n_cases, outcomes, failures = _in_workers(D.run_chain_cases, src, [cases[i::workers] for i in range(workers)])
        out[codec] = {
            "cases": n_cases, "deltas": sorted(D.delta_items(delta)),
            "outcomes": dict(sorted(outcomes.items())), "failures": failures[:50], "failure_count": len(failures),
            "seconds": round(time.perf_counter() - started, 1),
        }
        print(f"chain corruption {codec}: {out[codec]['cases']} cases, {len(failures)} failures, "
              f"{out[codec]['seconds']} s", flush=True)
    return out


# -- fuzz ------------------------------------------------------------------------------------

def fuzz(examples: int) -> dict[str, Any]:
    out = {}
    for name in T.TARGETS:
        started = time.perf_counter()
        result = F.call_in_process(T.run, name, examples, 1 << 30, timeout=3600)
        out[name] = {"result": result[0], **(result[1] if result[0] == "ok" else {"detail": list(result)}),
                     "seconds": round(time.perf_counter() - started, 1)}
        print(f"fuzz {name}: {out[name]['result']} in {out[name]['seconds']} s", flush=True)
    return out


def gdeflate_streams(n: int) -> dict[str, Any]:
    """Mutated, random and truncated GDeflate streams straight into the (guarded) CPU decoder,
    in a worker: only ValueError may come out, and the worker must survive."""
    from nvdcp.codecs.gdeflate import GDeflateCodec, guarded

    if not GDeflateCodec.available():
        return {"skipped": "libnvcomp_cpu is not installed"}
    if not guarded():
        return {"skipped": "nvdcp.codecs._gdeflate_guard is not built: a malformed stream aborts"}
    result = F.call_in_process(_gdeflate_worker, n, timeout=3600)
    return {"result": result[0], **(result[1] if result[0] == "ok" else {"detail": list(result)})}


def _gdeflate_worker(n: int) -> dict[str, Any]:
    import numpy as np

    from nvdcp.codecs.gdeflate import GDeflateCodec

    codec = GDeflateCodec()
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 4, 65536, dtype=np.uint8).tobytes()
    enc = codec.encode(raw)
    out = bytearray(65536)
    tally: Counter[str] = Counter()

    def attempt(kind: str, data: bytes) -> None:
        try:
            codec.decode(data, memoryview(out))
            tally[f"{kind}: decoded ({'same' if bytes(out) == raw else 'other'} bytes)"] += 1
        except ValueError:
            tally[f"{kind}: ValueError"] += 1

    for _ in range(n):
        data = bytearray(enc)
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(0, len(data)))] ^= int(rng.integers(1, 256))
        attempt("mutated", bytes(data))
    for _ in range(n // 3):
        attempt("random", rng.integers(0, 256, int(rng.integers(1, 4000)), dtype=np.uint8).tobytes())
    for cut in range(1, len(enc), max(1, len(enc) // 200)):
        attempt("truncated", enc[:cut])
    return {"streams": sum(tally.values()), "outcomes": dict(sorted(tally.items()))}


# -- concurrency -----------------------------------------------------------------------------

def _race(path: str, seed: int, rounds: int) -> None:
    kw: dict[str, Any] = {"sync_files": False, "codec_threads": 1, "codec": "zstd", "thread_count": 2}
    for _ in range(rounds):
        dcp.save(F.full_state(seed), storage_writer=nvdcp.NvcompWriter(path, **kw))


def concurrency(root: Path, tiny: bool) -> dict[str, Any]:
    seeds = (201, 202, 203)
    states = {f"s{s}": F.full_state(s) for s in seeds}
    tally: Counter[str] = Counter()
    problems: list[str] = []
    iterations = 2 if tiny else 15
    ctx = F.context()
    for it in range(iterations):
        target = root / f"procs{it}"
        procs = [ctx.Process(target=_race, args=(str(target), s, 4)) for s in seeds]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        got = F.outcome(target, states)
        referenced, present = F.checkpoint_files(target)
        tally[f"processes: final {'one complete state' if got in states else got}"] += 1
        tally["processes: clean" if present == referenced else "processes: leftovers"] += 1
        if [p.exitcode for p in procs] != [0, 0, 0] or got not in states or present != referenced:
            problems.append(f"process race {it}: exits {[p.exitcode for p in procs]}, {got}, "
                            f"left {sorted(present - referenced)}")
    for it in range(iterations):
        target = root / f"threads{it}"
        _race(str(target), 201, 1)
        stop = threading.Event()
        seen: Counter[str] = Counter()

        def reader(stop: threading.Event = stop, target: Path = target, seen: Counter[str] = seen) -> None:
            while not stop.is_set():
                o = F.outcome(target, states)
                seen["a complete state" if o in states else ":".join(o.split(":")[:2])] += 1

        threads = [threading.Thread(target=reader)] + [
            threading.Thread(target=_race, args=(str(target), s, 4)) for s in seeds]
        for t in threads:
            t.start()
        for t in threads[1:]:
            t.join()
        stop.set()
        threads[0].join()
        got = F.outcome(target, states)
        referenced, present = F.checkpoint_files(target)
        tally.update({f"threads: reader saw {k}": v for k, v in seen.items()})
        tally[f"threads: final {'one complete state' if got in states else got}"] += 1
        tally["threads: clean" if present == referenced else "threads: leftovers"] += 1
        if got not in states or present != referenced or seen.get("mixed"):
            problems.append(f"thread race {it}: {got}, left {sorted(present - referenced)}, reader {dict(seen)}")
    return {"iterations": iterations, "writers": len(seeds), "saves_each": 4, "outcomes": dict(tally),
            "problems": problems}


# -- disk ------------------------------------------------------------------------------------

def disk(root: Path, tiny: bool) -> dict[str, Any]:
    where = root / "tmpfs"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"skipped": f"cannot mount a tmpfs: {done.stderr.strip()}"}
    kw: dict[str, Any] = {"sync_files": True, "codec_threads": 1, "thread_count": 2}
    old_sd = {"noise": random_tensor(torch.uint8, (600 << 10,), seed=1)}
    new_sd = {"noise": random_tensor(torch.uint8, (600 << 10,), seed=2)}
    tally: Counter[str] = Counter()
    problems: list[str] = []
    try:
        for free_kib in range(0, 1025, 256 if tiny else 16):
            target = where / "ckpt"
            shutil.rmtree(target, ignore_errors=True)
            dcp.save(old_sd, storage_writer=nvdcp.NvcompWriter(target, **kw))
            st = os.statvfs(where)
            fill = st.f_bavail * st.f_frsize - free_kib * 1024
            if fill > 0:
                with open(where / "filler", "wb") as f:
                    f.write(b"\0" * fill)
            try:
                dcp.save(new_sd, storage_writer=nvdcp.NvcompWriter(target, **kw))
                result = "saved"
            except (CheckpointException, nvdcp.NvdcpError) as exc:
                err = failure_of(exc)
                if isinstance(err, nvdcp.StorageError) and err.errno == errno.ENOSPC and err.filename:
                    name = os.path.basename(str(err.filename))
                    result = "ENOSPC at .metadata" if name.startswith(".metadata") else "ENOSPC at a data file"
                    if str(err.filename) not in str(err):
                        problems.append(f"{free_kib} KiB free: error does not name {err.filename}")
                else:
                    result = f"{type(err).__name__}: {err}"
                    problems.append(f"{free_kib} KiB free: {result}")
            (where / "filler").unlink(missing_ok=True)
            got = F.outcome(target, {"old": old_sd, "new": new_sd})
            tally[f"{result} -> target {got}"] += 1
            if (result == "saved") != (got == "new") or got not in ("old", "new"):
                problems.append(f"{free_kib} KiB free: {result} but the target holds {got}")
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)
    return {"fill_levels": sum(tally.values()), "outcomes": dict(tally), "problems": problems}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="crash,corruption,chain,fuzz,gdeflate,concurrency,disk")
    ap.add_argument("--workers", type=int, default=2, help="processes for the corruption section")
    ap.add_argument("--fuzz-examples", type=int, default=2000)
    ap.add_argument("--tiny", action="store_true", help="a smoke run (seconds)")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    quiet = os.environ.get("NVDCP_FAULTS_QUIET")
    os.environ["NVDCP_FAULTS_QUIET"] = "1"  # killed ranks' peers fail by design, thousands of times
    logging.getLogger("torch.distributed.checkpoint").setLevel(logging.CRITICAL)
    sections = args.only.split(",")
    root = Path(tempfile.mkdtemp(prefix="nvdcp-reliability-"))
    payload: dict[str, Any] = {"schema": "nvdcp.reliability_sweep/1", "tiny": args.tiny,
                               "gdeflate_guard": nvdcp.codecs.gdeflate.guarded()}
    started = time.perf_counter()
    try:
        if "crash" in sections:
            payload["crash"] = crash(root / "crash", args.tiny)
            print(f"crash: {payload['crash']['cases']} cases, {len(payload['crash']['problems'])} problems", flush=True)
        if "corruption" in sections:
            payload["corruption"] = corruption(root, args.tiny, args.workers)
        if "chain" in sections:
            payload["chain_corruption"] = chain_corruption(root, args.tiny, args.workers)
        if "fuzz" in sections:
            payload["fuzz"] = fuzz(50 if args.tiny else args.fuzz_examples)
        if "gdeflate" in sections:
            payload["gdeflate_streams"] = gdeflate_streams(300 if args.tiny else 6000)
            print(f"gdeflate: {payload['gdeflate_streams']}", flush=True)
        if "concurrency" in sections:
            payload["concurrency"] = concurrency(root, args.tiny)
            print(f"concurrency: {len(payload['concurrency']['problems'])} problems", flush=True)
        if "disk" in sections:
            payload["disk"] = disk(root, args.tiny)
            print(f"disk: {payload['disk']}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if quiet is None:
            os.environ.pop("NVDCP_FAULTS_QUIET", None)
    payload["seconds"] = round(time.perf_counter() - started, 1)
    target = write_results("reliability_sweep", payload, args.out)
    print(f"wrote {target} ({payload['seconds']} s)")
    return payload


if __name__ == "__main__":
    main()

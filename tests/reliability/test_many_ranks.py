"""16 gloo processes on the CPU: a sharded save that loads bit-exactly on 5 processes (resharded
DTensors) and on 1 (plain tensors); then a second 16-process save over it in which one rank
SIGKILLs itself in the middle of writing its data file.

After the kill: the survivors fail (none hangs, none claims success), the location still loads
the first checkpoint bit-exactly on 1 and on 5 processes, ``verify_checkpoint`` finds it intact,
its files are byte-for-byte unchanged, and the dead save's files (its data files, the victim's
cut short, and its in-progress marker) are only leftovers beside it. A fresh 16-process save to
the location then succeeds, loads bit-exactly, and leaves only the files its ``.metadata``
references: the dead save's files are cleaned, as docs/RELIABILITY.md promises for a crash on
the same machine (its marker's process is gone, so ``SaveGuard.is_alive`` is False).

The 1-process loads run in the test's own process (plain tensors, no process group). Ranks are
forked by one zygote process per module (``many_ranks_worker.zygote``), which keeps a 16-rank
phase at about a second on 2 cores. Measured: docs/RELIABILITY.md.
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nvdcp
from nvdcp.dcp.save_guard import DATA_FILE, PENDING
from nvdcp.testing import faults as F
from tests.reliability import many_ranks_worker as W

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SAVE_WORLD, LOAD_WORLD = 16, 5
OLD, NEW, RETRY = 11, 12, 13
VICTIM = 5  # holds shards of every sharded tensor but ``mask``; not the coordinator
#: A phase whose ranks are all still running this long after they started is stuck.
PHASE_DEADLINE_S = W.GLOO_TIMEOUT_S + 90


class Ranks:
    """Runs phases on ranks forked by one :func:`many_ranks_worker.zygote` (see there)."""

    def __init__(self) -> None:
        ctx = F.context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=W.zygote, args=(child,))
        self.proc.start()
        child.close()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def run(self, world: int, phase: str, out: Path, *, attempts: int = 3, **args: Any) -> dict[str, Any]:
        """Run ``phase`` on ``world`` processes; returns exit codes, per-rank results, seconds.

        A rank still running at the deadline is SIGKILLed and its code reads None. A phase in
        which every rank reported success (after its final barrier) but one then died by a
        signal, i.e. in the gloo teardown, runs again (as tests/training/test_fsdp_resume.py
        does; every phase is idempotent); any other failure is returned as it is.
        """
        for attempt in range(attempts):
            run_dir = out / f"{phase}-{time.monotonic_ns()}"
            run_dir.mkdir()
            started = time.monotonic()
            self.conn.send((world, phase, str(run_dir), args, PHASE_DEADLINE_S))
            if not self.conn.poll(PHASE_DEADLINE_S + 60):
                self.proc.kill()  # its ranks die with it (PR_SET_PDEATHSIG)
                raise AssertionError(f"{phase} on {world} ranks: the zygote did not answer")
            codes: list[int | None] = self.conn.recv()
            seconds = time.monotonic() - started
            results = {r: json.loads(f.read_text()) for r in range(world)
                       if (f := run_dir / f"{phase}_{r}.json").exists()}
            run = {"codes": codes, "results": results, "seconds": seconds}
            all_ok = len(results) == world and all(res["ok"] for res in results.values())
            teardown_death = all_ok and any(c is not None and c < 0 for c in codes)
            if not teardown_death or attempt == attempts - 1:
                return run
            warnings.warn(f"{phase} on {world} ranks: every rank finished, then exit codes {codes}; "
                          "running it again", stacklevel=2)
        raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def ranks() -> Iterator[Ranks]:
    r = Ranks()
    yield r
    r.close()


def assert_all_ok(run: dict[str, Any], what: str) -> None:
    failed = {r: res.get("error") for r, res in run["results"].items() if not res["ok"]}
    assert run["codes"] == [0] * len(run["codes"]) and not failed, (
        f"{what}: exit codes {run['codes']}, failures {failed}, "
        f"tracebacks: {[res.get('traceback') for res in run['results'].values() if not res['ok']][:1]}"
    )


def files_of(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in path.iterdir()}


def token_of(name: str) -> str | None:
    m = DATA_FILE.match(name)
    return m.group(1) if m else None


def assert_loads_on_5(ranks: Ranks, path: Path, seed: int, out: Path) -> dict[str, Any]:
    run = ranks.run(LOAD_WORLD, "load", out, path=str(path), seed=seed)
    assert_all_ok(run, f"16 -> {LOAD_WORLD} load")
    bad = {r: res["mismatches"] for r, res in run["results"].items() if res["mismatches"]}
    assert not bad, f"ranks whose loaded shards differ from the reference: {bad}"
    rows = [run["results"][r]["rows"] for r in range(LOAD_WORLD)]
    assert [x["b16"] for x in rows] == [8, 8, 8, 8, 5]  # resharded unevenly
    assert [x["mask"] for x in rows] == [1, 1, 1, 0, 0]  # and into empty shards
    return run


@pytest.fixture(scope="module")
def first(ranks: Ranks, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The first checkpoint: seed OLD saved by 16 processes."""
    root = tmp_path_factory.mktemp("many_ranks")
    path = root / "first"
    run = ranks.run(SAVE_WORLD, "save", root, path=str(path), seed=OLD)
    assert_all_ok(run, "16-rank save")
    return {"root": root, "path": path, "save": run, "digest": F.tree_digest(path)}


def test_16_rank_save_loads_on_5_and_on_1(ranks: Ranks, first: dict[str, Any], tmp_path: Path) -> None:
    path = first["path"]
    rows = [first["save"]["results"][r]["rows"] for r in range(SAVE_WORLD)]
    assert [x["w"] for x in rows] == [7] * 14 + [2, 0]
    assert [x["ids"] for x in rows] == [1] * 10 + [0] * 6  # empty shards on 6 ranks
    assert [x["mask"] for x in rows] == [1] * 3 + [0] * 13

    referenced, present = F.checkpoint_files(path)
    assert present == referenced, f"left behind: {sorted(present - referenced)}"
    per_rank: dict[int, int] = {}
    for name in present - {".metadata"}:
        per_rank[int(name.split("_")[2])] = per_rank.get(int(name.split("_")[2]), 0) + 1
    assert sorted(per_rank) == list(range(SAVE_WORLD)), per_rank
    assert max(per_rank.values()) == W.WRITER_KWARGS["thread_count"], per_rank  # several files per rank

    assert_loads_on_5(ranks, path, OLD, tmp_path)
    states = {"old": W.global_state(OLD)}
    assert F.outcome(path, states) == "old"  # 16 -> 1: plain tensors, bit-exact
    assert nvdcp.verify_checkpoint(path, threads=2).ok


def test_rank_killed_mid_save_of_16_leaves_the_first_checkpoint(
    ranks: Ranks, first: dict[str, Any], tmp_path: Path
) -> None:
    target = tmp_path / "target"
    shutil.copytree(first["path"], target)
    old_files = files_of(target)
    # The victim dies halfway through the bytes it wrote for the first save (same shapes and
    # codec; compressed sizes differ a little between seeds): inside one of its data files.
    victim_bytes = sum(size for name, size in old_files.items() if name.startswith(f"__{VICTIM}_"))
    stop = {"rank": VICTIM, "after_bytes": victim_bytes // 2}

    crash = ranks.run(SAVE_WORLD, "save", tmp_path, attempts=1, path=str(target), seed=NEW, stop=stop)
    codes = crash["codes"]
    assert codes[VICTIM] == -9, f"victim exit codes {codes}"
    survivors = [r for r in range(SAVE_WORLD) if r != VICTIM]
    # Each survivor fails in the next collective ("Connection closed by peer"), within seconds.
    assert all(codes[r] not in (0, None) for r in survivors), f"a survivor hung or claimed success: {codes}"
    assert not any(res["ok"] for res in crash["results"].values()), crash["results"]

    # Nothing half-written is loadable: the first checkpoint, bit-exactly, untouched.
    assert F.outcome(target, {"old": W.global_state(OLD), "new": W.global_state(NEW)}) == "old"
    report = nvdcp.verify_checkpoint(target, threads=2)
    assert report.ok, report
    now = F.tree_digest(target)
    assert {n: now.get(n) for n in first["digest"]} == first["digest"]  # the old files, unchanged
    left = {n: s for n, s in files_of(target).items() if n not in old_files}
    dead_tokens = {token_of(n) for n in left} - {None}
    assert len(dead_tokens) == 1, sorted(left)
    # The victim's data file stopped where it was killed; every rank had created its files.
    victim_left = sum(s for n, s in left.items() if n.startswith(f"__{VICTIM}_"))
    assert 0 < victim_left <= stop["after_bytes"], (victim_left, stop)
    assert {int(n.split("_")[2]) for n in left if token_of(n)} == set(range(SAVE_WORLD))
    assert [n for n in left if PENDING.match(n)], f"no in-progress marker among {sorted(left)}"
    assert all(token_of(n) or PENDING.match(n) for n in left), sorted(left)

    assert_loads_on_5(ranks, target, OLD, tmp_path)  # 16 -> 5 after the crash: the first checkpoint

    # A fresh 16-process save succeeds and cleans the dead save's files (the process that wrote
    # its marker is gone: SaveGuard.is_alive is False on this machine).
    retry = ranks.run(SAVE_WORLD, "save", tmp_path, path=str(target), seed=RETRY)
    assert_all_ok(retry, "16-rank save after the crash")
    states = {"retry": W.global_state(RETRY), "old": W.global_state(OLD), "new": W.global_state(NEW)}
    assert F.outcome(target, states) == "retry"
    referenced, present = F.checkpoint_files(target)
    assert present == referenced, f"left behind: {sorted(present - referenced)}"
    assert nvdcp.verify_checkpoint(target, threads=2).ok

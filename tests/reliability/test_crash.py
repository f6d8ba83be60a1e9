"""SIGKILL a rank, or the coordinator, at many points of a 2-process gloo save.

After every kill: the target holds the old complete checkpoint (or nothing, when there was none)
until the new ``.metadata`` is committed, and the new one after; it never loads as a mix. A
previous checkpoint elsewhere is byte-for-byte untouched. A retried save to the same location
succeeds, loads bit-exactly, and leaves only the files its ``.metadata`` references.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

import nvdcp
from nvdcp.testing import faults as F

pytestmark = pytest.mark.timeout(120)

OLD, NEW, RETRY = 1, 2, 3
#: Kill points as fractions of one rank's data bytes (plus exact small counts: the file header,
#: the first item header). The sweep (benchmarks/reliability_sweep.py) uses many more.
BYTE_FRACTIONS = (0.0, 0.1, 0.5, 0.9, 1.0)
SMALL_COUNTS = (0, 20, 150)


@pytest.fixture(scope="module")
def states() -> dict[int, dict[str, Any]]:
    return {s: F.full_state(s) for s in (OLD, NEW, RETRY)}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An old checkpoint at a target (copied per case), a previous checkpoint elsewhere, and the
    bytes each rank writes."""
    root = tmp_path_factory.mktemp("crash")
    old, prev, probe = root / "old", root / "previous", root / "probe"
    assert F.run_group(old, OLD) == [0, 0]
    assert F.run_group(prev, OLD) == [0, 0]
    assert F.run_group(probe, NEW) == [0, 0]  # compression is deterministic: the bytes a NEW save writes
    per_rank = {
        r: sum(p.stat().st_size for p in probe.iterdir() if p.name.startswith(f"__{r}_")) for r in (0, 1)
    }
    return {"old": old, "prev": prev, "prev_digest": F.tree_digest(prev), "per_rank": per_rank}


def _cases() -> list[Any]:
    cases = []
    for phase in F.PHASES:
        ranks = (0,) if phase in ("global_plan", "finish_start", "metadata_tmp", "after_commit", "during_cleanup") else (0, 1)
        for rank in ranks:
            cases.append(pytest.param({"rank": rank, "at": phase}, id=f"rank{rank}-{phase}"))
    for rank in (0, 1):
        for n in SMALL_COUNTS:
            cases.append(pytest.param({"rank": rank, "after_bytes": n}, id=f"rank{rank}-{n}B"))
        for frac in BYTE_FRACTIONS:
            cases.append(pytest.param({"rank": rank, "fraction": frac}, id=f"rank{rank}-{int(frac * 100)}pct"))
    return cases


def _resolve(stop: dict[str, Any], per_rank: dict[int, int]) -> dict[str, Any]:
    stop = dict(stop)
    frac = stop.pop("fraction", None)
    if frac is not None:
        # 1.0: every byte written, killed before the data files are closed or results gathered.
        stop["after_bytes"] = max(1, int(per_rank[stop["rank"]] * frac))
    return stop


def expected_after_kill(stop: dict[str, Any], had_old: bool) -> str:
    if stop.get("at") in F.COMMITTED_PHASES:
        return "new"
    return "old" if had_old else "incomplete"


def kill_and_check(target: Path, stop: dict[str, Any], states: dict[int, dict[str, Any]], had_old: bool) -> None:
    codes = F.run_group(target, NEW, stop)
    victim = stop["rank"]
    assert codes[victim] == -9, f"victim exit codes {codes}"
    assert codes[1 - victim] not in (None, 0), f"survivor hung or claimed success: {codes}"
    got = F.outcome(target, {"old": states[OLD], "new": states[NEW]})
    assert got == expected_after_kill(stop, had_old), got
    if got != "incomplete":
        assert nvdcp.verify_checkpoint(target, threads=2).ok


def retry_and_check(target: Path, states: dict[int, dict[str, Any]]) -> None:
    assert F.run_group(target, RETRY) == [0, 0]
    assert F.outcome(target, {"retry": states[RETRY], "old": states[OLD], "new": states[NEW]}) == "retry"
    referenced, present = F.checkpoint_files(target)
    assert present == referenced, f"left behind: {sorted(present - referenced)}"


@pytest.mark.parametrize("stop", _cases())
def test_kill_over_an_existing_checkpoint(
    stop: dict[str, Any], template: dict[str, Any], states: dict[int, dict[str, Any]], tmp_path: Path
) -> None:
    target = tmp_path / "target"
    shutil.copytree(template["old"], target)
    stop = _resolve(stop, template["per_rank"])
    kill_and_check(target, stop, states, had_old=True)
    assert F.tree_digest(template["prev"]) == template["prev_digest"]
    retry_and_check(target, states)
    assert F.outcome(template["prev"], {"old": states[OLD]}) == "old"


@pytest.mark.parametrize(
    "stop",
    [
        pytest.param({"rank": 1, "fraction": 0.5}, id="rank1-50pct"),
        pytest.param({"rank": 0, "at": "metadata_tmp"}, id="rank0-metadata_tmp"),
        pytest.param({"rank": 0, "at": "after_commit"}, id="rank0-after_commit"),
    ],
)
def test_kill_into_an_empty_location(
    stop: dict[str, Any], template: dict[str, Any], states: dict[int, dict[str, Any]], tmp_path: Path
) -> None:
    target = tmp_path / "fresh"
    kill_and_check(target, _resolve(stop, template["per_rank"]), states, had_old=False)
    retry_and_check(target, states)

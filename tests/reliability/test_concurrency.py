"""Concurrent saves: to different locations from threads, and racing on one location (threads
and processes). A race ends with one complete checkpoint, never a mix; a save's cleanup never
deletes the files of a save still in progress; and ``finish`` refuses to commit a ``.metadata``
whose data files are gone or changed."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import nvdcp
from nvdcp.testing import failure_of
from nvdcp.testing import faults as F

pytestmark = pytest.mark.timeout(120)

KW: dict[str, Any] = {"sync_files": False, "codec_threads": 1, "codec": "zstd", "thread_count": 2}


def _save(path: Path, seed: int, stopper: F.Stopper | None = None) -> None:
    dcp.save(F.full_state(seed), storage_writer=F.StoppingWriter(path, stopper=stopper, **KW))


class Pause:
    """A stop action that parks the saving thread until released."""

    def __init__(self) -> None:
        self.reached, self.resume = threading.Event(), threading.Event()

    def __call__(self) -> None:
        self.reached.set()
        assert self.resume.wait(60), "never resumed"


def test_threads_save_to_different_locations(tmp_path: Path) -> None:
    seeds = range(10, 14)
    with ThreadPoolExecutor(len(seeds)) as pool:
        list(pool.map(lambda s: _save(tmp_path / f"c{s}", s), seeds))
    for s in seeds:
        assert F.outcome(tmp_path / f"c{s}", {"ok": F.full_state(s)}) == "ok"
        referenced, present = F.checkpoint_files(tmp_path / f"c{s}")
        assert present == referenced


def test_cleanup_keeps_the_files_of_a_save_in_progress(tmp_path: Path) -> None:
    """A pauses with its data written; B saves over the location and commits; A then commits.
    B's cleanup must not delete A's files (before the fix it did, and A committed a
    .metadata naming files that were gone)."""
    target = tmp_path / "t"
    _save(target, 1)
    pause = Pause()
    with ThreadPoolExecutor(1) as pool:
        a = pool.submit(_save, target, 2, F.Stopper(at="write_end", action=pause))
        assert pause.reached.wait(60)
        _save(target, 3)
        assert F.outcome(target, {"b": F.full_state(3)}) == "b"
        pause.resume.set()
        a.result()
    assert F.outcome(target, {"a": F.full_state(2), "b": F.full_state(3)}) == "a"
    referenced, present = F.checkpoint_files(target)
    assert present == referenced  # B's files went in A's cleanup


def test_convert_keeps_the_files_of_a_save_in_progress(tmp_path: Path) -> None:
    """``nvdcp convert --overwrite`` into a location where a save is in progress follows the
    same protocol as a save: its cleanup keeps the other save's files (before, it deleted them)."""
    from nvdcp.convert import ConvertOptions, convert_checkpoint

    target, source = tmp_path / "t", tmp_path / "src"
    _save(target, 1)
    _save(source, 3)
    pause = Pause()
    with ThreadPoolExecutor(1) as pool:
        a = pool.submit(_save, target, 2, F.Stopper(at="write_end", action=pause))
        assert pause.reached.wait(60)
        convert_checkpoint(source, target, ConvertOptions(overwrite=True, codec="zstd"))
        assert F.outcome(target, {"b": F.full_state(3)}) == "b"
        pause.resume.set()
        a.result()
    assert F.outcome(target, {"a": F.full_state(2), "b": F.full_state(3)}) == "a"
    referenced, present = F.checkpoint_files(target)
    assert present == referenced  # the conversion's files went in A's cleanup, and its marker


def test_superseded_save_removes_only_its_own_files(tmp_path: Path) -> None:
    """A commits, then pauses before its cleanup; B commits over it; A's cleanup sees it lost."""
    target = tmp_path / "t"
    pause = Pause()
    with ThreadPoolExecutor(1) as pool:
        a = pool.submit(_save, target, 2, F.Stopper(at="after_commit", action=pause))
        assert pause.reached.wait(60)
        _save(target, 3)
        pause.resume.set()
        a.result()
    assert F.outcome(target, {"a": F.full_state(2), "b": F.full_state(3)}) == "b"
    referenced, present = F.checkpoint_files(target)
    assert present == referenced


@pytest.mark.parametrize("damage", ["delete", "truncate", "extend"])
def test_commit_refused_when_a_data_file_changed(tmp_path: Path, damage: str) -> None:
    target = tmp_path / "t"
    _save(target, 1)
    before = (target / ".metadata").read_bytes()
    pause = Pause()
    with ThreadPoolExecutor(1) as pool:
        a = pool.submit(_save, target, 2, F.Stopper(at="finish_start", action=pause))
        assert pause.reached.wait(60)
        victim = max((p for p in target.iterdir() if p.suffix == ".nvdcp"), key=lambda p: p.stat().st_mtime_ns)
        if damage == "delete":
            victim.unlink()
        elif damage == "truncate":
            os.truncate(victim, victim.stat().st_size - 1)
        else:
            with open(victim, "ab") as f:
                f.write(b"x")
        pause.resume.set()
        with pytest.raises((CheckpointException, nvdcp.NvdcpError)) as info:
            a.result()
    err = failure_of(info.value)
    expected = {"delete": nvdcp.MissingDataFileError, "truncate": nvdcp.TruncatedCheckpointError,
                "extend": nvdcp.CorruptCheckpointError}[damage]
    assert isinstance(err, expected), repr(err)
    assert victim.name in str(err) and ".metadata not written" in str(err)
    assert (target / ".metadata").read_bytes() == before
    assert F.outcome(target, {"old": F.full_state(1)}) == "old"


def test_threads_racing_on_one_location(tmp_path: Path) -> None:
    """Three threads save three states to one location four times each while a fourth loads."""
    target = tmp_path / "t"
    _save(target, 100)
    states = {f"s{s}": F.full_state(s) for s in (100, 101, 102, 103)}
    stop = threading.Event()
    seen: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            seen.append(F.outcome(target, states))

    def writer(seed: int) -> None:
        for _ in range(4):
            _save(target, seed)

    with ThreadPoolExecutor(4) as pool:
        r = pool.submit(reader)
        list(pool.map(writer, (101, 102, 103)))
        stop.set()
        r.result()
    final = F.outcome(target, states)
    assert final in ("s101", "s102", "s103")
    referenced, present = F.checkpoint_files(target)
    assert present == referenced, sorted(present - referenced)
    assert "mixed" not in seen
    # A reader can lose the race to a cleanup (its checkpoint replaced while it reads): that is a
    # clear MissingDataFileError, never wrong tensors.
    assert all(o in states or o.startswith("error: MissingDataFileError") for o in seen), set(seen)


def _race_in_process(path: str, seed: int, rounds: int) -> None:
    for _ in range(rounds):
        dcp.save(F.full_state(seed), storage_writer=nvdcp.NvcompWriter(path, **KW))


def test_processes_racing_on_one_location(tmp_path: Path) -> None:
    """Two unrelated processes (no process group) save to one location, three times each."""
    target = tmp_path / "t"
    ctx = F.context()
    procs = [ctx.Process(target=_race_in_process, args=(str(target), seed, 3)) for seed in (201, 202)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    assert [p.exitcode for p in procs] == [0, 0]
    assert F.outcome(target, {"a": F.full_state(201), "b": F.full_state(202)}) in ("a", "b")
    referenced, present = F.checkpoint_files(target)
    assert present == referenced, sorted(present - referenced)

"""The coordinator's data files are committed (fsync) while finish() pickles .metadata, and
.metadata is published only after they are durable (nvdcp/dcp/durability.py); other ranks
commit theirs before write_data returns. Real files and fsync: the storage is LocalStorage
behind a thin wrapper that times (or fails) each data file's commit."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import nvdcp
from nvdcp.dcp.metadata_io import METADATA_NAME
from nvdcp.testing import failure_of
from tests._dist import run_ranks
from tests.conftest import bit_equal

#: How long a wrapped data file's commit takes at least: long enough to see the overlap.
COMMIT_DELAY_S = 0.3


class _Wrapped:
    """Passes everything to ``inner``; subclasses time (or fail) what they override."""

    def __init__(self, inner: Any, log: list[tuple[str, float]], fail: bool) -> None:
        self._inner = inner
        self._log = log
        self._fail = fail

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _TimedStream(_Wrapped):
    def commit(self) -> None:
        time.sleep(COMMIT_DELAY_S)
        if self._fail:
            self._inner.abort()
            raise OSError(5, "Input/output error (injected fsync failure)")
        self._inner.commit()
        self._log.append(("data_committed", time.monotonic()))


class _TimedStorage(_Wrapped):
    """LocalStorage, each data file's commit delayed (or failed) and every event timed."""

    def create(self, name: str) -> _TimedStream:
        return _TimedStream(self._inner.create(name), self._log, self._fail)

    def write_atomic(self, name: str, data: bytes) -> None:
        if name == METADATA_NAME:
            self._log.append(("metadata_written", time.monotonic()))
        self._inner.write_atomic(name, data)


class _TimedWriter(nvdcp.NvcompWriter):
    def __init__(self, path: str | os.PathLike[str], *, fail: bool = False, **kwargs: Any) -> None:
        self.log: list[tuple[str, float]] = []
        self._fail = fail
        super().__init__(path, **kwargs)
        self.storage = _TimedStorage(self.storage, self.log, fail)  # type: ignore[assignment]

    def write_data(self, plan: Any, planner: Any) -> Any:
        fut = super().write_data(plan, planner)
        self.log.append(("write_data_returned", time.monotonic()))
        return fut


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(256, 128, generator=g) for i in range(6)}


def _times(log: list[tuple[str, float]], event: str) -> list[float]:
    return [t for name, t in log if name == event]


@pytest.mark.parametrize("thread_count", [1, 2])
def test_coordinator_publishes_metadata_only_after_its_files_are_durable(tmp_path: Path, thread_count: int) -> None:
    state = _state(0)
    writer = _TimedWriter(tmp_path / "ckpt", thread_count=thread_count)
    dcp.save(state, storage_writer=writer)
    returned = _times(writer.log, "write_data_returned")
    committed = _times(writer.log, "data_committed")
    published = _times(writer.log, "metadata_written")
    assert len(committed) == thread_count and len(published) == 1 and len(returned) == 1
    assert returned[0] < min(committed), "the coordinator's commits should overlap finish()"
    assert published[0] > max(committed), ".metadata written before a data file was durable"
    got = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(got, storage_reader=nvdcp.NvcompReader(tmp_path / "ckpt"))
    assert all(bit_equal(got[k], state[k]) for k in state)


def test_a_failed_commit_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    before = _state(1)
    dcp.save(before, storage_writer=nvdcp.NvcompWriter(path))
    metadata_before = (path / METADATA_NAME).read_bytes()
    files_before = sorted(os.listdir(path))
    with pytest.raises(CheckpointException) as info:
        dcp.save(_state(2), storage_writer=_TimedWriter(path, fail=True, thread_count=2))
    assert "injected fsync failure" in str(failure_of(info.value))
    assert (path / METADATA_NAME).read_bytes() == metadata_before
    assert sorted(os.listdir(path)) == files_before, "the failed save left files behind"
    got = {k: torch.empty_like(v) for k, v in before.items()}
    dcp.load(got, storage_reader=nvdcp.NvcompReader(path))
    assert all(bit_equal(got[k], before[k]) for k in before)


def _two_rank_save(rank: int, world: int, path: str, out: str) -> None:
    writer = _TimedWriter(path)
    dcp.save({f"rank{rank}.w": torch.full((512, 64), float(rank))}, storage_writer=writer)
    with open(os.path.join(out, f"log{rank}.json"), "w") as f:
        json.dump(writer.log, f)


def test_other_ranks_commit_before_write_data_returns(tmp_path: Path) -> None:
    out = tmp_path / "logs"
    out.mkdir()
    run_ranks(2, _two_rank_save, str(tmp_path / "ckpt"), str(out))
    logs = {r: json.loads((out / f"log{r}.json").read_text()) for r in range(2)}
    rank1 = logs[1]
    assert [name for name, _ in rank1] == ["data_committed", "write_data_returned"]
    rank0 = logs[0]
    assert _times(rank0, "write_data_returned")[0] < _times(rank0, "data_committed")[0]
    assert _times(rank0, "metadata_written")[0] > max(_times(rank0, "data_committed") + _times(rank1, "data_committed"))
    got = {f"rank{r}.w": torch.empty(512, 64) for r in range(2)}
    dcp.load(got, storage_reader=nvdcp.NvcompReader(tmp_path / "ckpt"), no_dist=True)
    assert all(torch.equal(got[f"rank{r}.w"], torch.full((512, 64), float(r))) for r in range(2))


def test_a_save_that_never_finishes_closes_its_files_at_the_next_reset(tmp_path: Path) -> None:
    """A coordinator whose save stopped after write_data (another rank failed) waits for its
    pending commits when the writer is reused, so no thread still writes into the directory."""
    writer = _TimedWriter(tmp_path / "ckpt", thread_count=2)
    finish = writer.finish
    calls = {"n": 0}

    def fail_once(*args: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("another rank failed")
        finish(*args, **kwargs)

    writer.finish = fail_once  # type: ignore[method-assign]
    with pytest.raises(CheckpointException) as info:
        dcp.save(_state(3), storage_writer=writer)
    assert "another rank failed" in str(failure_of(info.value))
    pending = writer._pending_commits
    assert pending is not None
    writer.reset()
    assert writer._pending_commits is None
    assert all(not t.is_alive() for t in pending._threads)
    dcp.save(_state(4), storage_writer=writer)
    assert (tmp_path / "ckpt" / METADATA_NAME).exists()

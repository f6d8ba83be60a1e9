"""Checkpoint management: latest usable checkpoint with incomplete and broken ones present,
keep-last-K pruning that never loses a usable or in-progress checkpoint, safe deletion, and the
same logic over an object-store root (an in-memory Storage with ``list_children``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from nvdcp import manage
from nvdcp.manage import (
    broadcast_latest_checkpoint,
    checkpoint_path,
    checkpoint_problem,
    delete_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
)


def _save(path: str, value: float = 1.0, stock: bool = False) -> None:
    sd = {"w": torch.full((64, 8), value), "step": torch.tensor(int(value))}
    writer = dcp.FileSystemWriter(path) if stock else nvdcp.NvcompWriter(path)
    dcp.save(sd, storage_writer=writer)


def _data_files(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith((".nvdcp", ".distcp")))


@pytest.fixture
def root(tmp_path: Path) -> str:
    """step 10, 20: complete; 25: complete but a data file is gone; 30: no .metadata (a save
    that died, or one in progress); plus entries that are not checkpoints."""
    r = str(tmp_path / "run")
    for step in (10, 20, 25, 30):
        _save(checkpoint_path(r, step), float(step))
    os.remove(os.path.join(checkpoint_path(r, 25), _data_files(checkpoint_path(r, 25))[0]))
    os.remove(os.path.join(checkpoint_path(r, 30), ".metadata"))
    os.makedirs(os.path.join(r, "tensorboard"))
    os.makedirs(os.path.join(r, "step_x"))
    Path(r, "step_00000040").write_text("a file, not a checkpoint")
    return r


def test_list_checkpoints(root: str) -> None:
    infos = list_checkpoints(root)
    assert [(c.step, c.complete) for c in infos] == [(10, True), (20, True), (25, True), (30, False)]
    assert infos[0].path == checkpoint_path(root, 10)
    assert list_checkpoints(os.path.join(root, "missing")) == []


def test_latest_skips_incomplete_and_broken(root: str) -> None:
    latest = latest_checkpoint(root)
    assert latest is not None and latest.step == 20
    unverified = latest_checkpoint(root, verify=False)
    assert unverified is not None and unverified.step == 25
    assert broadcast_latest_checkpoint(root) == latest  # no process group: same answer


def test_checkpoint_problem_names_the_cause(root: str) -> None:
    assert checkpoint_problem(checkpoint_path(root, 20)) is None
    assert "is missing" in (checkpoint_problem(checkpoint_path(root, 25)) or "")
    assert ".metadata is missing" in (checkpoint_problem(checkpoint_path(root, 30)) or "")
    path = checkpoint_path(root, 10)
    name = _data_files(path)[0]
    with open(os.path.join(path, name), "r+b") as f:
        f.truncate(100)
    assert "holds 100 bytes" in (checkpoint_problem(path) or "")


def test_resume_loads_the_latest(root: str) -> None:
    latest = latest_checkpoint(root)
    assert latest is not None
    out = {"w": torch.zeros(64, 8), "step": torch.tensor(0)}
    dcp.load(out, storage_reader=nvdcp.NvcompReader(latest.path))
    assert int(out["step"]) == 20 and torch.equal(out["w"], torch.full((64, 8), 20.0))


def test_prune_keeps_last_k_and_what_may_be_in_progress(root: str) -> None:
    assert [c.step for c in prune_checkpoints(root, 1, dry_run=True)] == [10]
    assert os.path.isdir(checkpoint_path(root, 10))
    deleted = prune_checkpoints(root, 1)
    assert [c.step for c in deleted] == [10]
    # 20 is kept; 25 (broken) and 30 (incomplete) are newer than it and are left alone.
    assert [c.step for c in list_checkpoints(root)] == [20, 25, 30]
    assert sorted(os.listdir(root)) == ["step_00000020", "step_00000025", "step_00000030", "step_00000040",
                                        "step_x", "tensorboard"]


def test_prune_removes_failed_leftovers_older_than_the_kept_ones(root: str) -> None:
    _save(checkpoint_path(root, 50), 50.0)
    _save(checkpoint_path(root, 60), 60.0)
    deleted = prune_checkpoints(root, 2)
    assert [c.step for c in deleted] == [10, 20, 25, 30]
    assert [c.step for c in list_checkpoints(root)] == [50, 60]
    latest = latest_checkpoint(root)
    assert latest is not None and latest.step == 60


def test_prune_deletes_nothing_without_a_usable_checkpoint(tmp_path: Path) -> None:
    r = str(tmp_path)
    _save(checkpoint_path(r, 1))
    os.remove(os.path.join(checkpoint_path(r, 1), ".metadata"))
    _save(checkpoint_path(r, 2))
    os.remove(os.path.join(checkpoint_path(r, 2), _data_files(checkpoint_path(r, 2))[0]))
    assert prune_checkpoints(r, 1) == []
    assert [c.step for c in list_checkpoints(r)] == [1, 2]


def test_delete_removes_metadata_first_and_keeps_unknown_files(tmp_path: Path) -> None:
    path = checkpoint_path(tmp_path, 7)
    _save(path)
    Path(path, "notes.txt").write_text("mine")
    assert delete_checkpoint(path) == ["notes.txt"]
    assert os.listdir(path) == ["notes.txt"]
    assert not list_checkpoints(tmp_path)[0].complete
    os.remove(os.path.join(path, "notes.txt"))
    assert delete_checkpoint(path) == [] and not os.path.exists(path)


def test_stock_dcp_checkpoints_can_be_pruned_without_verify(tmp_path: Path) -> None:
    _save(checkpoint_path(tmp_path, 1), stock=True)
    _save(checkpoint_path(tmp_path, 2), stock=True)
    # Their .metadata pickles a PosixPath, which nvdcp's restricted unpickler refuses: verify=False.
    assert "refusing to load" in (checkpoint_problem(checkpoint_path(tmp_path, 2)) or "")
    assert [c.step for c in prune_checkpoints(tmp_path, 1, verify=False)] == [1]
    assert not os.path.exists(checkpoint_path(tmp_path, 1))


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        prune_checkpoints(tmp_path, 0)
    with pytest.raises(ValueError, match="step"):
        checkpoint_path(tmp_path, -1)
    assert checkpoint_path("s3://b/run/", 3) == "s3://b/run/step_00000003"


# -- an object-store root ----------------------------------------------------------------------
class _MemoryStore:
    """The parts of :class:`nvdcp.storage.Storage` that manage.py uses, over one dict of keys."""

    def __init__(self, objects: dict[str, bytes], prefix: str) -> None:
        self.objects = objects
        self.prefix = prefix.rstrip("/")
        self.url = self.prefix

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def list_children(self) -> list[str]:
        lead = self.prefix + "/"
        return sorted({k[len(lead):].split("/")[0] for k in self.objects if k.startswith(lead) and "/" in k[len(lead):]})

    def list(self) -> list[str]:
        lead = self.prefix + "/"
        return sorted(k[len(lead):] for k in self.objects if k.startswith(lead) and "/" not in k[len(lead):])

    def exists(self, name: str) -> bool:
        return self._key(name) in self.objects

    def size(self, name: str) -> int:
        return len(self.objects[self._key(name)])

    def read(self, name: str) -> bytes:
        try:
            return self.objects[self._key(name)]
        except KeyError:
            raise FileNotFoundError(name) from None

    def delete(self, names: Iterable[str]) -> None:
        for n in names:
            self.objects.pop(self._key(n), None)

    def describe(self, name: str) -> str:
        return self._key(name)


@pytest.fixture
def s3_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, bytes]]:
    objects: dict[str, bytes] = {}
    for step in (1, 2, 3):
        local = str(tmp_path / f"s{step}")
        _save(local, float(step))
        for name in os.listdir(local):
            if step == 3 and name == ".metadata":
                continue  # step 3: an upload that never committed
            objects[f"s3://bucket/run/step_{step:08d}/{name}"] = Path(local, name).read_bytes()
    objects["s3://bucket/run/logs/loss.txt"] = b"x"
    seen: list[Any] = []

    def fake_open(path: str, options: Any) -> _MemoryStore:
        seen.append(options)
        return _MemoryStore(objects, path)

    monkeypatch.setattr(manage, "_open", fake_open)
    return "s3://bucket/run", objects


def test_object_store_root(s3_root: tuple[str, dict[str, bytes]]) -> None:
    url, objects = s3_root
    infos = list_checkpoints(url, {"endpoint_url": "http://127.0.0.1:9"})
    assert [(c.step, c.complete, c.path) for c in infos] == [
        (1, True, "s3://bucket/run/step_00000001"), (2, True, "s3://bucket/run/step_00000002"),
        (3, False, "s3://bucket/run/step_00000003")]
    latest = latest_checkpoint(url)
    assert latest is not None and latest.step == 2
    assert [c.step for c in prune_checkpoints(url, 1)] == [1]
    assert not any(k.startswith("s3://bucket/run/step_00000001/") for k in objects)
    assert any(k.startswith("s3://bucket/run/step_00000003/") for k in objects)  # in progress: kept
    assert "s3://bucket/run/logs/loss.txt" in objects


def test_object_store_without_listing_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoChildren:
        pass

    monkeypatch.setattr(manage, "_open", lambda path, options: NoChildren())
    with pytest.raises(NotImplementedError, match="cannot list"):
        list_checkpoints("s3://bucket/run")


def test_copied_checkpoint_directory_round_trip(root: str, tmp_path: Path) -> None:
    # A checkpoint copied elsewhere (rsync, `aws s3 sync`) stays usable: nothing absolute inside.
    dst = str(tmp_path / "copy" / "step_00000020")
    shutil.copytree(checkpoint_path(root, 20), dst)
    assert checkpoint_problem(dst) is None

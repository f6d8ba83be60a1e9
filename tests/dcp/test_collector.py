"""The collector is paused while nvdcp's storage steps run on the main thread, and only then.

What the planner sees during ``read_data`` and ``write_data`` (both call it per item) is
``gc.isenabled()`` at that moment; after the call the caller's setting is back.
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

import nvdcp
from nvdcp.dcp.collector import ENV_VAR, collector_paused


class _SeeingLoadPlanner(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        self.seen.append(gc.isenabled())
        return super().resolve_tensor(read_item)


class _SeeingSavePlanner(DefaultSavePlanner):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def resolve_data(self, write_item: Any) -> Any:
        self.seen.append(gc.isenabled())
        return super().resolve_data(write_item)


def _state() -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.arange(64, dtype=torch.float32) + i for i in range(5)}


def _save_and_load(path: Path) -> tuple[list[bool], list[bool], dict[str, torch.Tensor]]:
    saver = _SeeingSavePlanner()
    dcp.save(_state(), storage_writer=nvdcp.NvcompWriter(path), planner=saver)
    loader = _SeeingLoadPlanner()
    dest = {k: torch.zeros_like(v) for k, v in _state().items()}
    dcp.load(dest, storage_reader=nvdcp.NvcompReader(path), planner=loader)
    return saver.seen, loader.seen, dest


def test_paused_during_steps_on_the_main_thread_and_restored(tmp_path: Path) -> None:
    assert gc.isenabled()
    saved_seen, loaded_seen, dest = _save_and_load(tmp_path / "ck")
    assert saved_seen and not any(saved_seen)
    assert loaded_seen and not any(loaded_seen)
    assert gc.isenabled()
    for key, value in _state().items():
        assert torch.equal(dest[key], value)


def test_left_alone_on_another_thread(tmp_path: Path) -> None:
    # dcp.async_save's storage steps run on a thread while training goes on: no pause there.
    out: dict[str, Any] = {}

    def run() -> None:
        out["seen"] = _save_and_load(tmp_path / "ck")

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    saved_seen, loaded_seen, _ = out["seen"]
    assert saved_seen and all(saved_seen)
    assert loaded_seen and all(loaded_seen)


def test_left_alone_when_switched_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "0")
    saved_seen, loaded_seen, _ = _save_and_load(tmp_path / "ck")
    assert all(saved_seen) and all(loaded_seen)


def test_a_caller_that_paused_it_keeps_it_paused(tmp_path: Path) -> None:
    gc.disable()
    try:
        _save_and_load(tmp_path / "ck")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_resumed_when_the_step_raises() -> None:
    @collector_paused
    def failing() -> None:
        assert not gc.isenabled()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        failing()
    assert gc.isenabled()

"""benchmarks/plan_caching_probe.py at a tiny size: every setting saves, the JSON is complete."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from torch.distributed.checkpoint import DefaultSavePlanner

from benchmarks import plan_caching_probe


@pytest.mark.skipif("enable_plan_caching" not in inspect.signature(DefaultSavePlanner).parameters,
                    reason="this torch's DefaultSavePlanner has no plan caching")
def test_every_writer_and_planner_saves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_caching_probe.main(["--case", "demo", "--rounds", "1", "--dir", str(tmp_path / "ck"), "--out", str(tmp_path)])
    assert "nvdcp / stock: default planner" in capsys.readouterr().out
    (result,) = tmp_path.glob("plan_caching_probe_*.json")
    payload = json.loads(result.read_text())
    assert {"date", "machine", "command"} <= payload.keys()
    assert set(payload["medians_s"]) == {"stock default", "stock caching", "nvdcp default", "nvdcp caching"}
    assert all(v > 0 for v in payload["medians_s"].values())
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())

"""benchmarks/reliability_sweep.py smoke-run at tiny size (its crash and concurrency sections are
what test_crash.py and test_concurrency.py already run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import reliability_sweep

pytestmark = pytest.mark.timeout(240)


def test_sweep_tiny(tmp_path: Path) -> None:
    payload = reliability_sweep.main(["--tiny", "--only", "corruption,chain,fuzz,gdeflate,disk", "--workers", "1",
                                      "--out", str(tmp_path)])
    [written] = tmp_path.glob("reliability_sweep_*.json")
    assert json.loads(written.read_text())["schema"] == "nvdcp.reliability_sweep/1"
    for codec, part in payload["corruption"].items():
        assert part["failure_count"] == 0, (codec, part["failures"])
        assert not any("WRONG" in k or "intact" in k and "payload" in k for k in part["outcomes"]), part
    for codec, part in payload["chain_corruption"].items():
        assert part["failure_count"] == 0 and part["cases"] == 60, (codec, part["failures"])
    assert all(f["result"] == "ok" for f in payload["fuzz"].values()), payload["fuzz"]
    assert payload["gdeflate_streams"].get("result", "ok") == "ok" or "skipped" in payload["gdeflate_streams"]
    assert not payload["disk"].get("problems"), payload["disk"]

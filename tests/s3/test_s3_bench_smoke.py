"""Smoke run of ``python -m benchmarks.s3_bench`` at tiny size: it runs, verifies loads and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.s3

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_s3_bench_tiny(tmp_path: Path) -> None:
    pytest.importorskip("s3fs")
    cmd = [sys.executable, "-m", "benchmarks.s3_bench", "--size", "tiny", "--variants", "nvdcp-boto3,torch-fsspec",
           "--out", str(tmp_path), "--timeout", "120"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=220, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| nvdcp-boto3 | save |" in proc.stdout
    (result,) = tmp_path.glob("s3_*.json")
    payload = json.loads(result.read_text())
    assert payload["machine"]["cores"] and payload["command"] and payload["date"]
    rows = {(r["variant"], r["phase"]): r for r in payload["results"]}
    assert set(rows) == {(v, p) for v in ("nvdcp-boto3", "torch-fsspec") for p in ("save", "load")}
    for (_, phase), row in rows.items():
        assert "error" not in row, row
        assert row["requests"] > 0 and row["wall_s"] > 0 and row["peak_rss_bytes"] > 0
        if phase == "save":
            assert row["bytes_up"] >= row["stored_bytes"] > 0
        else:
            assert row["bit_exact"] is True

"""benchmarks/local_ranks_bench.py at a tiny size: two real ranks, both sizings, loads bit-exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import local_ranks_bench
from nvdcp import cores


def test_two_ranks_both_sizings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    local_ranks_bench.main(["--ranks", "2", "--case", "demo", "--rounds", "1", "--dir", str(tmp_path / "ck"),
                            "--out", str(tmp_path)])
    assert "local=2 / local=1:" in capsys.readouterr().out
    (result,) = tmp_path.glob("local_ranks_bench_*.json")
    payload = json.loads(result.read_text())
    assert {"date", "machine", "command"} <= payload.keys()
    summary = payload["summary"]
    assert summary.keys() == {"local=1", "local=2"}
    assert all(row["bit_exact"] and row["save_s"] > 0 and row["load_s"] > 0 for row in summary.values())
    if not cores.pinned_alone():  # each of two ranks sizes its pools for half the cores it would alone
        assert summary["local=2"]["cores_per_rank"] <= -(-summary["local=1"]["cores_per_rank"] // 2)

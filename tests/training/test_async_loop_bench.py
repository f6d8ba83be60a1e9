"""Smoke test of benchmarks/async_loop_bench.py: its tiny CPU config runs all variants, loads
every variant's last checkpoint bit for bit and writes its JSON; without a GPU the full
config refuses with a clear message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import async_loop_bench


def test_small_config_runs_and_writes_json(tmp_path: Path) -> None:
    rc = async_loop_bench.main(["--small", "--out", str(tmp_path / "out"), "--dir", str(tmp_path / "ckpt")])
    assert rc == 0
    (result,) = (tmp_path / "out").glob("async_loop_bench_*.json")
    payload = json.loads(result.read_text())
    assert {"date", "machine", "command", "results"} <= payload.keys()
    assert {r["variant"] for r in payload["results"]} == {"nvdcp", "nvdcp_cold", "default_stager"}
    assert all(r["bit_exact"] for r in payload["results"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the full config runs on a GPU")
def test_full_config_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert async_loop_bench.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err

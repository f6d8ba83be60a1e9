"""The demo (torchrun, 2 then 3 processes, async_save, resume verified) and the async_save
benchmark, smoke-run at tiny sizes on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--context", "16"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_async_save_resumes_bit_exactly_at_another_world_size(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    ran = subprocess.run(
        [sys.executable, "-m", "nvdcp.demo", "--ckpt-root", str(root), "--steps", "4", "--save-every", "2",
         "--async-save", *TINY],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=540, check=False,
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    out = ran.stdout
    assert "resume verified" in out and "dcp.async_save (thread) on 2 ranks" in out
    assert "resumed from" in out and "(step 4) on 3 ranks" in out
    assert "nvdcp async_save:" in out and "stock async_save:" in out  # bytes/ratio/time next to stock's
    assert "| 4 | nvdcp (NvcompStager) |" in out
    # keep-last 3 of the saves at steps 2, 4, 6, 8
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000006", "step_00000008"]


def test_demo_refuses_a_root_that_holds_checkpoints(tmp_path: Path) -> None:
    from nvdcp.demo.__main__ import main

    (tmp_path / "step_00000001").mkdir()
    assert main(["--ckpt-root", str(tmp_path)]) == 2


def test_storage_options_parse() -> None:
    from nvdcp.demo.train import parse_storage_options

    assert parse_storage_options(["endpoint_url=http://127.0.0.1:9000", "part_size=8388608", "verify=false"]) == {
        "endpoint_url": "http://127.0.0.1:9000", "part_size": 8388608, "verify": False}
    with pytest.raises(Exception, match="KEY=VALUE"):
        parse_storage_options(["nope"])


@pytest.mark.timeout(300)
def test_async_bench_small(tmp_path: Path) -> None:
    from benchmarks import async_bench

    assert async_bench.main(["--small", "--dir", str(tmp_path / "runs"), "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("async_bench_*.json")
    doc = json.loads(result.read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert {"stock + DefaultStager", "nvdcp + NvcompStager", "nvdcp + NvcompStager cpu compress"} <= set(rows)
    for r in rows.values():
        assert r["bit_exact"] and r["blocked_s"] > 0 and r["durable_s"] >= r["blocked_s"]
    assert rows["nvdcp + NvcompStager"]["ratio"] > 1.1
    assert rows["nvdcp + NvcompStager cpu compress"]["stage"]["compressed_shards"] > 0

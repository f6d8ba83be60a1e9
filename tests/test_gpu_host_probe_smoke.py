"""benchmarks/gpu_host_probe.py at a tiny size, in a subprocess (it stubs nvCOMP and CUDA queries
process-wide): both parts run through the GPU load's host code and the JSON comes out. Nothing
here depends on timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_runs_end_to_end(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_host_probe", "--count", "300", "--batch", "120", "--repeats", "1",
         "--dir", str(tmp_path / "ckpt"), "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "batch: 120 items" in done.stdout and "main: 300 items" in done.stdout
    (target,) = tmp_path.glob("gpu_host_probe_*.json")
    payload = json.loads(target.read_text())
    assert {"date", "machine", "command", "rows"} <= payload.keys()
    assert payload["rows"]["batch"]["items"] == 120 and payload["rows"]["main"]["items"] == 300
    assert all(row["best_s"] > 0 and len(row["seconds"]) == 1 for row in payload["rows"].values())

"""GpuDecoder's pass logic (slot tables, the staging tail, device checksums, the plane-merge
kernel, passes, damaged chunks and chunks nvCOMP reports failed named) on the CPU: Triton's
interpreter runs the kernels on CPU tensors and the CPU codecs stand in for nvCOMP's batched
calls (tests/gpu/host_decoder_run.py). Needs triton,
no GPU; the real thing runs in the other tests of this directory on the H200."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", ["fused", "legacy"])
def test_decoder_passes_on_the_host(mode: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "NVDCP_DEVICE_CRC": "1", "NVDCP_GPU_MERGE": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args = [sys.executable, "-m", "tests.gpu.host_decoder_run"] + (["--legacy"] if mode == "legacy" else [])
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count(": ok") == 3, done.stdout

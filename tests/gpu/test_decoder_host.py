"""GpuDecoder's pass logic (slot tables, the staging tail, device checksums, the plane-merge
kernel, passes, damaged chunks and chunks nvCOMP reports failed named) on the CPU: Triton's
interpreter runs the kernels on CPU tensors and the CPU codecs stand in for nvCOMP's batched
calls (tests/gpu/host_decoder_run.py). Needs triton,
no GPU; the real thing runs in the other tests of this directory on the H200."""

from __future__ import annotations

import pytest

from tests.gpu.interpreted import run_interpreted

pytest.importorskip("triton")


@pytest.mark.parametrize("mode", ["fused", "legacy"])
def test_decoder_passes_on_the_host(mode: str) -> None:
    args = ["-m", "tests.gpu.host_decoder_run"] + (["--legacy"] if mode == "legacy" else [])
    done = run_interpreted(args, ("NVDCP_DEVICE_CRC", "NVDCP_GPU_MERGE"))
    assert done.stdout.count(": ok") == 3, done.stdout

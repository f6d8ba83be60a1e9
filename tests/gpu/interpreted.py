"""Running GPU code on the host: a child Python under Triton's interpreter (``TRITON_INTERPRET=1``,
set before triton is imported, hence the child process), with nvdcp's kernel switches on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(args: list[str], switches: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """``python *args`` from the repository root with ``TRITON_INTERPRET=1`` and each of
    ``switches`` (environment variables such as ``NVDCP_GPU_FOLD``) set to 1; asserts that it
    exits 0 (its output's tails in the message) and returns it."""
    env = {**os.environ, "TRITON_INTERPRET": "1", **dict.fromkeys(switches, "1"),
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done

"""Write the golden checkpoints in tests/golden/v1 (run once per format version; commit the output).

    python -m tests.golden.make_golden

Tensors are derived from SHA-256 streams, not from an RNG or float math, so the expected bytes
are the same on every machine and torch version. test_golden.py decodes the committed files on
every test run: if a change to nvdcp alters how existing checkpoints decode, that test fails.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import nvdcp

HERE = Path(__file__).parent / "v1"
CODECS = ["zstd", "gdeflate", "none"]


def det_bytes(label: str, n: int) -> bytes:
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"{label}/{counter}".encode()).digest()
        counter += 1
    return bytes(out[:n])


def weights_from_bytes(label: str, n: int) -> torch.Tensor:
    """fp32 values with weight-like exponents: sign + exponent in a narrow band, random mantissa."""
    raw = torch.frombuffer(bytearray(det_bytes(label, 4 * n)), dtype=torch.int32).clone()
    exponent = 115 + (raw & 0x7) + ((raw >> 3) & 0x3)  # 2^-12 .. 2^-2
    bits = (raw & ~0x7F800000) | (exponent << 23)
    return bits.view(torch.float32)


def golden_state() -> dict[str, object]:
    return {
        "model.w": weights_from_bytes("w", 40_000).reshape(200, 200),
        "model.w16": weights_from_bytes("w16", 30_000).bfloat16().reshape(100, 300),
        "model.ids": torch.frombuffer(bytearray(det_bytes("ids", 8 * 5000)), dtype=torch.int64).clone() % 1000,
        "model.mask": torch.frombuffer(bytearray(det_bytes("mask", 777)), dtype=torch.uint8).clone() > 127,
        "model.scalar": torch.tensor(2.5),
        "model.empty": torch.empty(0, 3),
        "extra": io.BytesIO(det_bytes("extra", 3000)),
        "step": 42,
    }


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    if HERE.exists() and "--force" not in sys.argv:
        raise SystemExit(f"{HERE} exists: golden files are never regenerated for a released format")
    shutil.rmtree(HERE, ignore_errors=True)
    expected: dict[str, str] = {}
    for k, v in golden_state().items():
        if isinstance(v, torch.Tensor):
            expected[k] = digest(v)
        elif isinstance(v, io.BytesIO):
            expected[k] = hashlib.sha256(v.getvalue()).hexdigest()
    for codec in CODECS:
        dcp.save(golden_state(), storage_writer=nvdcp.NvcompWriter(HERE / codec, codec=codec))
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()

"""Write the golden checkpoints in tests/golden/v1 (run once per format version; commit the output).

    python -m tests.golden.make_golden          # v1: whole items, one checkpoint per CPU codec
    python -m tests.golden.make_golden --v2     # v2: a full base and a delta on top (CPU zstd)

Tensors are derived from SHA-256 streams, not from an RNG or float math, so the expected bytes
are the same on every machine and torch version. test_golden.py decodes the committed files on
every test run: if a change to nvdcp alters how existing checkpoints decode, that test fails.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import nvdcp

HERE = Path(__file__).parent / "v1"
CODECS = ["zstd", "gdeflate", "none"]
HERE_V2 = Path(__file__).parent / "v2"
#: The v2 delta's chunk size: 64 KiB, from before writers that save deltas defaulted to 32 KiB
#: (nvdcp.dcp.delta.DELTA_CHUNK_BYTES); pinned so that the committed records stay reproducible.
GOLDEN_CHUNK_BYTES = 64 << 10


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


def golden_target() -> dict[str, object]:
    """A state shaped like :func:`golden_state` with every value zeroed: what a load fills."""
    sd = golden_state()
    for v in sd.values():
        if isinstance(v, torch.Tensor):
            v.zero_() if v.dtype != torch.bool else v.fill_(False)
    sd["extra"] = io.BytesIO()
    sd["step"] = 0
    return sd


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


# -- v2: delta records ------------------------------------------------------------------------
def golden_state_v2() -> dict[str, object]:
    """golden_state() one 'training step' later, by integer edits of the bits (no float math):
    low mantissa bits of the float tensors flipped in a deterministic pattern, a few ids moved,
    the scalar and the BYTE_IO item replaced (too small to pay as deltas: stored whole); the mask
    unchanged (a delta of zeros)."""
    sd = golden_state()
    w = sd["model.w"].view(torch.int32)  # type: ignore[union-attr]
    flips = torch.frombuffer(bytearray(det_bytes("w-step", 4 * w.numel())), dtype=torch.int32).reshape(w.shape)
    w ^= flips & 0x3FF  # the 10 low mantissa bits
    w16 = sd["model.w16"].view(torch.int16)  # type: ignore[union-attr]
    flips16 = torch.frombuffer(bytearray(det_bytes("w16-step", 2 * w16.numel())), dtype=torch.int16).reshape(w16.shape)
    w16 ^= flips16 & 0x3  # the 2 low mantissa bits
    ids = sd["model.ids"]
    ids[100:110] += 1  # type: ignore[index]
    ids[4000:4003] = 7  # type: ignore[index]
    sd["model.scalar"] = torch.tensor(3.25)
    sd["extra"] = io.BytesIO(det_bytes("extra-step", 3000))
    sd["step"] = 43
    return sd


#: What the v2 delta checkpoint must hold as delta records (the rest are stored whole, as v1).
V2_DELTA_ITEMS = ("model.w", "model.w16", "model.ids", "model.mask")


def record_bytes(path: Path) -> dict[str, bytes]:
    """Each item's stored record (header and payload) by fully qualified name."""
    md = nvdcp.NvcompReader(path).read_metadata()
    out = {}
    for index, info in md.storage_data.items():
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            out[index.fqn] = f.read(info.length)
    return out


def expected_of(sd: dict[str, object]) -> dict[str, str]:
    expected: dict[str, str] = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            expected[k] = digest(v)
        elif isinstance(v, io.BytesIO):
            expected[k] = hashlib.sha256(v.getvalue()).hexdigest()
    return expected


def save_v2(where: Path) -> None:
    """The v2 pair under ``where``: ``base`` (saved whole) and ``delta`` (saved against it).
    Saved from inside ``where`` with relative locations, so the delta's ``.metadata`` names its
    base as ``base`` / ``../base`` and not by this machine's absolute path."""
    where.mkdir(parents=True, exist_ok=True)
    with contextlib.chdir(where) if hasattr(contextlib, "chdir") else _chdir(where):
        dcp.save(golden_state(), storage_writer=nvdcp.NvcompWriter("base", codec="zstd"))
        dcp.save(golden_state_v2(), storage_writer=nvdcp.NvcompWriter("delta", codec="zstd", base="base",
                                                                      chunk_bytes=GOLDEN_CHUNK_BYTES))


@contextlib.contextmanager
def _chdir(where: Path):  # type: ignore[no-untyped-def]
    old = os.getcwd()
    os.chdir(where)
    try:
        yield
    finally:
        os.chdir(old)


def main_v2() -> None:
    if HERE_V2.exists() and "--force" not in sys.argv:
        raise SystemExit(f"{HERE_V2} exists: golden files are never regenerated for a released format")
    shutil.rmtree(HERE_V2, ignore_errors=True)
    save_v2(HERE_V2)
    records = record_bytes(HERE_V2 / "delta")
    expected = {
        "base": expected_of(golden_state()),
        "delta": expected_of(golden_state_v2()),
        # sha256 of every stored record of the delta checkpoint: a change of the v2 record
        # layout or of how deltas are encoded shows up here
        "delta_records": {k: hashlib.sha256(v).hexdigest() for k, v in sorted(records.items())},
        "delta_items": list(V2_DELTA_ITEMS),
    }
    (HERE_V2 / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main_v2() if "--v2" in sys.argv else main()

"""The state the CLI tests save, and bit-exact comparison; torch only (no nvdcp import), so a
process that must not see nvdcp (the stock-only load) can use it too."""

from __future__ import annotations

import io
from typing import Any

import torch


def make_state() -> dict[str, Any]:
    """Every kind of item a user's checkpoint has: weights in several dtypes, integers, masks,
    an empty tensor, a 0-d tensor, a Python value and a bytes object."""
    g = torch.Generator().manual_seed(7)
    return {
        "model": {
            "embed.weight": torch.randn(300, 257, generator=g) * 0.02,
            "head.weight": (torch.randn(128, 96, generator=g) * 0.02).bfloat16(),
            "norm.weight": (1 + torch.randn(77, generator=g) * 0.01).half(),
            "ids": torch.arange(5000),
            "mask": torch.rand(999, generator=g) > 0.3,
            "empty": torch.zeros(0, 3),
            "scale": torch.tensor(3.5),
        },
        "step": 7,
        "extra": io.BytesIO(b"hello" * 100),
    }


def blank_like(state: dict[str, Any]) -> dict[str, Any]:
    """Same structure, different contents: what a load must overwrite."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.full_like(v, 1) if v.dtype != torch.bool else torch.zeros_like(v)
        elif isinstance(v, dict):
            out[k] = blank_like(v)
        elif isinstance(v, io.BytesIO):
            out[k] = io.BytesIO()
        else:
            out[k] = None
    return out


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def assert_same(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and bit_equal(got, want), path
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, io.BytesIO):
        assert got.getvalue() == want.getvalue(), path
    else:
        assert got == want, path

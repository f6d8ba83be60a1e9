"""Shared fixtures: GPU detection, deterministic state dicts, checkpoint helpers."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def has_cuda_nvcomp() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import nvidia.nvcomp  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_cuda_nvcomp():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CUDA and nvidia-nvcomp-cu12")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not the tests/gpu folder's name
            item.add_marker(skip)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality for any dtype (NaNs and float8 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    from nvdcp.dcp.writer import flat_bytes

    return torch.equal(flat_bytes(a), flat_bytes(b))


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bits of any dtype: every bit pattern, NaNs and infs included."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for s in shape:
        numel *= s
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


def weights_like(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


ALL_DTYPES = [
    d
    for d in [
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.complex32, torch.complex64, torch.complex128,
        getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None),
        getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
        getattr(torch, "float8_e4m3fnuz", None), getattr(torch, "float8_e5m2fnuz", None),
        getattr(torch, "float8_e8m0fnu", None),
    ]
    if d is not None
]

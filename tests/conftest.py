"""Shared fixtures: GPU detection, deterministic state dicts, checkpoint helpers."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite's states are small: its delta tests store every item as a delta whatever its size
# (workers it starts inherit this). tests/dcp/test_delta_min_item_bytes.py covers the default.
os.environ["NVDCP_DELTA_MIN_ITEM_BYTES"] = "0"
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

# Re-exported: many tests import these from here; the one copy is in nvdcp.testing.
from nvdcp.testing import bit_equal, random_tensor, weights_like  # noqa: E402, F401


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

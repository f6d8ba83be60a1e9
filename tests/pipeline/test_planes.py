"""Byte planes on the CPU path: the native split/merge equals numpy's, and items encode to the
same bytes (and decode alike) with the native library and without it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from nvdcp.format import crc
from nvdcp.format.dtypes import dtype_code
from nvdcp.format.header import KIND_TENSOR
from nvdcp.pipeline import cpu
from nvdcp.pipeline.policy import choose_layout
from nvdcp.pipeline.tensors import tensor_to_host_bytes
from nvdcp.transform import byteplanes

_SIZES = [1, 2, 3, 4, 8, 16]
_COUNTS = [0, 1, 15, 16, 17, 31, 33, 1000, 65536, 65537]


@pytest.fixture(params=["native", "fallback"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native":
        if not cpu.native_planes_available():
            pytest.skip("nvdcp.format._crc32c_batch is not built here")
    else:
        monkeypatch.setattr(cpu, "_native_split", lambda: None)
        monkeypatch.setattr(cpu, "_native_merge", lambda: None)
        monkeypatch.setattr(crc, "_native", lambda: None)
    return request.param


@pytest.mark.parametrize("size", _SIZES)
@pytest.mark.parametrize("count", _COUNTS)
def test_split_and_merge_equal_numpy(mode: str, size: int, count: int) -> None:
    rng = np.random.default_rng(size * 100_003 + count)
    backing = rng.integers(0, 256, size=count * size + 5, dtype=np.uint8)
    for align in (0, 3):  # unaligned sources and destinations too
        src = backing[align : align + count * size]
        want = byteplanes.split(src, size)
        assert np.array_equal(cpu.split_planes(src, size), want)
        out_backing = np.full(count * size + 5, 0xEE, dtype=np.uint8)
        out = out_backing[align : align + count * size]
        planes = [np.ascontiguousarray(want[p]) for p in range(size)]
        cpu.merge_planes(planes, out)
        assert np.array_equal(out, src)
        assert (out_backing[:align] == 0xEE).all() and (out_backing[align + count * size :] == 0xEE).all()


def test_split_fills_a_given_array(mode: str) -> None:
    src = np.arange(64, dtype=np.uint8)
    out = np.zeros((4, 16), dtype=np.uint8)
    assert cpu.split_planes(src, 4, out) is out
    assert out[3].tolist() == list(range(3, 64, 4))


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64, torch.complex64]


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("numel", [0, 1, 1000, 70_000, 300_001])
def test_items_encode_alike_with_and_without_the_library(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                          numel: int) -> None:
    if not cpu.native_planes_available():
        pytest.skip("nvdcp.format._crc32c_batch is not built here")
    g = torch.Generator().manual_seed(numel)
    t = (torch.randn(numel, generator=g) * 3).to(dtype) if dtype.is_floating_point or dtype.is_complex else \
        torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)
    raw = tensor_to_host_bytes(t)
    kwargs = dict(kind=KIND_TENSOR, dtype_code=dtype_code(dtype), shape=tuple(t.shape), element_size=t.element_size(),
                  layout=choose_layout(dtype, "zstd"), chunk_bytes=1 << 14)
    with ThreadPoolExecutor(2) as pool:
        native = cpu.encode_item(raw, pool=pool, **kwargs)  # type: ignore[arg-type]
        record = memoryview(native.header_bytes + b"".join(bytes(c) for c in native.chunks))
        _, decoded_native = cpu.decode_item(record, "x", pool, t.element_size())
        with monkeypatch.context() as m:
            m.setattr(cpu, "_native_split", lambda: None)
            m.setattr(cpu, "_native_merge", lambda: None)
            m.setattr(crc, "_native", lambda: None)
            fallback = cpu.encode_item(raw, pool=pool, **kwargs)  # type: ignore[arg-type]
            _, decoded_fallback = cpu.decode_item(record, "x", pool, t.element_size())
    assert native.header_bytes == fallback.header_bytes
    assert [bytes(c) for c in native.chunks] == [bytes(c) for c in fallback.chunks]
    assert np.array_equal(decoded_native, raw) and np.array_equal(decoded_fallback, raw)

"""Tensor -> bytes helpers: only the view's elements, row-major, lazy conj/neg materialized."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from nvdcp.pipeline import tensors as tensors_mod
from nvdcp.pipeline.tensors import flat_bytes, has_lazy_bits, plain, tensor_nbytes, tensor_to_host_bytes
from tests.conftest import random_tensor

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def _check_flat(t: torch.Tensor, expected: bytes) -> torch.Tensor:
    flat = flat_bytes(t)
    assert flat.dtype == torch.uint8
    assert flat.dim() == 1 and flat.stride() == (1,)
    assert flat.numel() == t.numel() * t.element_size()
    assert flat.numpy().tobytes() == expected
    return flat


def test_flat_bytes_of_a_contiguous_tensor_is_a_view() -> None:
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    flat = _check_flat(t, np.arange(12, dtype="<i4").tobytes())
    assert flat.data_ptr() == t.data_ptr()  # no copy


def test_flat_bytes_of_a_column_slice_holds_only_the_view() -> None:
    base = torch.arange(20, dtype=torch.int64).reshape(4, 5)
    view = base[:, 1:3]
    assert not view.is_contiguous()
    _check_flat(view, np.arange(20, dtype="<i8").reshape(4, 5)[:, 1:3].tobytes())


def test_flat_bytes_of_a_strided_step() -> None:
    base = torch.arange(30, dtype=torch.float32)
    _check_flat(base[::3], np.arange(30, dtype="<f4")[::3].tobytes())


def test_flat_bytes_of_a_transposed_tensor_is_row_major() -> None:
    base = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    t = base.t()
    _check_flat(t, np.arange(6, dtype="<i2").reshape(2, 3).T.copy().tobytes())
    # bytes of row-major [[0,3],[1,4],[2,5]]
    assert flat_bytes(t).view(torch.int16).tolist() == [0, 3, 1, 4, 2, 5]


def test_flat_bytes_of_an_expanded_tensor() -> None:
    t = torch.tensor([1, 2], dtype=torch.int8).expand(3, 2)
    assert t.stride() == (0, 1)
    _check_flat(t, bytes([1, 2, 1, 2, 1, 2]))


@pytest.mark.parametrize("stride", [2, 5, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float64])
def test_flat_bytes_of_a_size1_tensor_with_an_odd_stride(stride: int, dtype: torch.dtype) -> None:
    storage = random_tensor(dtype, (stride + 1,), seed=stride)
    t = storage.as_strided((1,), (stride,), 1)
    assert t.is_contiguous()  # torch ignores strides of size-1 dims
    assert t.stride() == (stride,)
    _check_flat(t, storage[1:2].contiguous().view(torch.uint8).numpy().tobytes())


def test_flat_bytes_of_a_size1_2d_tensor_with_odd_strides() -> None:
    storage = torch.arange(50, dtype=torch.float32)
    t = storage.as_strided((1, 1), (7, 3), 9)
    _check_flat(t, np.array([9.0], dtype="<f4").tobytes())


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16, torch.bool, torch.complex64])
def test_flat_bytes_of_a_0dim_tensor(dtype: torch.dtype) -> None:
    t = random_tensor(dtype, (), seed=1)
    assert t.dim() == 0
    flat = flat_bytes(t)
    assert flat.shape == (t.element_size(),)
    assert flat.numpy().tobytes() == t.reshape(1).view(torch.uint8).numpy().tobytes()


def test_flat_bytes_of_a_0dim_element_of_a_larger_tensor() -> None:
    base = torch.arange(10, dtype=torch.int32)
    t = base[7]
    assert t.dim() == 0 and t.storage_offset() == 7
    assert flat_bytes(t).view(torch.int32).tolist() == [7]


def test_flat_bytes_of_an_empty_tensor() -> None:
    t = torch.empty(0, 5, dtype=torch.float32)
    assert flat_bytes(t).numel() == 0


@pytest.mark.parametrize("dtype", [torch.bool, torch.float16, torch.complex32, torch.complex128,
                                   torch.float8_e4m3fn, torch.uint16])
def test_flat_bytes_dtypes_without_numpy_twins(dtype: torch.dtype) -> None:
    t = random_tensor(dtype, (4, 6), seed=2)[:, 1::2]
    ref = random_tensor(dtype, (4, 6), seed=2).view(torch.uint8).reshape(4, 6, -1)[:, 1::2].contiguous()
    assert flat_bytes(t).numpy().tobytes() == ref.numpy().tobytes()


# -- tensor_to_host_bytes ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(3, 4),
        lambda: torch.randn(3, 4).t(),
        lambda: torch.randn(6, 7)[1:5:2, ::3],
        lambda: torch.arange(100, dtype=torch.int64).reshape(10, 10)[:, 3],
        lambda: torch.tensor(2.5, dtype=torch.float64),
        lambda: (torch.rand(17) > 0.5),
        lambda: torch.randint(-100, 100, (5, 5), dtype=torch.int8).t(),
        lambda: torch.randn(4, 3, dtype=torch.complex64)[:, 1],
    ],
    ids=["contig", "transposed", "sliced", "column", "scalar", "bool", "int8-t", "complex-col"],
)
def test_tensor_to_host_bytes_equals_numpy_view_bytes(make: Callable[[], torch.Tensor]) -> None:
    t = make()
    got = tensor_to_host_bytes(t)
    assert isinstance(got, np.ndarray) and got.dtype == np.uint8 and got.ndim == 1
    assert got.tobytes() == np.ascontiguousarray(t.numpy()).tobytes()


def test_tensor_to_host_bytes_of_an_empty_tensor() -> None:
    got = tensor_to_host_bytes(torch.empty(3, 0, 2))
    assert got.dtype == np.uint8 and got.shape == (0,)


def test_tensor_to_host_bytes_detaches_tensors_that_require_grad() -> None:
    t = torch.randn(5, requires_grad=True)
    assert tensor_to_host_bytes(t * 2).tobytes() == (t.detach() * 2).numpy().tobytes()


def test_tensor_to_host_bytes_of_a_bfloat16_view() -> None:
    t = random_tensor(torch.bfloat16, (8, 8), seed=3)[::2, 1::3]
    expected = t.contiguous().view(torch.int16).numpy().tobytes()
    assert tensor_to_host_bytes(t).tobytes() == expected


def test_conj_view_is_materialized() -> None:
    base = torch.randn(6, dtype=torch.complex64)
    view = base.conj()
    assert view.is_conj()
    got = tensor_to_host_bytes(view).view(np.complex64)
    assert np.array_equal(got, np.conj(base.numpy()))
    # the bytes are the conjugate's, not the base's
    assert not np.array_equal(got, base.numpy())


def test_conj_of_a_transposed_view() -> None:
    base = torch.randn(3, 4, dtype=torch.complex128)
    view = base.t().conj()
    got = tensor_to_host_bytes(view).view(np.complex128).reshape(4, 3)
    assert np.array_equal(got, np.conj(base.numpy()).T)


@pytest.mark.skipif(not hasattr(torch.Tensor, "_neg_view"), reason="torch without _neg_view")
def test_neg_view_is_materialized() -> None:
    base = torch.tensor([1.5, -2.0, 0.25], dtype=torch.float32)
    view = base._neg_view()
    assert view.is_neg()
    got = tensor_to_host_bytes(view).view(np.float32)
    assert got.tolist() == [-1.5, 2.0, -0.25]


def test_plain_resolves_conj_and_neg_and_detaches() -> None:
    base = torch.randn(4, dtype=torch.complex64, requires_grad=True)
    p = plain(base.conj())
    assert not p.is_conj() and not p.requires_grad
    assert torch.equal(p, base.detach().conj().resolve_conj())
    if hasattr(torch.Tensor, "_neg_view"):
        n = plain(torch.ones(3)._neg_view())
        assert not n.is_neg() and n.tolist() == [-1.0, -1.0, -1.0]


def test_plain_keeps_a_plain_tensor() -> None:
    t = torch.randn(3)
    assert plain(t).data_ptr() == t.data_ptr()


# -- tensor_nbytes -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("shape", "dtype", "expected"),
    [
        ((), torch.float32, 4),
        ((0,), torch.float64, 0),
        ((3, 0, 5), torch.int8, 0),
        ((3, 5), torch.bfloat16, 30),
        (torch.Size([7, 11]), torch.complex128, 7 * 11 * 16),
        ([2, 3, 4], torch.bool, 24),
        ((1 << 20, 1 << 12), torch.float32, 1 << 34),
    ],
)
def test_tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype, expected: int) -> None:
    assert tensor_nbytes(shape, dtype) == expected
    if expected < 1 << 20:
        assert torch.empty(tuple(shape), dtype=dtype).nbytes == expected


def _lazy_cases() -> list[torch.Tensor]:
    z = torch.randn(6, dtype=torch.complex64)
    r = torch.randn(6)
    return [
        r, z, z.conj(), z.conj().imag, z.conj().imag.detach(), torch._neg_view(r), torch._neg_view(r).detach(),
        z.conj().clone(), z.conj().resolve_conj(), r.requires_grad_(False)[1:], torch.randn(2, 3).t(),
        torch.empty(0), torch.tensor(1.5),
    ]


@pytest.mark.parametrize("from_keys", [True, False])
def test_has_lazy_bits_says_what_is_conj_or_is_neg_says(monkeypatch: pytest.MonkeyPatch, from_keys: bool) -> None:
    """Read from the dispatch keys, or (a torch without them) asked of the tensor: the same answer."""
    if from_keys:
        assert tensors_mod._LAZY_BITS is not None  # this torch has them
    else:
        monkeypatch.setattr(tensors_mod, "_LAZY_BITS", None)
    answers = [has_lazy_bits(t) for t in _lazy_cases()]
    assert answers == [bool(t.is_conj() or t.is_neg()) for t in _lazy_cases()]
    assert answers.count(True) == 5  # the conj view, the neg views (a detached one too)

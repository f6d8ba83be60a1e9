"""Byte planes (numpy): split/merge are exact inverses; plane k holds byte k of every element."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nvdcp.format.dtypes import DTYPE_TO_CODE
from nvdcp.transform.byteplanes import compressible_planes, merge, split

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def _random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


@pytest.mark.parametrize("element_size", [1, 2, 4, 8])
@pytest.mark.parametrize("n_elements", [0, 1, 2, 3, 7, 13, 1001])
def test_split_merge_round_trip(element_size: int, n_elements: int) -> None:
    raw = _random_bytes(n_elements * element_size, seed=element_size * 1000 + n_elements)
    planes = split(raw, element_size)
    assert planes.shape == (element_size, n_elements)
    assert planes.dtype == np.uint8 and planes.flags.c_contiguous
    out = np.full_like(raw, 0xAA)
    merge(planes, element_size, out)
    assert np.array_equal(out, raw)


@pytest.mark.parametrize("element_size", [2, 4, 8])
def test_plane_k_holds_byte_k_of_each_element(element_size: int) -> None:
    n = 11  # odd length
    raw = _random_bytes(n * element_size, seed=element_size)
    planes = split(raw, element_size)
    for k in range(element_size):
        assert bytes(planes[k]) == bytes(raw[k::element_size])


def test_split_does_not_alias_its_input() -> None:
    raw = _random_bytes(64)
    planes = split(raw, 4)
    before = planes.copy()
    raw[:] = 0
    assert np.array_equal(planes, before)


def test_merge_accepts_flat_planes() -> None:
    """The decoder hands merge a flat staging buffer (plane-major), not a 2-D array."""
    raw = _random_bytes(4 * 9, seed=3)
    flat_planes = split(raw, 4).reshape(-1)
    out = np.empty_like(raw)
    merge(flat_planes, 4, out)
    assert np.array_equal(out, raw)


def test_known_float32_planes() -> None:
    values = np.array([1.0, -2.0, 0.5], dtype="<f4")
    # 1.0 = 0x3F800000, -2.0 = 0xC0000000, 0.5 = 0x3F000000 (little-endian bytes: low byte first)
    raw = values.view(np.uint8)
    planes = split(raw, 4)
    assert planes.tolist() == [
        [0x00, 0x00, 0x00],
        [0x00, 0x00, 0x00],
        [0x80, 0x00, 0x00],
        [0x3F, 0xC0, 0x3F],  # last plane: sign + top exponent bits
    ]
    out = np.empty_like(raw)
    merge(planes, 4, out)
    assert np.array_equal(out.view("<f4"), values)


def test_known_bfloat16_planes() -> None:
    t = torch.tensor([1.0, -1.0, 3.0], dtype=torch.bfloat16)  # 0x3F80, 0xBF80, 0x4040
    planes = split(t.view(torch.uint8).numpy(), 2)
    assert planes.tolist() == [[0x80, 0x80, 0x40], [0x3F, 0xBF, 0x40]]


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float32, (False, False, False, True)),
        (torch.float64, (False,) * 7 + (True,)),
        (torch.float16, (False, True)),
        (torch.bfloat16, (False, True)),
        (torch.complex64, (False, False, False, True, False, False, False, True)),
        (torch.complex128, (False,) * 7 + (True,) + (False,) * 7 + (True,)),
        (torch.complex32, (False, True, False, True)),
        (torch.float8_e4m3fn, (True,)),
        (torch.int8, (True,)),
        (torch.uint8, (True,)),
        (torch.bool, (True,)),
        (torch.int16, (True, True)),
        (torch.int32, (True,) * 4),
        (torch.int64, (True,) * 8),
    ],
)
def test_compressible_planes(dtype: torch.dtype, expected: tuple[bool, ...]) -> None:
    assert compressible_planes(dtype) == expected


@pytest.mark.parametrize("dtype", sorted(DTYPE_TO_CODE, key=str))
def test_compressible_planes_covers_every_stored_dtype(dtype: torch.dtype) -> None:
    planes = compressible_planes(dtype)
    assert len(planes) == torch.empty((), dtype=dtype).element_size()
    assert any(planes)  # every dtype has at least one plane worth a codec
    if dtype.is_floating_point or dtype.is_complex:
        assert planes[-1]  # the top byte (sign + exponent) of the last component
    else:
        assert all(planes)


@settings(max_examples=200, deadline=None)
@given(
    element_size=st.sampled_from([1, 2, 3, 4, 8, 16]),
    data=st.data(),
)
def test_split_merge_property(element_size: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(min_value=0, max_value=64), label="elements")
    blob = data.draw(st.binary(min_size=n * element_size, max_size=n * element_size), label="bytes")
    raw = np.frombuffer(blob, dtype=np.uint8)
    planes = split(raw, element_size)
    assert planes.shape == (element_size, n)
    for k in range(element_size):
        assert bytes(planes[k]) == blob[k::element_size]
    out = np.empty(len(blob), dtype=np.uint8)
    merge(planes, element_size, out)
    assert out.tobytes() == blob

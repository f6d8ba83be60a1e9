"""Stored dtype codes. Frozen: a code, once released, always means the same dtype."""

from __future__ import annotations

import torch

from nvdcp.errors import CorruptCheckpointError

#: 0 is reserved for "not a tensor" (BYTE_IO items). Codes only ever get appended.
_NAMES: dict[int, str] = {
    1: "bool",
    2: "uint8",
    3: "int8",
    4: "int16",
    5: "int32",
    6: "int64",
    7: "float16",
    8: "bfloat16",
    9: "float32",
    10: "float64",
    11: "complex32",
    12: "complex64",
    13: "complex128",
    14: "uint16",
    15: "uint32",
    16: "uint64",
    17: "float8_e4m3fn",
    18: "float8_e5m2",
    19: "float8_e4m3fnuz",
    20: "float8_e5m2fnuz",
    21: "float8_e8m0fnu",
    22: "float4_e2m1fn_x2",
}
DTYPE_TO_CODE: dict[torch.dtype, int] = {}
CODE_TO_DTYPE: dict[int, torch.dtype] = {}
for _code, _name in _NAMES.items():
    _dt = getattr(torch, _name, None)  # older torch lacks the newest float8/float4 types
    if isinstance(_dt, torch.dtype):
        DTYPE_TO_CODE[_dt] = _code
        CODE_TO_DTYPE[_code] = _dt


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPE_TO_CODE[dtype]
    except KeyError:
        raise ValueError(f"nvdcp cannot store tensors of dtype {dtype}") from None


def code_dtype(code: int, where: str) -> torch.dtype:
    try:
        return CODE_TO_DTYPE[code]
    except KeyError:
        raise CorruptCheckpointError(f"{where}: unknown dtype code {code}") from None


def is_float_like(dtype: torch.dtype) -> bool:
    """Floating and complex dtypes: sign and exponent sit in each element's top byte."""
    return dtype.is_floating_point or dtype.is_complex

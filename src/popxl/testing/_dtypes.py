"""The popxl dtypes, by kind, as PopXL's tests enumerate them."""
from __future__ import annotations

from typing import List

from .. import dtypes as _d

__all__ = ["get_all_dtypes", "get_all_int_dtypes"]

_all_signed_int_dtypes = [_d.int8, _d.int16, _d.int32, _d.int64]
_all_unsigned_int_dtypes = [_d.uint8, _d.uint16, _d.uint32, _d.uint64]
_all_fp_dtypes = [_d.float8_143, _d.float8_152, _d.float16, _d.float32, _d.float64]
_all_complex_dtypes = [_d.complex64, _d.complex128]


def get_all_int_dtypes(include_signed: bool = True, include_unsigned: bool = True) -> List[_d.dtype]:
    """The signed (int8 ... int64) then unsigned (uint8 ... uint64) integer dtypes."""
    return (_all_signed_int_dtypes if include_signed else []) + \
        (_all_unsigned_int_dtypes if include_unsigned else [])


def get_all_dtypes() -> List[_d.dtype]:
    """Every dtype PopXL's tests cover: the integers, the floats (float8_143, float8_152,
    float16, float32, float64), then complex64 and complex128 (bfloat16, this package's
    addition, is not among them)."""
    return get_all_int_dtypes() + _all_fp_dtypes + _all_complex_dtypes

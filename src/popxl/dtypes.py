"""popxl data types (the popart.ir data-type table), each tied to a NumPy dtype."""
from __future__ import annotations

import builtins as _b
from typing import Any

import ml_dtypes
import numpy as np


class dtype:
    """A popxl data type: ``popxl.float32.as_numpy()``, ``.is_floating_point``, ..."""

    _by_np: dict = {}
    _by_name: dict = {}

    def __init__(self, name: str, np_type: Any, is_int: bool, is_float: bool, signed: bool,
                 py_type: Any = None, alias: "str | None" = None) -> None:
        self.name, self._np = name, np.dtype(np_type)
        self.is_int, self.is_floating_point, self.is_signed = is_int, is_float, signed
        self.is_complex = False
        self._py, self.alias = py_type, alias
        dtype._by_np.setdefault(self._np, self)
        dtype._by_name[name] = self
        if alias:
            dtype._by_name[alias] = self

    def as_numpy(self) -> np.dtype:
        return self._np

    @classmethod
    def as_dtype(cls, x: Any) -> "dtype":
        """Resolve a popxl dtype, name, NumPy dtype / type or Python type."""
        if isinstance(x, dtype):
            return x
        if isinstance(x, str) and x in cls._by_name:
            return cls._by_name[x]
        if x is _b.bool:
            return bool_
        if x is _b.float:
            return float32
        if x is _b.int:
            return int32
        try:
            return cls._by_np[np.dtype(x)]
        except (TypeError, KeyError):
            raise ValueError(f"There is no popxl dtype for {x!r}") from None

    def __repr__(self) -> str:
        return f"popxl.dtypes.{self.name}"

    def __reduce__(self):
        return (dtype.as_dtype, (self.name,))


bool_ = dtype("bool", np.bool_, False, False, False, bool)
int8 = dtype("int8", np.int8, True, False, True)
int16 = dtype("int16", np.int16, True, False, True)
int32 = dtype("int32", np.int32, True, False, True)
int64 = dtype("int64", np.int64, True, False, True)
uint8 = dtype("uint8", np.uint8, True, False, False)
uint16 = dtype("uint16", np.uint16, True, False, False)
uint32 = dtype("uint32", np.uint32, True, False, False)
uint64 = dtype("uint64", np.uint64, True, False, False)
float16 = dtype("float16", np.float16, False, True, True, alias="half")
float32 = dtype("float32", np.float32, False, True, True, float, alias="float")
float64 = dtype("float64", np.float64, False, True, True, alias="double")
bfloat16 = dtype("bfloat16", ml_dtypes.bfloat16, False, True, True)
float8_143 = dtype("float8_143", ml_dtypes.float8_e4m3fnuz, False, True, True)
float8_152 = dtype("float8_152", ml_dtypes.float8_e5m2fnuz, False, True, True)
half, float, double = float16, float32, float64  # noqa: A001  (popxl's aliases)
globals()["bool"] = bool_

_DOWNCAST = {np.dtype(np.float64): np.float32, np.dtype(np.int64): np.int32,
             np.dtype(np.uint64): np.uint32}


def to_numpy(data: Any, dt: dtype | None = None, downcast: bool = True) -> np.ndarray:
    """``data`` as a NumPy array of ``dt`` (or its own type, 64-bit downcast to 32-bit)."""
    if dt is not None:
        return np.asarray(data, dtype=dtype.as_dtype(dt).as_numpy())
    arr = np.asarray(data)
    if isinstance(data, (_b.float, _b.int)) and not isinstance(data, _b.bool):
        arr = arr.astype(np.float32 if isinstance(data, _b.float) else np.int32)
    if downcast and arr.dtype in _DOWNCAST:
        arr = arr.astype(_DOWNCAST[arr.dtype])
    return arr


"""popxl data types (the popart.ir data-type table), each tied to a NumPy dtype and to the
torch dtype of the same values (where the installed PyTorch has one). float8_143 / float8_152's
``as_numpy()`` is PopXL's uint8 record (``np_dtype_float8_143`` / ``_152``, their host data, see
``popxl.fp8_utils``); on the device (``as_device_numpy()``) they are ml_dtypes' float8_e4m3fnuz /
float8_e5m2fnuz (Graphcore's formats: biases 8 and 16, no infinities, one NaN)."""
from __future__ import annotations

import builtins as _b
from typing import Any

import ml_dtypes
import numpy as np

try:
    import torch as _torch
except ModuleNotFoundError:  # pragma: no cover  (torch is optional)
    _torch = None


class dtype:
    """A popxl data type: ``popxl.float32.as_numpy()``, ``.is_floating_point``, ..."""

    _by_np: dict = {}
    _by_name: dict = {}
    _by_torch: dict = {}
    _by_py: dict = {}

    def __init__(self, name: str, np_type: Any, is_int: bool, is_float: bool, signed: bool,
                 py_type: Any = None, alias: "str | None" = None, torch_name: "str | None" = None,
                 is_complex: _b.bool = False, host_np: Any = None) -> None:
        self._name, self._np = name, np.dtype(np_type)
        self._host = self._np if host_np is None else np.dtype(host_np)
        self.is_int, self.is_floating_point, self.is_signed = is_int, is_float, signed
        self.is_complex = is_complex
        self._py, self.alias = py_type, alias
        dtype._by_np.setdefault(self._np, self)
        dtype._by_np.setdefault(self._host, self)
        dtype._by_name[name] = self
        if alias:
            dtype._by_name[alias] = self
        if py_type is not None:
            dtype._by_py[py_type] = self
        self._torch = getattr(_torch, torch_name, None) if (_torch and torch_name) else None
        if self._torch is not None:
            dtype._by_torch[self._torch] = self

    @property
    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.dtype:
        """The NumPy dtype of host data (PopXL's uint8 record for float8_143 / float8_152)."""
        return self._host

    def as_device_numpy(self) -> np.dtype:
        """The NumPy dtype of the values on the device: ``as_numpy()``, except ml_dtypes'
        float8_e4m3fnuz / float8_e5m2fnuz for float8_143 / float8_152."""
        return self._np

    def as_torch(self) -> Any:
        """The corresponding ``torch.dtype``. Raises TypeError when PyTorch has none (uint16,
        uint32, uint64, float8_143, float8_152) and ModuleNotFoundError without PyTorch."""
        if _torch is None:
            raise ModuleNotFoundError("PyTorch is not installed.")
        if self._torch is None:
            raise TypeError(f"`popxl.{self._name}` does not have a corresponding PyTorch dtype.")
        return self._torch

    @classmethod
    def from_name(cls, name: str) -> "dtype":
        """The dtype called ``name`` ("float32", "half", ...)."""
        try:
            return cls._by_name[name]
        except (KeyError, TypeError):
            raise ValueError(f"There is not a `popxl.dtype` that has a name: {name}.") from None

    @classmethod
    def as_dtype(cls, type_value: Any) -> "dtype":
        """``type_value`` as a popxl dtype: a popxl dtype, name, NumPy dtype / scalar type,
        torch dtype, Python type (bool, float, int) or an array / tensor (its dtype)."""
        x = type_value
        if isinstance(x, dtype):
            return x
        if isinstance(x, str) and x in cls._by_name:
            return cls._by_name[x]
        if x is _b.int:
            return int32
        try:
            if x in cls._by_py:
                return cls._by_py[x]
        except TypeError:
            pass
        if _torch is not None:
            if isinstance(x, _torch.dtype):
                if x in cls._by_torch:
                    return cls._by_torch[x]
                raise ValueError(f"There is not a `popxl.dtype` that is compatible with value: {x}, "
                                 f"type: {type(x)}.")
            if isinstance(x, _torch.Tensor):
                return cls.as_dtype(x.dtype)
        if isinstance(x, np.ndarray) or (hasattr(x, "dtype") and not isinstance(x, type)):
            return cls.as_dtype(np.dtype(x.dtype))
        try:
            return cls._by_np[np.dtype(x)]
        except (TypeError, KeyError):
            raise ValueError(f"There is not a `popxl.dtype` that is compatible with value: {x}, "
                             f"type: {type(x)}.") from None

    def __repr__(self) -> str:
        return f"popxl.dtypes.{self._name}"

    def __reduce__(self):
        return (dtype.from_name, (self._name,))


bool_ = dtype("bool", np.bool_, False, False, False, _b.bool, torch_name="bool")
int8 = dtype("int8", np.int8, True, False, True, torch_name="int8")
int16 = dtype("int16", np.int16, True, False, True, torch_name="int16")
int32 = dtype("int32", np.int32, True, False, True, torch_name="int32")
int64 = dtype("int64", np.int64, True, False, True, torch_name="int64")
uint8 = dtype("uint8", np.uint8, True, False, False, torch_name="uint8")
uint16 = dtype("uint16", np.uint16, True, False, False, torch_name="uint16")
uint32 = dtype("uint32", np.uint32, True, False, False, torch_name="uint32")
uint64 = dtype("uint64", np.uint64, True, False, False, torch_name="uint64")
float16 = dtype("float16", np.float16, False, True, True, alias="half", torch_name="float16")
float32 = dtype("float32", np.float32, False, True, True, _b.float, alias="float", torch_name="float32")
float64 = dtype("float64", np.float64, False, True, True, alias="double", torch_name="float64")
bfloat16 = dtype("bfloat16", ml_dtypes.bfloat16, False, True, True, torch_name="bfloat16")
# float8: host data are PopXL's uint8 records (as_numpy()); ml_dtypes' formats on the device
# (as_device_numpy()); popxl.fp8_utils converts
np_dtype_float8_143 = np.dtype([("float8_143", "u1")])
np_dtype_float8_152 = np.dtype([("float8_152", "u1")])
float8_143 = dtype("float8_143", ml_dtypes.float8_e4m3fnuz, False, True, True,
                   torch_name="float8_e4m3fnuz", host_np=np_dtype_float8_143)
float8_152 = dtype("float8_152", ml_dtypes.float8_e5m2fnuz, False, True, True,
                   torch_name="float8_e5m2fnuz", host_np=np_dtype_float8_152)
complex64 = dtype("complex64", np.complex64, False, False, True, torch_name="complex64", is_complex=True)
complex128 = dtype("complex128", np.complex128, False, False, True, torch_name="complex128",
                   is_complex=True)
half, float, double = float16, float32, float64  # noqa: A001  (popxl's aliases)
globals()["bool"] = bool_

_DOWNCAST = {np.dtype(np.float64): np.float32, np.dtype(np.int64): np.int32,
             np.dtype(np.uint64): np.uint32}


def to_numpy(data: Any, dt: dtype | None = None, downcast: _b.bool = True) -> np.ndarray:
    """``data`` (array, torch tensor, scalar, nested list) as a NumPy array of ``dt`` (or its
    own type, 64-bit downcast to 32-bit)."""
    if _torch is not None and isinstance(data, _torch.Tensor):
        data = data.detach().cpu()
        dt_ = dtype._by_torch.get(data.dtype)
        if dt_ is not None and dt_.as_device_numpy().kind == "V":   # bfloat16, float8: as bytes
            data = data.view(_torch.uint8 if dt_.as_numpy().itemsize == 1 else _torch.int16)
            data = data.numpy().view(dt_.as_numpy())   # float8: PopXL's host form
        else:
            data = data.numpy()
    if dt is not None:
        return np.asarray(data, dtype=dtype.as_dtype(dt).as_device_numpy())
    arr = np.asarray(data)
    if isinstance(data, (_b.float, _b.int)) and not isinstance(data, _b.bool):
        arr = arr.astype(np.float32 if isinstance(data, _b.float) else np.int32)
    if downcast and arr.dtype in _DOWNCAST:
        arr = arr.astype(_DOWNCAST[arr.dtype])
    return arr

"""DataType and TensorInfo: PopART's dtype names mapped to NumPy / ml_dtypes and ONNX."""
from __future__ import annotations

import enum
from typing import Any, Iterable, Sequence

import ml_dtypes
import numpy as np
from onnx import TensorProto

from .errors import popart_exception


class DataType(enum.Enum):
    UINT8 = "UINT8"
    INT8 = "INT8"
    UINT16 = "UINT16"
    INT16 = "INT16"
    INT32 = "INT32"
    INT64 = "INT64"
    UINT32 = "UINT32"
    UINT64 = "UINT64"
    BOOL = "BOOL"
    FLOAT = "FLOAT"
    FLOAT16 = "FLOAT16"
    BFLOAT16 = "BFLOAT16"
    FLOAT8_143 = "FLOAT8_143"
    FLOAT8_152 = "FLOAT8_152"
    DOUBLE = "DOUBLE"
    COMPLEX64 = "COMPLEX64"
    COMPLEX128 = "COMPLEX128"
    STRING = "STRING"
    UNDEFINED = "UNDEFINED"
    # Newer ONNX element types PopART never had (for models of newer exporters).
    FLOAT8_E4M3FN = "FLOAT8_E4M3FN"
    FLOAT8_E5M2 = "FLOAT8_E5M2"
    FLOAT8_E8M0 = "FLOAT8_E8M0"
    FLOAT4_E2M1 = "FLOAT4_E2M1"
    INT4 = "INT4"
    UINT4 = "UINT4"
    INT2 = "INT2"
    UINT2 = "UINT2"

    @property
    def name_(self) -> str:  # pybind-style `.name` is the enum's own name
        return self.value


# DataType -> (numpy dtype, ONNX TensorProto enum). FLOAT8_143 / FLOAT8_152 are Graphcore's
# float8 formats, which ml_dtypes implements as float8_e4m3fnuz / float8_e5m2fnuz.
_TABLE: dict[DataType, tuple[Any, int]] = {
    DataType.UINT8: (np.uint8, TensorProto.UINT8),
    DataType.INT8: (np.int8, TensorProto.INT8),
    DataType.UINT16: (np.uint16, TensorProto.UINT16),
    DataType.INT16: (np.int16, TensorProto.INT16),
    DataType.INT32: (np.int32, TensorProto.INT32),
    DataType.INT64: (np.int64, TensorProto.INT64),
    DataType.UINT32: (np.uint32, TensorProto.UINT32),
    DataType.UINT64: (np.uint64, TensorProto.UINT64),
    DataType.BOOL: (np.bool_, TensorProto.BOOL),
    DataType.FLOAT: (np.float32, TensorProto.FLOAT),
    DataType.FLOAT16: (np.float16, TensorProto.FLOAT16),
    DataType.BFLOAT16: (ml_dtypes.bfloat16, TensorProto.BFLOAT16),
    DataType.FLOAT8_143: (ml_dtypes.float8_e4m3fnuz, TensorProto.FLOAT8E4M3FNUZ),
    DataType.FLOAT8_152: (ml_dtypes.float8_e5m2fnuz, TensorProto.FLOAT8E5M2FNUZ),
    DataType.DOUBLE: (np.float64, TensorProto.DOUBLE),
    DataType.COMPLEX64: (np.complex64, TensorProto.COMPLEX64),
    DataType.COMPLEX128: (np.complex128, TensorProto.COMPLEX128),
    DataType.STRING: (np.object_, TensorProto.STRING),
    DataType.FLOAT8_E4M3FN: (ml_dtypes.float8_e4m3fn, TensorProto.FLOAT8E4M3FN),
    DataType.FLOAT8_E5M2: (ml_dtypes.float8_e5m2, TensorProto.FLOAT8E5M2),
    DataType.FLOAT8_E8M0: (ml_dtypes.float8_e8m0fnu, TensorProto.FLOAT8E8M0),
    DataType.FLOAT4_E2M1: (ml_dtypes.float4_e2m1fn, TensorProto.FLOAT4E2M1),
    DataType.INT4: (ml_dtypes.int4, TensorProto.INT4),
    DataType.UINT4: (ml_dtypes.uint4, TensorProto.UINT4),
    DataType.INT2: (ml_dtypes.int2, TensorProto.INT2),
    DataType.UINT2: (ml_dtypes.uint2, TensorProto.UINT2),
}
_FROM_NP = {np.dtype(v[0]): k for k, v in _TABLE.items()}
_FROM_ONNX = {v[1]: k for k, v in _TABLE.items()}
# Extra spellings accepted where a dtype string is expected.
_ALIASES = {"FLOAT32": DataType.FLOAT, "HALF": DataType.FLOAT16, "FLOAT64": DataType.DOUBLE,
            "INT": DataType.INT32, "FP16": DataType.FLOAT16, "FP32": DataType.FLOAT}


def to_datatype(dtype: Any) -> DataType:
    """Resolve a DataType, PopART dtype string, NumPy dtype or ONNX enum to a DataType."""
    if isinstance(dtype, DataType):
        return dtype
    if isinstance(dtype, str):
        key = dtype.upper()
        if key in DataType.__members__:
            return DataType[key]
        if key in _ALIASES:
            return _ALIASES[key]
        try:
            return _FROM_NP[np.dtype(dtype)]
        except TypeError:
            pass
        raise popart_exception(f"Unknown data type '{dtype}': expected one of "
                               f"{', '.join(DataType.__members__)}")
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool):
        if int(dtype) in _FROM_ONNX:
            return _FROM_ONNX[int(dtype)]
        name = TensorProto.DataType.Name(int(dtype)) if int(dtype) in TensorProto.DataType.values() \
            else "not an ONNX data type"
        raise popart_exception(f"ONNX data type {int(dtype)} ({name}) is not supported")
    try:
        return _FROM_NP[np.dtype(dtype)]
    except (TypeError, KeyError):
        raise popart_exception(f"Unsupported data type {dtype!r}") from None


def np_dtype(dtype: Any) -> np.dtype:
    """NumPy dtype of a DataType / string / ONNX enum / NumPy dtype."""
    return np.dtype(_TABLE[to_datatype(dtype)][0])


def onnx_dtype(dtype: Any) -> int:
    """ONNX TensorProto enum of a DataType / string / NumPy dtype."""
    return _TABLE[to_datatype(dtype)][1]


class TensorInfo:
    """The data type and shape of a tensor.

    ``TensorInfo("FLOAT", [2, 3])``, ``TensorInfo(np.float16, [4])``,
    ``TensorInfo(DataType.INT32, [])`` or ``TensorInfo(numpy_array)``.
    """

    def __init__(self, *args: Any) -> None:
        if len(args) == 1 and isinstance(args[0], TensorInfo):
            self._dtype, self._shape = args[0]._dtype, list(args[0]._shape)
        elif len(args) == 1 and isinstance(args[0], np.ndarray):
            self._dtype, self._shape = to_datatype(args[0].dtype), list(args[0].shape)
        elif len(args) == 2:
            if not isinstance(args[1], Iterable) or isinstance(args[1], (str, bytes)):
                raise TypeError(f"TensorInfo shape must be a list of ints, got {args[1]!r}")
            self._dtype = to_datatype(args[0])
            self._shape = [int(d) for d in args[1]]
        else:
            raise TypeError("TensorInfo expects (dtype, shape) or (numpy.ndarray), "
                            f"got {len(args)} argument(s): {args!r}")

    # PopART's accessors
    def data_type(self) -> str:
        return self._dtype.value

    def data_type_lcase(self) -> str:
        """PopART's lower-case name: "float32", "float16", "int32", "bool", ..."""
        return "bool" if self._dtype == DataType.BOOL else str(self.np_dtype())

    def dataType(self) -> DataType:
        return self._dtype

    def shape(self) -> list[int]:
        return list(self._shape)

    def rank(self) -> int:
        return len(self._shape)

    def nelms(self) -> int:
        return int(np.prod(self._shape, dtype=np.int64))

    def nbytes(self) -> int:
        return self.nelms() * self.np_dtype().itemsize

    def dim(self, i: int) -> int:
        return self._shape[i]

    def np_dtype(self) -> np.dtype:
        return np_dtype(self._dtype)

    def onnx_dtype(self) -> int:
        return onnx_dtype(self._dtype)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TensorInfo) and self._dtype == other._dtype
                and self._shape == other._shape)

    def __hash__(self) -> int:
        return hash((self._dtype, tuple(self._shape)))

    def __repr__(self) -> str:
        return f"TensorInfo({self._dtype.value}, {self._shape})"

    __str__ = __repr__


def shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"

"""DataType and TensorInfo: PopART's dtype names mapped to ONNX, and through onnx.helper to
NumPy / ml_dtypes."""
from __future__ import annotations

import enum
from typing import Any, Optional, Sequence

import numpy as np
from onnx import TensorProto, helper

from .errors import check_arguments, integral, popart_exception, sequence_of


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


# DataType -> ONNX TensorProto enum: the one dtype table. NumPy types come from onnx.helper
# (ml_dtypes for bfloat16, float8, float4, int4 / int2). FLOAT8_143 / FLOAT8_152 are
# Graphcore's float8 formats, ONNX's FLOAT8E4M3FNUZ / FLOAT8E5M2FNUZ.
_ONNX: dict[DataType, int] = {
    DataType.UINT8: TensorProto.UINT8,
    DataType.INT8: TensorProto.INT8,
    DataType.UINT16: TensorProto.UINT16,
    DataType.INT16: TensorProto.INT16,
    DataType.INT32: TensorProto.INT32,
    DataType.INT64: TensorProto.INT64,
    DataType.UINT32: TensorProto.UINT32,
    DataType.UINT64: TensorProto.UINT64,
    DataType.BOOL: TensorProto.BOOL,
    DataType.FLOAT: TensorProto.FLOAT,
    DataType.FLOAT16: TensorProto.FLOAT16,
    DataType.BFLOAT16: TensorProto.BFLOAT16,
    DataType.FLOAT8_143: TensorProto.FLOAT8E4M3FNUZ,
    DataType.FLOAT8_152: TensorProto.FLOAT8E5M2FNUZ,
    DataType.DOUBLE: TensorProto.DOUBLE,
    DataType.COMPLEX64: TensorProto.COMPLEX64,
    DataType.COMPLEX128: TensorProto.COMPLEX128,
    DataType.STRING: TensorProto.STRING,
    DataType.UNDEFINED: TensorProto.UNDEFINED,
    DataType.FLOAT8_E4M3FN: TensorProto.FLOAT8E4M3FN,
    DataType.FLOAT8_E5M2: TensorProto.FLOAT8E5M2,
    DataType.FLOAT8_E8M0: TensorProto.FLOAT8E8M0,
    DataType.FLOAT4_E2M1: TensorProto.FLOAT4E2M1,
    DataType.INT4: TensorProto.INT4,
    DataType.UINT4: TensorProto.UINT4,
    DataType.INT2: TensorProto.INT2,
    DataType.UINT2: TensorProto.UINT2,
}
_NP: dict[DataType, np.dtype] = {k: np.dtype(helper.tensor_dtype_to_np_dtype(v))
                                 for k, v in _ONNX.items() if k is not DataType.UNDEFINED}
_FROM_NP = {v: k for k, v in _NP.items()}
_FROM_ONNX = {v: k for k, v in _ONNX.items()}
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
        except (TypeError, KeyError):
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
    dt = to_datatype(dtype)
    if dt not in _NP:
        raise popart_exception(f"Data type {dt.value} has no NumPy type")
    return _NP[dt]


def onnx_dtype(dtype: Any) -> int:
    """ONNX TensorProto enum of a DataType / string / NumPy dtype (UNDEFINED: 0)."""
    return _ONNX[to_datatype(dtype)]


# pybind11's signatures of popart._internal.ir.TensorInfo's constructors (bindings/tensorinfo.cpp).
_TI = "popart._internal.ir.TensorInfo"
_TI_FORMS = [f"{_TI}()", f"{_TI}(dataType: popart._internal.ir.DataType, shape: List[int])",
             f"{_TI}(dataType: popart._internal.ir.DataType, shape: List[int], metaShape: List[int])",
             f"{_TI}(dataType: str, shape: str)", f"{_TI}(dataType: str, shape: List[int])"]


class TensorInfo:
    """The data type and shape of a tensor.

    ``TensorInfo("FLOAT", [2, 3])``, ``TensorInfo(np.float16, [4])``,
    ``TensorInfo(DataType.INT32, [])`` or ``TensorInfo(numpy_array)``.
    """

    def __init__(self, *args: Any) -> None:
        self._meta: list[int] = []
        if len(args) == 1 and isinstance(args[0], TensorInfo):
            self._dtype, self._shape = args[0]._dtype, list(args[0]._shape)
        elif len(args) == 1 and isinstance(args[0], np.ndarray):
            self._dtype, self._shape = to_datatype(args[0].dtype), list(args[0].shape)
        elif len(args) == 2:
            dtype = args[0]
            check_arguments(sequence_of(args[1], integral) and (
                isinstance(dtype, (str, DataType, type, np.dtype))), "__init__", _TI_FORMS, args, True)
            self._dtype = to_datatype(args[0])
            self._shape = [int(d) for d in args[1]]
        else:   # PopART's TensorInfo wrapper (python_files/tensorinfo.py)
            raise TypeError(f"Can not create TensorInfo with args {args}")

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

    def set(self, dataType: Any, shape: Optional[Sequence[int]] = None,
            metaShape: Optional[Sequence[int]] = None) -> None:
        """Set the data type, and the shape and meta shape when given (PopART's overloads:
        ``set(dataType)``, ``set(dataType, shape)``, ``set(dataType, shape, metaShape)``)."""
        self._dtype = to_datatype(dataType)
        if shape is not None:
            self._shape = [int(d) for d in shape]
        if metaShape is not None:
            self._meta = [int(d) for d in metaShape]

    def metaShape(self) -> list[int]:
        """The meta shape (PopART's, for replicated tensor sharding); [] unless set."""
        return list(self._meta)

    def strides(self, shape: Sequence[int]) -> list[int]:
        """Row-major strides in bytes of ``shape`` with this data type's element size, as
        NumPy's ``ndarray.strides`` (PopART's TensorInfo::strides)."""
        strides = [0] * len(shape)
        step = self.np_dtype().itemsize
        for i in range(len(shape) - 1, -1, -1):
            strides[i] = step
            step *= int(shape[i])
        return strides

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

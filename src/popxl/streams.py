"""Host streams: h2d_stream / d2h_stream and the stream objects sessions key data by."""
from __future__ import annotations

from typing import Any, Iterable, Optional

from . import context
from .dtypes import dtype as _dtype
from .tensor import TensorSpec


class Stream:
    """A host stream: its shape, dtype and name (``tensor_id``). Made by :func:`h2d_stream` /
    :func:`d2h_stream`, not directly."""

    def __init__(self, shape: Iterable[int], dtype: Any, name: Optional[str]) -> None:
        if type(self) is Stream:
            raise NotImplementedError("Cannot construct a popxl.Stream directly. Use `h2d_stream` or "
                                      "`d2h_stream`.")
        self._shape = tuple(int(d) for d in shape)
        self._dtype = _dtype.as_dtype(dtype)
        ir = context.get_current_graph().ir if context._CTX._graphs else None
        base = name or type(self).__name__
        if ir is not None:
            n, k = base, 0
            while n in ir._stream_names:
                k += 1
                n = f"{base}_{k}"
            ir._stream_names.add(n)
            base = n
        self._name = base

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> _dtype:
        return self._dtype

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self._shape, self._dtype)

    @property
    def tensor_id(self) -> str:
        return self._name

    @property
    def name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._name}, {self._shape}, {self._dtype.name})"


class HostToDeviceStream(Stream):
    """A stream of host data that ``ops.host_load`` reads, one element per load."""


class DeviceToHostStream(Stream):
    """A stream that ``ops.host_store`` writes, one element per store."""


def h2d_stream(shape: Iterable[int], dtype: Any, name: Optional[str] = None) -> HostToDeviceStream:
    return HostToDeviceStream(shape, dtype, name)


def d2h_stream(shape: Iterable[int], dtype: Any, name: Optional[str] = None) -> DeviceToHostStream:
    return DeviceToHostStream(shape, dtype, name)

"""Host-side helpers: :func:`to_numpy` (the conversion popxl applies to variable, constant
and stream data), :func:`table_to_string`, and the devices sessions run on
(:func:`_to_device_info`)."""
from __future__ import annotations

import re
from typing import Any, Literal, Optional, Sequence

import numpy as np

import popart

from .dtypes import _DOWNCAST, dtype as _dtype, float8_143, float8_152
from .dtypes import to_numpy as _to_numpy
from .fp8_utils import host_np_dtype, host_pow2scale_cast_to_fp8, to_host_fp8

try:
    import torch as _torch
except ModuleNotFoundError:  # pragma: no cover
    _torch = None

torch_imported = _torch is not None
HW_DEVICE_CONNECTION_TIMEOUT = int(1e4)   # seconds PopXL waits for IPUs to become free
# the 64-bit types popxl stores as 32-bit ones (``downcast``)
downcast_np_dtypes = {np.dtype(k): np.dtype(v) for k, v in _DOWNCAST.items()}


def to_numpy(x: Any, dtype: Optional[_dtype] = None, downcast: bool = True, copy: bool = True,
             log2_scale: Optional[int] = None, nan_on_overflow: Optional[bool] = None) -> np.ndarray:
    """``x`` (NumPy array, torch tensor, scalar or nested sequence) as a C-ordered NumPy array.

    Args:
        x: the data.
        dtype: the popxl dtype of the result (float8: PopXL's host form, uint8 records of
            ``popxl.dtypes.np_dtype_float8_143`` / ``_152``). Without it, the data's own type,
            with 64-bit floats / ints downcast to 32 bits when ``downcast``.
        downcast: see ``dtype``.
        copy: always return a new array (otherwise ``x`` itself when it needs no conversion).
        log2_scale: float8 ``dtype`` only: multiply by ``2**log2_scale`` before the cast
            (default 0).
        nan_on_overflow: float8 ``dtype`` only: values out of range become NaN (default) or
            saturate.

    Raises:
        RuntimeError: ``log2_scale`` / ``nan_on_overflow`` given for a dtype that is not
            float8.
        TypeError: float8 ``dtype`` for data that is not float16 / float32 / float64.
        ValueError: an ``np.memmap`` that would need a copy while ``copy`` is False.
    """
    if dtype is not None:
        dtype = _dtype.as_dtype(dtype)
    if isinstance(x, np.memmap) and not copy:
        if dtype is not None and host_np_dtype(dtype) != x.dtype:
            raise ValueError("When passing a memory-mapped NumPy array, the `dtype` parameter "
                             "must be None or the same as the array's dtype")
        if not (x.flags.c_contiguous and x.flags.aligned):
            raise ValueError("When passing a memory-mapped NumPy array, it must already be in "
                             "C-ordered and aligned form.")
        if x.dtype in _DOWNCAST:   # PopXL's text, which prints the `dtype` argument
            raise ValueError(f"When passing a memory-mapped NumPy array, the dtype {dtype} is "
                             "not supported, as it requires downcasting the array into a new "
                             "array with a dtype supported by PopXL.")
        return x
    if dtype in (float8_143, float8_152):   # PopXL's host form (uint8 records)
        arr = to_host_fp8(_to_numpy(x))
        if arr.dtype != host_np_dtype(dtype):
            if arr.dtype not in (np.float16, np.float32, np.float64):
                raise TypeError(f"Type {arr.dtype} is not supported for float8 tensors. Please use "
                                "float16, float32 or float64 types.")
            arr = host_pow2scale_cast_to_fp8(arr, dtype, 0 if log2_scale is None else log2_scale,
                                             True if nan_on_overflow is None else nan_on_overflow)
        return np.array(arr, order="C", copy=True) if copy else np.ascontiguousarray(arr)
    if log2_scale is not None:
        raise RuntimeError("Non-default value for 'log2scale' is not supported for dtypes that are "
                           "not popxl.float8_143 or popxl.float8_152")
    if nan_on_overflow is not None:
        raise RuntimeError("Non-default value for 'nan_on_overflow' is not supported for dtypes "
                           "that are not popxl.float8_143 or popxl.float8_152")
    arr = _to_numpy(x, dtype, downcast)
    return np.array(arr, order="C", copy=True) if copy else np.ascontiguousarray(arr)


def table_to_string(rows: Sequence[Sequence], delimiter: str = " | ", header: bool = True) -> str:
    """``rows`` (each a sequence of the same length) as a text table: columns left-aligned to
    their widest cell and joined by ``delimiter``, one line per row; with ``header`` a line of
    dashes under the first row."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(c) for c in col) for col in zip(*rows)]
    lines = []
    for i, row in enumerate(rows):
        line = delimiter.join(c.ljust(w) for c, w in zip(row, widths))
        lines.append(line)
        if header and i == 0 and len(rows) > 1:
            lines.append("-" * (len(line) + 1))
    return "".join(line + "\n" for line in lines)


def _offline_device_from_str(device_type: str, num_ipus: Optional[int] = None) -> popart.DeviceInfo:
    """An offline device of the IPU system ``device_type`` ("ipu2", ...)."""
    return popart.DeviceManager().createOfflineIpuFromSystemString(device_type, num_ipus or 0)


def _to_device_info(device_type: Literal["ipu_hw", "ipu_model", "cpu"], num_ipus: int = 1,
                    use_popdist: bool = False) -> popart.DeviceInfo:
    """The device a session of ``num_ipus`` IPUs runs on: "cpu" (one), "ipu_model", "ipu_hw"
    (an offline device like the first available device of ``num_ipus`` IPUs; with
    ``use_popdist`` this instance's device of popdist), or an IPU system name ("ipu2").

    Raises:
        ValueError: "cpu" with ``num_ipus`` > 1; another ``device_type``.
        RuntimeError: "ipu_hw" with no device of ``num_ipus`` IPUs.
    """
    dm = popart.DeviceManager()
    if device_type == "cpu":
        if num_ipus > 1:
            raise ValueError(f"For a cpu device, multiple devices (provided: {num_ipus}) are not supported.")
        return dm.createCpuDevice()
    if device_type == "ipu_model":
        return dm.createIpuModelDevice({"numIPUs": num_ipus})
    if device_type == "ipu_hw":
        if use_popdist:
            import popdist.popart
            return popdist.popart.getDevice(connectionType=popart.DeviceConnectionType.OnDemand)
        devices = dm.enumerateDevices(numIpus=num_ipus)
        if not devices:
            raise RuntimeError(f"Failed to acquire device with {num_ipus} IPUs. Ensure that there are "
                               "sufficient IPUs available.")
        return dm.createOfflineIpuFromDeviceInfo(devices[0])
    if isinstance(device_type, str) and re.fullmatch(r"ipu\d+", device_type):
        return _offline_device_from_str(device_type, num_ipus)
    raise ValueError(f"Incorrect device type provided: {device_type}, must be one of: `ipu_hw`, "
                     "`ipu_model`, `cpu`")

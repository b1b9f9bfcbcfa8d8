"""Host-side float8 helpers: PopXL's float8 data are NumPy arrays of ml_dtypes'
float8_e4m3fnuz (popxl.float8_143) and float8_e5m2fnuz (popxl.float8_152)."""
from __future__ import annotations

from typing import Any, Optional

import ml_dtypes
import numpy as np

from .dtypes import dtype as _dtype
from .dtypes import float8_143, float8_152, float16, float32, float64

try:
    import torch as _torch
except ModuleNotFoundError:  # pragma: no cover
    _torch = None

_FP8 = (float8_143, float8_152)


def _as_array(src: Any) -> np.ndarray:
    if _torch is not None and isinstance(src, _torch.Tensor):
        src = src.detach().cpu().numpy()
    return src if isinstance(src, np.ndarray) else np.asarray(src, order="C")


def _check_scale(log2_scale: Any) -> int:
    s = int(log2_scale)
    if not -32 <= s < 32:
        raise RuntimeError(f"log2_scale must be in [-32, 32), got {log2_scale}")
    return s


def host_pow2scale_cast_to_fp8(src: Any, dtype: Optional[_dtype] = None, log2_scale: int = 0,
                               nan_on_overflow: bool = True) -> np.ndarray:
    """``cast(src * 2**log2_scale, dtype)`` on the host, rounding to nearest even. Values
    beyond the format's largest magnitude become NaN (``nan_on_overflow``) or saturate to it.

    Args:
        src: float16 / float32 / float64 data (NumPy array, torch tensor or nested lists).
        dtype: popxl.float8_143 or popxl.float8_152.
        log2_scale: an int in [-32, 32).
        nan_on_overflow: NaN (True) or saturation (False) for values out of range.

    Raises:
        RuntimeError: for another dtype, source type or scale.
    """
    src = _as_array(src)
    if dtype not in _FP8:
        raise RuntimeError(f"dtype {dtype} not currently supported.")
    if src.dtype not in (np.float16, np.float32, np.float64):
        raise RuntimeError(f"src.dtype {src.dtype} not currently supported.")
    s = _check_scale(log2_scale)
    x = src.astype(np.float64) * np.ldexp(1.0, s)
    if not nan_on_overflow:
        big = float(ml_dtypes.finfo(dtype.as_numpy()).max)
        x = np.where(np.isnan(x), x, np.clip(x, -big, big))
    return x.astype(dtype.as_numpy())


def host_pow2scale_cast_from_fp8(src: np.ndarray, dtype: Optional[_dtype] = None,
                                 log2_scale: int = 0) -> np.ndarray:
    """``cast(src, dtype) * 2**log2_scale`` on the host for float8 data ``src``; ``dtype`` is
    popxl.float16, float32 or float64.

    Raises:
        RuntimeError: for another source or target type, or a scale outside [-32, 32).
    """
    src = np.asarray(src)
    if src.dtype not in (float8_143.as_numpy(), float8_152.as_numpy()):
        raise RuntimeError(f"src.dtype {src.dtype} not currently supported.")
    if dtype not in (float16, float32, float64):
        raise RuntimeError(f"dtype {dtype} not currently supported.")
    s = _check_scale(log2_scale)
    return (src.astype(np.float64) * np.ldexp(1.0, s)).astype(dtype.as_numpy())


def _scale_errors(src: np.ndarray, dtype: _dtype) -> list[tuple[float, int]]:
    x = src.astype(np.float64).reshape(-1)
    out = []
    for s in range(-31, 32):
        y = host_pow2scale_cast_to_fp8(x, dtype, s, nan_on_overflow=False).astype(np.float64)
        out.append((float(np.mean((y * np.ldexp(1.0, -s) - x) ** 2)) if x.size else 0.0, s))
    return out


def host_fp8_mse_scale(src: Any, dtype: Optional[_dtype] = None) -> tuple[float, int]:
    """(mean squared error, scale ``s``) for the ``s`` in [-31, 31] with which
    ``cast(src * 2**s, dtype) * 2**-s`` (saturating) is closest to ``src``; among equally good
    scales the middle one. ``src`` is float16 or float32 data; ``dtype`` float8_143 (default)
    or float8_152.

    Raises:
        RuntimeError: for another source type or dtype.
    """
    src = _as_array(src)
    if src.dtype not in (np.float16, np.float32):
        raise RuntimeError(f"dtype {src.dtype} not currently supported.")
    dtype = float8_143 if dtype is None else dtype
    if dtype not in _FP8:
        raise RuntimeError(f"dtype {dtype} not currently supported.")
    errs = _scale_errors(src, dtype)
    best = min(e for e, _ in errs)
    ties = [s for e, s in errs if e <= best * (1 + 1e-12)]
    return best, ties[len(ties) // 2]


def host_fp8_mse_scale_pb(src: Any, dtype: Optional[_dtype] = None) -> int:
    """The scale of :func:`host_fp8_mse_scale` alone."""
    if dtype not in _FP8:
        raise RuntimeError(f"dtype {dtype} not currently supported.")
    return host_fp8_mse_scale(src, dtype)[1]

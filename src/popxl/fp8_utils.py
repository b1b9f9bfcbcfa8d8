"""Host-side float8 helpers. On the host, float8 data are PopXL's NumPy arrays of uint8
records, ``np.dtype([("float8_143", "u1")])`` (``popxl.dtypes.np_dtype_float8_143``) and
``[("float8_152", "u1")]`` (``popxl.float8_143.as_numpy()``): the format's bits, one byte
each. On the device (``popxl.float8_143.as_device_numpy()``) they are ml_dtypes'
float8_e4m3fnuz / float8_e5m2fnuz, the same bytes (:func:`from_host_fp8` / :func:`to_host_fp8` view one as the other)."""
from __future__ import annotations

from collections import namedtuple
from typing import Any, List, Optional, Tuple

import ml_dtypes
import numpy as np

from .dtypes import dtype as _dtype
from .dtypes import float8_143, float8_152, float16, float32, float64

try:
    import torch as _torch
except ModuleNotFoundError:  # pragma: no cover
    _torch = None

_FP8 = (float8_143, float8_152)
_TO_DEVICE = {dt.as_numpy(): dt.as_device_numpy() for dt in _FP8}
_TO_HOST = {v: k for k, v in _TO_DEVICE.items()}


def host_np_dtype(dt: _dtype) -> np.dtype:
    """The NumPy dtype of ``dt``'s host data, ``dt.as_numpy()`` (PopXL's uint8 record for a
    float8 dtype)."""
    return dt.as_numpy()


def to_host_fp8(arr: Any) -> Any:
    """``arr`` with float8 data (ml_dtypes) as PopXL's host form: a view of the same bytes as
    uint8 records. Other data as it is."""
    host = _TO_HOST.get(getattr(arr, "dtype", None))
    return arr if host is None else arr.view(host)


def from_host_fp8(arr: Any, dt: Optional[_dtype] = None) -> Any:
    """``arr`` in PopXL's float8 host form (uint8 records) as ml_dtypes float8 data: a view of
    the same bytes; with a float8 ``dt`` (a stream's), plain uint8 data too (PopXL's session
    sends float8 inputs as their bytes). Other data as it is."""
    have = getattr(arr, "dtype", None)
    dev = _TO_DEVICE.get(have)
    if dev is None and dt in _FP8 and have == np.uint8:
        dev = dt.as_device_numpy()
    return arr if dev is None else arr.view(dev)


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
    """``cast(src * 2**log2_scale, dtype)`` on the host, rounding to nearest even, in PopXL's
    float8 host form (``popxl.dtypes.np_dtype_float8_143`` / ``_152``: uint8 records).
    Finite values beyond the format's largest magnitude become NaN (``nan_on_overflow``) or
    saturate to it; infinities and NaN become NaN.

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
    if not nan_on_overflow:   # finite values saturate; infinities (none in float8) are NaN
        big = float(ml_dtypes.finfo(dtype.as_device_numpy()).max)
        x = np.where(np.isfinite(x), np.clip(x, -big, big), np.nan)
    return to_host_fp8(x.astype(dtype.as_device_numpy()))


def host_pow2scale_cast_from_fp8(src: np.ndarray, dtype: Optional[_dtype] = None,
                                 log2_scale: int = 0) -> np.ndarray:
    """``cast(src, dtype) * 2**log2_scale`` on the host for float8 data ``src`` (PopXL's host
    form, uint8 records; ml_dtypes float8 arrays too); ``dtype`` is popxl.float16, float32
    or float64.

    Raises:
        RuntimeError: for another source or target type, or a scale outside [-32, 32).
    """
    src = from_host_fp8(np.asarray(src))
    if src.dtype not in _TO_HOST:
        raise RuntimeError(f"src.dtype {src.dtype} not currently supported.")
    if dtype not in (float16, float32, float64):
        raise RuntimeError(f"dtype {dtype} not currently supported.")
    s = _check_scale(log2_scale)
    return (src.astype(np.float64) * np.ldexp(1.0, s)).astype(dtype.as_device_numpy())


def host_fp8_mse_scale(src: Any, dtype: Optional[_dtype] = None) -> tuple[float, int]:
    """PopXL's estimate of the float8 scale ``s`` for which ``cast(src * 2**s, dtype)``
    loses least: (its estimated error, ``s``). The magnitudes of ``src`` (float16 or float32
    data) are counted by power of two over float32's range (:func:`log_histogram`), and each
    scaling bias in [-31, 31] is scored from the normalised counts by the error of the values
    it underflows, rounds and overflows (:func:`calculate_metric_mse`); ``s`` is the best
    bias negated. ``dtype``: float8_152, else float8_143.

    Raises:
        RuntimeError: ``src`` neither float16 nor float32.
    """
    src = _as_array(src)
    if src.dtype not in (np.float16, np.float32):
        raise RuntimeError(f"dtype {src.dtype} not currently supported.")
    dest = float8_152_def if dtype == float8_152 else float8_143_def
    x = np.ascontiguousarray(src).reshape(-1)
    hist, limits = log_histogram(x, ieee_fp32_no_denorms)
    candidate = CandidateConfig(dtype, ieee_fp32_no_denorms, dest, x.dtype)
    err, bias = calculate_candidate_metric(hist / hist.sum(), limits, candidate, "MSE")
    return err, -bias


def host_fp8_mse_scale_pb(src: Any, dtype: Optional[_dtype] = None) -> int:
    """The scale of :func:`host_fp8_mse_scale` alone."""
    if dtype not in _FP8:
        raise RuntimeError(f"dtype {dtype} not currently supported.")
    return host_fp8_mse_scale(src, dtype)[1]


# ---------------------------------------------------------------------------------------
# PopXL's histogram estimate of the best float8 scale: the exponents of the data are counted in
# a histogram, and each scaling bias b in [min_scaling_bias, max_scaling_bias] is scored by the
# squared error of the values it underflows, rounds and overflows (host_fp8_mse_scale above).

torch_imported = _torch is not None
max_scaling_bias = 31
min_scaling_bias = -31

FpDef = namedtuple("FpDef", ["num_exp_bits", "num_mantissa_bits", "fix_exponent_bias", "include_denorm",
                             "has_nans"])
FpDef.__doc__ = ("A floating-point format: exponent and mantissa bits, exponent bias, whether its "
                 "denormals count, whether an exponent code is kept for NaN.")
ieee_fp32_no_denorms = FpDef(8, 23, 127, False, True)
ieee_fp16_denorms = FpDef(5, 10, 15, True, True)
float8_152_def = FpDef(5, 2, 16, True, False)
float8_143_def = FpDef(4, 3, 8, True, False)


def find_exponential_range(fp_def: FpDef) -> Tuple[int, int]:
    """(lowest, highest) power of two of the format's values without scaling (the lowest
    that of its smallest denormal when denormals count): (-10, 7) for float8_143."""
    lo = 1 - fp_def.fix_exponent_bias - (fp_def.num_mantissa_bits if fp_def.include_denorm else 0)
    hi = (1 << fp_def.num_exp_bits) - 1 - int(fp_def.has_nans) - fp_def.fix_exponent_bias
    return lo, hi


def log_histogram(src: np.ndarray, ftype: FpDef) -> Tuple[np.ndarray, List[float]]:
    """Counts of ``|src|`` by power of two over ``ftype``'s range: ``limits`` are
    ``2**lo, ..., 2**(hi-1)``; bin 0 counts the values below ``limits[0]``, bin ``i`` those
    in ``[limits[i-1], limits[i])``, the last bin those above ``limits[-1]`` (a value equal
    to it too)."""
    lo, hi = find_exponential_range(ftype)
    limits = [2.0 ** i for i in range(lo, hi)]
    a = np.abs(np.asarray(src, np.float64).reshape(-1))
    exp = np.frexp(a)[1]
    bins = np.where(a < limits[0], 0, np.where(a > limits[-1], len(limits), exp - lo))
    return np.bincount(bins, minlength=len(limits) + 1).astype(np.float64), limits


class CandidateConfig:
    """A destination format ``dest_ftype`` (of dtype ``format``) for data of ``src_type``
    (numpy float16 / float32) whose exponents follow ``src_ftype``: the relative squared
    rounding error of the destination's mantissa, the number of powers of two it spans, and
    the histogram indices of the source exponents that the scaling biases can bring into
    range (``min_src_exp_index`` .. ``max_src_exp_index``, ``num_exp_src`` of them)."""

    def __init__(self, format: Any, src_ftype: FpDef, dest_ftype: FpDef, src_type: Any) -> None:
        self.format = format
        self.exponent_size = dest_ftype.num_exp_bits
        self.mantissa_size = dest_ftype.num_mantissa_bits
        self.fix_exponent_bias = dest_ftype.fix_exponent_bias
        src_mantissa = (ieee_fp32_no_denorms if np.dtype(src_type) == np.float32 else ieee_fp16_denorms)
        self.quantisation_error = 2.0 ** (-2.0 * (src_mantissa.num_mantissa_bits - self.mantissa_size))
        src_lo, src_hi = find_exponential_range(src_ftype)
        dst_lo, dst_hi = find_exponential_range(dest_ftype)
        self.format_span = dst_hi - dst_lo + 1
        self.min_src_exp_index = max(dst_lo + min_scaling_bias - src_lo, 0)
        self.max_src_exp_index = min(dst_lo + max_scaling_bias - src_lo, src_hi - src_lo)
        self.num_exp_src = self.max_src_exp_index - self.min_src_exp_index + 1


def calculate_metric_mse(histogram: np.ndarray, limits: List[float], src_bias_starting_indices: Any,
                         candidate: CandidateConfig) -> Tuple[float, int]:
    """(lowest error, its scaling bias) over the scaling biases ``min_scaling_bias + k``,
    the ``k``-th putting the format's lowest power of two at histogram index
    ``src_bias_starting_indices[k]`` = ``m``: the error sums, weighted by ``histogram``, the
    values below index ``m`` (underflow to 0, plus ``(limits[0] / 2)**2`` when there are
    any), the rounding error of the ``format_span`` indices from ``m``, and the distance to
    ``limits[k + format_span - 1]`` of those above (overflow). Among equal errors the middle
    bias."""
    span, q = candidate.format_span, candidate.quantisation_error
    h = [float(v) for v in np.asarray(histogram, np.float64)[1:len(limits) + 1]]
    scored = []
    for k, m in enumerate(int(v) for v in src_bias_starting_indices):
        top = min(m + span, len(limits))
        # summed in index order, as PopXL does: equal errors (ties) are equal bit for bit
        terms = [(limits[0] / 2) ** 2] if m > 0 else []
        terms += [limits[i] ** 2 * h[i] for i in range(m)]
        terms += [limits[i] ** 2 * h[i] * q for i in range(m, top)]
        terms += [(limits[k + span - 1] - limits[i]) ** 2 * h[i] for i in range(top, len(limits))]
        err = 0.0
        for t in terms:
            err += t
        scored.append((err, k + min_scaling_bias))
    best = min(e for e, _ in scored)
    ties = sorted(b for e, b in scored if e == best)
    return best, ties[len(ties) // 2]


def calculate_candidate_metric(hist_norm: np.ndarray, limits: List[float], candidate: CandidateConfig,
                               metric_type: Optional[str] = None) -> Tuple[float, int]:
    """:func:`calculate_metric_mse` over every scaling bias ``candidate`` allows.

    Raises:
        RuntimeError: ``metric_type`` other than "MSE".
    """
    if metric_type != "MSE":
        raise RuntimeError("Only MSE metric is supported.")
    starts = np.arange(candidate.min_src_exp_index, candidate.min_src_exp_index + candidate.num_exp_src)
    return calculate_metric_mse(hist_norm, limits, starts, candidate)

"""Accumulators updated in place: each updates ``t`` (it names the new value afterwards) and
returns it."""
from __future__ import annotations

from typing import Optional

from ...tensor import Tensor
from .._base import GC, inplace, one
from .._core import scaled_add, scatter_reduce
from .utils import Scalar, _cast, _f


def accumulate_(t: Tensor, X: Tensor, f: Optional[Scalar] = None) -> Tensor:
    """t = t + f * X (f defaults to 1)."""
    return inplace(t, scaled_add(t, _cast(X, t), 1.0, 1.0 if f is None else f))


def accumulate_square_(t: Tensor, X: Tensor, f: Scalar = 1.0) -> Tensor:
    """t = t + f * X^2."""
    x = _cast(X, t)
    return inplace(t, scaled_add(t, x * x, 1.0, f))


def accumulate_mean_(t: Tensor, X: Tensor, step: Scalar) -> Tensor:
    """t = (step / (step + 1)) * t + X / (step + 1): the running mean of the values seen."""
    s = _f(step, t)
    n = s + 1.0
    return inplace(t, (s / n) * t + _cast(X, t) / n)


def accumulate_moving_average_(t: Tensor, X: Tensor, f: Scalar) -> Tensor:
    """t = f * t + (1 - f) * X."""
    if isinstance(f, Tensor):
        return inplace(t, f * t + (1.0 - f) * _cast(X, t))
    return inplace(t, scaled_add(t, _cast(X, t), float(f), 1.0 - float(f)))


def accumulate_moving_average_square_(t: Tensor, X: Tensor, f: Scalar) -> Tensor:
    """t = f * t + (1 - f) * X^2."""
    x = _cast(X, t)
    return accumulate_moving_average_(t, x * x, f)


def accumulator_scale_(t: Tensor, f: Scalar) -> Tensor:
    """t = f * t."""
    if isinstance(f, Tensor):
        return inplace(t, t * _cast(f, t))
    return inplace(t, one("Scale", t, domain=GC, scale=float(f)))


def accumulator_zero_(t: Tensor) -> Tensor:
    return accumulator_scale_(t, 0.0)


def sparse_accumulate_(t: Tensor, X: Tensor, indices: Tensor, axis: int = 0,
                       f: Optional[Scalar] = None, W: Optional[Tensor] = None) -> Tensor:
    """t[indices[i]] += f * X[i] along ``axis``."""
    upd = scatter_reduce(_cast(X, t), indices, "sum", axis=axis, axis_size=t.shape[axis])
    return inplace(t, scaled_add(t, upd, 1.0, 1.0 if f is None else f))

"""In-place variable updates (accumulators, copies, Adam helpers) composed from registry ops.
Each updates ``t`` (it names the new value afterwards) and returns it."""
from __future__ import annotations

from typing import Optional, Union

from ..tensor import Tensor, constant
from ._base import GC, as_tensor, inplace, node, one

Scalar = Union[float, Tensor]


def _f(x: Scalar, like: Tensor) -> Tensor:
    return as_tensor(x, like)


def _cast(x: Tensor, like: Tensor) -> Tensor:
    from . import cast
    return x if x.dtype == like.dtype else cast(x, like.dtype)


def accumulate_(t: Tensor, X: Tensor, f: Optional[Scalar] = None) -> Tensor:
    """t = t + f * X (f defaults to 1)."""
    from . import scaled_add
    return inplace(t, scaled_add(t, _cast(X, t), 1.0, 1.0 if f is None else f))


def accumulate_square_(t: Tensor, X: Tensor, f: Scalar = 1.0) -> Tensor:
    """t = t + f * X^2."""
    from . import scaled_add
    x = _cast(X, t)
    return inplace(t, scaled_add(t, x * x, 1.0, f))


def accumulate_mean_(t: Tensor, X: Tensor, step: Scalar) -> Tensor:
    """t = (step / (step + 1)) * t + X / (step + 1): the running mean of the values seen."""
    s = _f(step, t)
    n = s + 1.0
    return inplace(t, (s / n) * t + _cast(X, t) / n)


def accumulate_moving_average_(t: Tensor, X: Tensor, f: Scalar) -> Tensor:
    """t = f * t + (1 - f) * X."""
    from . import scaled_add
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


def copy_var_update_(t: Tensor, X: Tensor) -> Tensor:
    """t = X (ai.graphcore CopyVarUpdate)."""
    return inplace(t, node("CopyVarUpdate", [t, _cast(X, t)], {}, GC)[0])


def sparse_accumulate_(t: Tensor, X: Tensor, indices: Tensor, axis: int = 0,
                       f: Optional[Scalar] = None, W: Optional[Tensor] = None) -> Tensor:
    """t[indices[i]] += f * X[i] along ``axis``."""
    from . import scaled_add, scatter_reduce
    upd = scatter_reduce(_cast(X, t), indices, "sum", axis=axis, axis_size=t.shape[axis])
    return inplace(t, scaled_add(t, upd, 1.0, 1.0 if f is None else f))


def adam_updater(acc_first_order: Tensor, acc_second_order: Tensor, weight: Optional[Tensor] = None,
                 time_step: Optional[Tensor] = None, weight_decay: Optional[Scalar] = None,
                 beta1: Scalar = 0.9, beta2: Scalar = 0.999, epsilon: Scalar = 1e-5) -> Tensor:
    """Adam's update term m_hat / (sqrt(v_hat) + eps) (+ weight_decay * w). With ``time_step``
    the moments are bias corrected (and the time step is incremented in place)."""
    from . import sqrt
    m, v = acc_first_order, acc_second_order
    if time_step is not None:
        step = inplace(time_step, time_step + 1.0)
        b1, b2 = _f(beta1, m), _f(beta2, m)
        m = m / (1.0 - b1 ** _cast(step, m))
        v = v / (1.0 - b2 ** _cast(step, v))
    upd = m / (sqrt(v) + _f(epsilon, m))
    if weight_decay is not None and weight is not None:
        upd = upd + _f(weight_decay, m) * _cast(weight, m)
    return upd


def adam_var_update(t: Tensor, x: Tensor, r1: Optional[Tensor] = None, r2: Optional[Tensor] = None,
                    learning_rate: Optional[Scalar] = None, max_weight_norm: Optional[Scalar] = None) -> Tensor:
    """t = t - lr * x (with LAMB's trust ratio r1 / r2 when given); returns t."""
    lr = 1.0 if learning_rate is None else learning_rate
    step = _cast(x, t) * _f(lr, t)
    if r1 is not None and r2 is not None:
        from . import where
        ratio = where(r2 > 0.0, r1 / r2, constant(1.0, t.dtype))
        step = step * _cast(ratio, t)
    return inplace(t, t - step)
